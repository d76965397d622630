"""Is train_gpt.py's pipeline executor as fast as torch.distributed.pipelining's schedules on the same model?

    python3 benchmarks/pipeline_vs_torch.py [--layers 4 --hidden 256 --heads 8 --seq 256 --batch 8 --micro-batch 2
                                             --pp 2 --virtual-stages 2 --schedules 1f1b,interleaved,zb-h1
                                             --rounds 10 --steps-per-round 3 --breakdown]
    python3 benchmarks/pipeline_vs_torch.py --schedules zbv,dualpipev [--moe-every 1 --experts 4 --ep 2 --overlap]

--pp x --ep gloo processes of this machine, one thread each. Every rank builds train_gpt.py's stage twice (the same
weights: every tensor is initialised from the seed): one runs train_gpt.py's executor (`train_step`), the other is
cut into its chunks, each a torch PipelineStage, run by the schedule torch names for ours (1f1b: Schedule1F1B,
interleaved: ScheduleInterleaved1F1B, zb-h1: ScheduleInterleavedZeroBubble, zbv: ScheduleZBVZeroBubble, dualpipev:
ScheduleDualPipeV, whose F&B pairs torch runs one after the other) with the same loss (the summed cross entropy
over the global token count) and then the same gradient reductions and optimizer step (AdamW, FP32). Both run the
same order of actions; what differs is how each waits for its transfers (and, in DualPipeV's pairs, ours overlaps
the halves). With --moe-every the model has MoE layers, their experts over --ep ranks (EP folds over DP: --ep
pipelines), their router losses weighted by 0 (torch's schedule takes the last stage's loss only). Parity first:
the two copies' losses over the first steps must agree, else the script stops. Then the two alternate in rounds of
--steps-per-round steps (the first round not counted); for each schedule the ratio torch / ours of the median step
times is printed (> 1: ours faster) with a 95% interval (the rounds resampled together) and the spread of the
per-round ratios, and each rank's median CPU seconds per step (the work each executor does, which a loaded machine's
waits do not inflate). --breakdown adds, per rank and program, where the step's time goes, in milliseconds per step:
compute (the actions: F forwards with the loss, B backwards, W weight gradients; ours F&B, DualPipeV's pairs whole,
their inputs' waits included, as their two threads share one clock; torch runs a pair's F and B one after the other),
waiting on transfers (ours: on receives, on sends), posting transfers (the buffers, the irecv and isend calls), the
executor's own bookkeeping (the rest of its schedule: ours `run_schedule`, torch's `_step_microbatches`) and the
step's tail (the gradient reductions, the optimizer, the loss's all-reduce; torch's also splits the batch into
micro-batches). --overlap first races DualPipeV's pairs overlapped against the same pairs one after the other, with
per rank the seconds the all-to-alls and the halves' inputs travelled beside the other half's compute and those still
waited for.
"""
import argparse
import collections
import functools
import os
import random
import statistics
import sys
import tempfile
import time
import types
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt  # noqa: E402

TORCH_SCHEDULES = {"1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                   "zb-h1": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
                   "dualpipev": "ScheduleDualPipeV"}


class Chunk(nn.Module):
    """One model chunk of train_gpt.py's stage as a module of its own: its parameters only (torch's zero bubble
    takes the weight gradients of the submodule's parameters), its forward the stage's for that chunk."""

    def __init__(self, stage, chunk, positions):
        super().__init__()
        self.blocks = nn.ModuleList(stage.chunk_blocks(chunk))
        if stage.is_first_chunk(chunk):
            self.wte, self.wpe = stage.wte, stage.wpe
        if stage.is_last_chunk(chunk):
            self.ln_f, self.lm_head = stage.ln_f, stage.lm_head
        self.run, self.positions = functools.partial(stage.forward, chunk=chunk), positions

    def forward(self, x):
        return self.run(x, self.positions)[0]  # the router loss: 0 (a dense GPT; the MoE race weighs it by 0)


def layout(a, kind):
    v = 1 if kind == "1f1b" else 2 if kind in train_gpt.V_SCHEDULES else a.virtual_stages
    return train_gpt.JobConfig(pp=a.pp, ep=a.ep, batch=a.batch, micro_batch=a.micro_batch, dtype="float32", lr=1e-3,
                               log=False, data="synthetic", pp_schedule=kind, virtual_stages=v)


def model(a):
    """The race's GPT; with --moe-every, MoE layers whose router losses weigh 0 (torch's schedule takes the loss of
    the last stage's output only: each program then computes the same loss)."""
    return train_gpt.GPTConfig(vocab_size=256, seq_len=a.seq, n_layer=a.layers, n_head=a.heads, n_embd=a.hidden,
                               moe_every=a.moe_every, n_experts=a.experts, top_k=2, aux_loss_coeff=0.0,
                               z_loss_coeff=0.0)


def ours(cfg, run):
    """train_gpt.py's step: (step(tokens) -> loss, the stage)."""
    _, stage, opt, pipe = train_gpt.build_job(cfg, run)
    return (lambda tokens: train_gpt.train_step(stage, pipe, opt, tokens, run.micro_batch, run.grad_clip)[0]), stage


def torchs(cfg, run, kind):
    """The same stage under torch.distributed.pipelining's schedule for `kind`: step(tokens) -> loss."""
    from torch.distributed import pipelining
    plan, stage, opt, _ = train_gpt.build_job(cfg, run)
    p, v, rank = run.pp, run.virtual_stages, plan.parallel_state.pp_rank
    m = plan.micro_batch_count
    positions = torch.arange(cfg.seq_len)
    # chunk c: stage c p + r, or in a V stage r (chunk 0) and 2p - 1 - r (chunk 1); the loss on the last stage's rank
    index = (lambda c: train_gpt.v_stage(p, rank, c)) if kind in train_gpt.V_SCHEDULES else (lambda c: c * p + rank)
    stages = [pipelining.PipelineStage(Chunk(stage, c, positions), index(c), p * v, torch.device("cpu"),
                                       group=plan.pp) for c in range(v)]
    first, last = rank == 0, stage.is_last_chunk(v - 1)
    global_tokens = run.batch * cfg.seq_len
    loss_fn = lambda logits, targets: stage.loss_sum(logits, targets) / global_tokens  # noqa: E731
    schedule_class = getattr(pipelining, TORCH_SCHEDULES[kind])
    schedule = schedule_class(stages[0] if kind == "1f1b" else stages, m, loss_fn=loss_fn, scale_grads=False)

    def step(tokens):
        losses = []
        tokens = tokens.chunk(plan.dp)[plan.parallel_state.dp_rank]  # this pipeline's sequences, as plan's
        inputs = (tokens[:, :-1],) if first else ()
        schedule.step(*inputs, target=tokens[:, 1:] if last else None, losses=losses,
                      return_outputs=False)  # as ours, which keeps no logits
        for reduction in stage.reductions:  # train_step's tail: the same reductions and optimizer step
            if not reduction.data_parallel:
                opt.all_reduce_grads(reduction.params, reduction.group)
        opt.step(max_norm=run.grad_clip, norm_group=plan.world, norm_params=stage.norm_params)
        loss = torch.stack(losses).sum().double() if losses else torch.zeros((), dtype=torch.float64)
        dist.all_reduce(loss)
        return loss.item()
    return step


class Breakdown:
    """Time per step in one program's parts, by wrapping them: each part is (owner, attribute, label), the label a
    string or a function of the call's arguments (ours names the action's kind), "schedule" for the whole
    schedule, whence the bookkeeping (the schedule less its parts) and the tail (the step less the schedule). A part
    called inside another (a receive posting itself) counts in the outer one only. `restore()` puts the originals
    back, so that one schedule's wrappers never time the next one's."""

    def __init__(self, parts):
        self.seconds, self.total, self.on, self.inside, self.originals = collections.Counter(), 0.0, False, 0, []
        try:
            for owner, name, label in parts:
                self.originals.append((owner, name, owner.__dict__[name]))
                setattr(owner, name, self.timed(owner.__dict__[name], label))
        except BaseException:  # a part torch no longer has: put back those wrapped so far
            self.restore()
            raise

    def restore(self):
        for owner, name, original in self.originals:
            setattr(owner, name, original)

    def timed(self, fn, label):
        part = label != "schedule"

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            outermost = not (part and self.inside)
            self.inside += part
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside -= part
                if self.on and outermost:
                    self.seconds[label(args) if callable(label) else label] += time.perf_counter() - t0
        return wrapper


def add_breakdowns(kind, timed):
    """A Breakdown of each program into `timed` (each there as soon as it wraps, so that a failure restores it):
    ours (train_gpt.py's executor) and torch's schedule for `kind`. Torch's zero bubble runs the first stage's whole
    backward in W (its B has no input gradient to make there): compare B + W."""
    from torch.distributed.pipelining import schedules, stage
    pipe, base = train_gpt.Pipeline, stage._PipelineStageBase
    runner = getattr(schedules, TORCH_SCHEDULES[kind])
    runner = next(c for c in runner.__mro__ if "_step_microbatches" in c.__dict__)
    kind_of_action = lambda args: f"compute {args[2].kind}"  # noqa: E731 (pipe.run_action(stage, action, ...))
    timed["ours"] = Breakdown(((pipe, "run_action", kind_of_action), (train_gpt.ZeroBubblePipeline, "run_action",
                                kind_of_action), (train_gpt.VPipeline, "run_pair", "compute F&B"),
                               (pipe, "receive", "waiting on receives"),
                               (pipe, "collect_sends", "waiting on sends"), (pipe, "post_receive", "posting receives"),
                               (pipe, "send", "posting sends"), (train_gpt, "run_schedule", "schedule")))
    timed["torch"] = Breakdown(((base, "forward_one_chunk", "compute F"), (base, "backward_one_chunk", "compute B"),
                                (base, "backward_weight_one_chunk", "compute W"),
                                (schedules._PipelineSchedule, "_maybe_compute_loss", "compute F"),
                                (schedules, "_wait_batch_p2p", "waiting on transfers"),
                                (schedules, "_batch_p2p", "posting transfers"),
                                (runner, "_step_microbatches", "schedule")))


def race(programs, a, cfg, timed=None):
    """Alternating rounds (ABBA); per program each counted round's step times and the CPU seconds of each counted
    step on this rank (all its threads: the work, whatever the machine's load adds to the waits). `timed`: each
    program's Breakdown, on during its counted steps."""
    times, cpu, k = {name: [] for name in programs}, {name: [] for name in programs}, 0
    for r in range(a.rounds + 1):  # round 0 warms up both and is not counted
        for name, step in (list(programs.items()) if r % 2 else list(programs.items())[::-1]):
            round_times = []
            for _ in range(a.steps_per_round):
                tokens = train_gpt.synthetic_batch(k, a.batch, cfg.seq_len, cfg.vocab_size)
                k += 1
                dist.barrier()  # both ranks start each step together
                if timed:
                    timed[name].on = r > 0
                t0, c0 = time.perf_counter(), time.process_time()
                step(tokens)  # each ends with an all-reduce of the loss: the clock sees the whole step
                round_times.append(time.perf_counter() - t0)
                if r:
                    cpu[name].append(time.process_time() - c0)
                if timed and timed[name].on:
                    timed[name].total += round_times[-1]
                    timed[name].on = False
            if r:
                times[name].append(round_times)
    return times, cpu


def pooled_median(rounds, which):
    return statistics.median(t for i in which for t in rounds[i])


def ratio_interval(times, resamples=1000, seed=0, num="torch", den="ours"):
    """A 95% percentile-bootstrap interval of num / den (torch / ours): the rounds drawn again with replacement,
    both programs' rounds of one draw together (they ran side by side), the ratio of the pooled medians of each
    draw."""
    rng, n = random.Random(seed), len(times[den])
    draws = ([rng.randrange(n) for _ in range(n)] for _ in range(resamples))
    ratios = sorted(pooled_median(times[num], d) / pooled_median(times[den], d) for d in draws)
    return ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]


def compare(a, kind):
    """On every rank: parity, then the race. Rank 0's lines to print."""
    cfg, run = model(a), layout(a, kind)
    timed = {}
    try:
        if a.breakdown:
            add_breakdowns(kind, timed)
        return _compare(a, kind, cfg, run, timed)
    finally:
        for breakdown in timed.values():
            breakdown.restore()


def _compare(a, kind, cfg, run, timed):
    step_ours, _ = ours(cfg, run)
    programs = {"ours": step_ours, "torch": torchs(cfg, run, kind)}
    lines = []
    for k in range(a.parity_steps):  # parity first: the same losses from the same weights and data
        tokens = train_gpt.synthetic_batch(1000 + k, a.batch, cfg.seq_len, cfg.vocab_size)
        mine, theirs = programs["ours"](tokens), programs["torch"](tokens)
        if abs(mine - theirs) > 1e-5 * abs(mine):
            raise SystemExit(f"{kind}: step {k} losses differ: ours {mine!r}, torch {theirs!r}")
        lines.append(f"    parity step {k}: loss ours {mine:.6f}, torch {theirs:.6f}")
    times, cpu = race(programs, a, cfg, timed)
    med = {name: pooled_median(t, range(len(t))) for name, t in times.items()}
    lo, hi = ratio_interval(times)
    per_round = [statistics.median(t) / statistics.median(o) for t, o in zip(times["torch"], times["ours"])]
    lines += [f"    {name:6s} median step {t * 1000:7.1f} ms" for name, t in med.items()]
    lines.append(f"    ratio torch / ours = {med['torch'] / med['ours']:.3f} (95% interval {lo:.3f} to {hi:.3f}; "
                 f"rounds {min(per_round):.3f} to {max(per_round):.3f}; >= 1: ours as fast)")
    cpu_per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(cpu_per_rank, {name: statistics.median(s) for name, s in cpu.items()})
    lines += [f"    rank {rank} CPU per step: ours {c['ours'] * 1000:.1f} ms, torch {c['torch'] * 1000:.1f} ms, "
              f"torch / ours = {c['torch'] / c['ours']:.3f}" for rank, c in enumerate(cpu_per_rank)]
    for name, breakdown in timed.items():
        lines += breakdown_lines(name, breakdown, a.rounds * a.steps_per_round)
    return lines


def overlap_race(a):
    """DualPipeV's F&B pairs overlapped against the same pairs run one after the other, in one program (the flag
    toggled between rounds): the ratio of the median steps, and per rank the seconds per step the all-to-alls
    and the halves' inputs from the neighbours travelled beside the other half's compute, those still waited for,
    and the handovers."""
    cfg, run = model(a), layout(a, "dualpipev")
    _, stage, opt, pipe = train_gpt.build_job(cfg, run)
    figures = {}  # mode: [beside, waited, handovers, each of the all-to-alls then the inputs] summed over its steps
    baton = pipe.baton
    read = lambda: [table[kind] for table in (baton.beside, baton.exposed, baton.handovers)  # noqa: E731
                    for kind in ("all-to-all", "p2p")]

    # race() switches `on` for the steps it counts (not its warm-up round), as it does a Breakdown's
    counted = {name: types.SimpleNamespace(on=False, total=0.0) for name in ("overlapped", "one after the other")}

    def program(overlap, name):
        def step(tokens):
            pipe.overlap = overlap
            before = read()
            loss = train_gpt.train_step(stage, pipe, opt, tokens, run.micro_batch, run.grad_clip)[0]
            if counted[name].on:
                total = figures.setdefault(overlap, [0.0] * 6)
                for i, (x, y) in enumerate(zip(before, read())):
                    total[i] += y - x
            return loss
        return step
    programs = {"overlapped": program(True, "overlapped"),
                "one after the other": program(False, "one after the other")}
    for k in range(a.parity_steps):  # warm-up: both before the clock
        for step in programs.values():
            step(train_gpt.synthetic_batch(1000 + k, a.batch, cfg.seq_len, cfg.vocab_size))
    times, _ = race(programs, a, cfg, counted)
    med = {name: pooled_median(t, range(len(t))) for name, t in times.items()}
    lo, hi = ratio_interval(times, num="one after the other", den="overlapped")
    lines = [f"    {name:20s} median step {t * 1000:7.1f} ms" for name, t in med.items()]
    lines.append(f"    ratio one after the other / overlapped = {med['one after the other'] / med['overlapped']:.3f} "
                 f"(95% interval {lo:.3f} to {hi:.3f}; > 1: the overlap pays)")
    steps = a.rounds * a.steps_per_round
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, {mode: [x / steps for x in f] for mode, f in figures.items()})
    for rank, f in enumerate(per_rank):
        for mode, name in ((True, "overlapped"), (False, "one after the other")):
            a2a_beside, p2p_beside, a2a_exposed, p2p_exposed, a2a_handovers, p2p_handovers = f[mode]
            lines.append(f"    rank {rank} {name:20s} per step: all-to-alls beside the other half's compute "
                         f"{a2a_beside * 1000:6.1f} ms, waited for {a2a_exposed * 1000:6.1f} ms ({a2a_handovers:.0f} "
                         f"handovers); the halves' inputs beside {p2p_beside * 1000:6.1f} ms, waited for "
                         f"{p2p_exposed * 1000:6.1f} ms ({p2p_handovers:.0f} handovers)")
    return lines


def breakdown_lines(name, breakdown, steps):
    """Per rank, ms per step of program `name` in each part, and its share of the step."""
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, (breakdown.total, dict(breakdown.seconds)))
    lines = []
    for rank, (total, seconds) in enumerate(shares):
        schedule = seconds.pop("schedule")
        parts = sorted(seconds.items())
        parts += [("bookkeeping", schedule - sum(seconds.values())), ("tail", total - schedule)]
        said = ", ".join(f"{label} {s / steps * 1000:.1f} ms ({s / total:.1%})" for label, s in parts)
        lines.append(f"    {name} rank {rank}, per step: {said}")
    return lines


def _rank(rank, world, store_path, queue, a):
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=a.timeout))  # a transfer that never comes fails, not hangs
    out = []
    if a.overlap:
        out += ["  dualpipev overlapped against its pairs one after the other:"] + overlap_race(a)
    for kind in a.schedules.split(",") if a.schedules else ():
        out += [f"  {kind} against torch's {TORCH_SCHEDULES[kind]}:"] + compare(a, kind)
    if rank == 0:
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--layers", 4), ("--hidden", 256), ("--heads", 8), ("--seq", 256), ("--batch", 8),
                          ("--micro-batch", 2), ("--pp", 2), ("--virtual-stages", 2), ("--rounds", 10),
                          ("--steps-per-round", 3), ("--parity-steps", 2), ("--timeout", 300), ("--ep", 1),
                          ("--moe-every", 0), ("--experts", 4)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--schedules", default="1f1b,interleaved,zb-h1")
    ap.add_argument("--breakdown", action="store_true", help="also where each program's step time goes, per rank")
    ap.add_argument("--overlap", action="store_true", help="first race dualpipev's F&B pairs overlapped against "
                    "the same pairs one after the other, with each rank's communication beside compute")
    a = ap.parse_args()
    unknown = set(a.schedules.split(",")) - set(TORCH_SCHEDULES) - {""}
    if unknown or a.rounds < 1 or a.steps_per_round < 1:
        print(f"pipeline_vs_torch.py: error: schedules {sorted(unknown)} unknown or rounds < 1", file=sys.stderr)
        sys.exit(2)
    moe = f", MoE every {a.moe_every} of {a.experts} experts top-2, EP {a.ep} (DP {a.ep})" if a.moe_every else ""
    print(f"GPT L={a.layers} h={a.hidden} heads={a.heads} s={a.seq} batch={a.batch} in micro-batches of "
          f"{a.micro_batch}, PP {a.pp} (interleaved and zb-h1: {a.virtual_stages} virtual stages per rank; zbv and "
          f"dualpipev: 2 in a V){moe}, one thread per rank, FP32 AdamW; {a.rounds} alternating rounds of "
          f"{a.steps_per_round} steps")
    world = a.pp * a.ep  # EP folds over DP: as many pipelines as EP ranks
    queue = mp.get_context("fork").SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, (world, os.path.join(tmp, "store"), queue, a), nprocs=world, start_method="fork")
    print("\n".join(queue.get()))


if __name__ == "__main__":
    main()
