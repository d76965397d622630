"""--async-save against the synchronous save: the seconds the training loop is blocked per GB of checkpoint.

    python3 benchmarks/async_save.py [--hidden 1024 --layers 4 --rounds 3]       # one process (gloo), CPU or GPU

Each round trains the same model twice, synchronously and with --async-save in turn (the order alternates between
rounds: the machine's load drifts), saving every --save-every steps, and times every call of save_checkpoint from
the loop (the synchronous save writes, fsyncs and checksums there; the asynchronous one waits for the save before
it, if still writing, then copies the tensors to host memory, pinned on CUDA) and the run's end (where the last
background write is waited for). The checkpoint's bytes are its files'. Printed: per round and mode, the blocked
seconds of each save and of the end; per GB, the median save's (the steady state: the write ends before the next
save) and all of them with the end's (the run's last write is not overlapped); the medians over the rounds last.
"""
import argparse
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt  # noqa: E402


def one_run(cfg, run, out):
    blocked, real_save, real_release = [], train_gpt.save_checkpoint, train_gpt.release_out_dir

    def timed(fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                blocked.append(time.perf_counter() - t0)
        return call
    train_gpt.save_checkpoint, train_gpt.release_out_dir = timed(real_save), timed(real_release)
    try:
        records = train_gpt.train_job(cfg, run)
    finally:
        train_gpt.save_checkpoint, train_gpt.release_out_dir = real_save, real_release
    ckpt = train_gpt.checkpoint_dirs(out)[-1]
    size = sum(os.path.getsize(os.path.join(ckpt, n)) for n in os.listdir(ckpt))
    step = statistics.median(r["step_time_s"] for r in records)
    return blocked[:-1], blocked[-1], size, step


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    flags = ap.parse_args()
    if "RANK" not in os.environ:  # one process: a world of 1
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    cfg = train_gpt.GPTConfig(n_layer=flags.layers, n_head=8, n_embd=flags.hidden, seq_len=32, vocab_size=256)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"{train_gpt.parameter_count(cfg):,} parameters, AdamW, float32; saves every {flags.save_every} of "
          f"{flags.steps} steps; {device}")
    per_gb = {"sync": [], "async": []}
    root = tempfile.mkdtemp(prefix="async_save_")
    try:
        for r in range(flags.rounds):
            for mode in (("sync", "async") if r % 2 == 0 else ("async", "sync")):
                out = os.path.join(root, f"{mode}{r}")
                run = train_gpt.JobConfig(batch=2, micro_batch=2, steps=flags.steps, save_every=flags.save_every,
                                            out_dir=out, async_save=mode == "async", data="synthetic", log=False)
                saves, end, size, step = one_run(cfg, run, out)
                gb = size / 1e9
                in_loop, total = statistics.median(saves) / gb, (sum(saves) + end) / (len(saves) * gb)
                per_gb[mode].append((in_loop, total))
                print(f"round {r} {mode:5s}: checkpoint {gb:.3f} GB; blocked per save "
                      f"{', '.join(f'{s:.2f}' for s in saves)} s, at the run's end {end:.2f} s: {in_loop:.2f} s per "
                      f"GB in the loop (median save), {total:.2f} with the end (step {step:.2f} s)", flush=True)
                shutil.rmtree(out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for k, what in enumerate(("in the loop", "with the run's end")):
        sync, asyn = (statistics.median(v[k] for v in per_gb[m]) for m in ("sync", "async"))
        print(f"median over {flags.rounds} rounds, {what}: synchronous {sync:.2f} s per GB, asynchronous {asyn:.2f} "
              f"s per GB ({sync / asyn:.1f}x less time blocked)")


if __name__ == "__main__":
    main()
