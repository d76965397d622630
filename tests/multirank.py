"""Run a function on N gloo ranks in forked processes: the helper every multi-rank test uses.

    results = run_ranks(fn, world_size, *args, timeout=60)

`fn(rank, world_size, *args)` runs in each rank after `torch.distributed` is initialised on a gloo
group of `world_size` ranks (FileStore rendezvous, no port to pick), with one intra-op thread per rank.
The return values come back as a list indexed by rank. Any rank that raises makes the whole call fail with
that rank's traceback; a rank that hangs (a deadlock, a missing collective) makes it fail after `timeout`
seconds with the list of ranks that never answered. Nothing is left running: stragglers are killed.

Why fork: starting a rank by fork costs milliseconds, spawning a fresh interpreter that imports torch costs
seconds (8 ranks: ~0.2 s against ~30 s on 2 cores). Why bytes: a tensor put on a multiprocessing queue
travels as a shared-memory handle that vanishes when its rank exits, so results are serialised with
`torch.save` into bytes and loaded in the parent.
"""
import io
import multiprocessing as mp
import os
import tempfile
import traceback
from datetime import timedelta

import torch
import torch._dynamo  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed as dist

# The imports above: a process's first TorchDispatchMode (FlopCounterMode, the memory and host-sync counters of the
# technique files) imports torch._dynamo, about 1 s, and its first checkpoint torch.distributed.checkpoint, 0.6 s.
# Imported once here, every forked rank inherits them (without the first, tests/test_train_gpt.py alone took 340 s
# instead of 176; without the second, the resume tests 111 s instead of 101).
DEFAULT_TIMEOUT_S = 120


def _rank_main(fn, rank, world_size, store_path, conn, args, kwargs, collective_timeout_s):
    payload = None
    try:
        torch.set_num_threads(1)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=collective_timeout_s))
    except BaseException:
        payload = ("init_error", traceback.format_exc())  # the machine, not the code under test: retried
    if payload is None:
        try:
            result = fn(rank, world_size, *args, **kwargs)
            buf = io.BytesIO()
            torch.save(result, buf)
            payload = ("ok", buf.getvalue())
        except BaseException:  # the parent must hear about every failure, even KeyboardInterrupt
            payload = ("error", traceback.format_exc())
    try:
        conn.send(payload)
        if payload[0] == "ok":
            dist.barrier()  # no rank tears its sockets down while a peer may still be talking to it
        dist.destroy_process_group()
    finally:
        conn.close()
        os._exit(0)  # skip atexit handlers inherited from the parent (pytest's among them)


def value_errors(*calls):
    """The ValueError message of each call, or None where it did not raise (bad-input tests run this on
    every rank, then check that nothing was sent: validation comes before communication)."""
    messages = []
    for call in calls:
        try:
            call()
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    return messages


class _InitError(RuntimeError):
    pass


def run_ranks(fn, world_size, *args, timeout=DEFAULT_TIMEOUT_S, **kwargs):
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` gloo ranks; return the results by rank.

    A failure to set up the gloo group itself (before `fn` runs) is retried once with fresh processes."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    try:
        return _launch(fn, world_size, args, kwargs, timeout)
    except _InitError:
        return _launch(fn, world_size, args, kwargs, timeout)


def _launch(fn, world_size, args, kwargs, timeout):
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs, conns = [], []
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank_main, daemon=True,
                            args=(fn, rank, world_size, store_path, child_end, args, kwargs,
                                  max(timeout - 5, 5)))
            p.start()
            child_end.close()
            procs.append(p)
            conns.append(parent_end)
        try:
            return _collect(procs, conns, timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=5)


def _collect(procs, conns, timeout):
    import time
    deadline = time.monotonic() + timeout
    results = [None] * len(procs)
    pending = set(range(len(procs)))
    while pending:
        ready = mp.connection.wait([conns[r] for r in pending], timeout=max(deadline - time.monotonic(), 0))
        if not ready:
            raise TimeoutError(f"ranks {sorted(pending)} of {len(procs)} did not finish within {timeout} s "
                               "(a deadlock: a collective that not every rank of its group reached?)")
        for conn in ready:
            rank = conns.index(conn)
            pending.discard(rank)
            try:
                status, payload = conn.recv()
            except EOFError:
                raise RuntimeError(f"rank {rank} died without a result (exit code {procs[rank].exitcode})") from None
            if status == "init_error":
                raise _InitError(f"rank {rank} of {len(procs)} could not join the gloo group:\n{payload}")
            if status == "error":
                raise RuntimeError(f"rank {rank} of {len(procs)} failed:\n{payload}")
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    return results
