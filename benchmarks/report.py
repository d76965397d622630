"""The report: train_gpt.py's memory, communication and FLOP figures, measured on gloo processes of this machine and
printed beside the formulas that predict them (float32 on CPU; LayerNorm statistics and the attention's lse in float32
too).

    python3 benchmarks/report.py

1. One block at TP=1, TP2 and TP2 with SP, dense and MoE: the bytes it keeps for backward (checkpointing.py's
   measure_kept_bytes, beside train_gpt.block_activation_bytes), the bytes this rank sends in its forward's TP
   collectives (beside train_gpt.block_forward_comm_bytes), and the collectives of its forward and its backward.
   The collectives are read from the c10d ops themselves (`CollectiveLog`, a dispatch mode), so nothing in
   train_gpt.py counts them.
2. What one pipeline stage keeps under each recomputation policy (--recompute). `full` keeps each block's input,
   `sqrt` one input per segment of sqrt(L/p) blocks, `selective` recomputes the attention core (Korthikanti's
   choice). Here the core is a fused kernel (SDPA, or long_seq.py's ring over fused blocks) that keeps no s x s
   tensor: it saves q, k, v, its output and the row log-sum-exp, all O(s). Checkpointing it drops what the core
   saves beyond its inputs and its output (which the projection keeps anyway): the lse, and under CP the ring's and
   Ulysses' internal copies or the all-gathered K and V, at the price of one more attention forward (and its
   communication) in backward. So with fused kernels selective saves little without CP and most under all-gather
   CP. Kept MB of one stage of 4 blocks (L = 8, PP = 2; b = 4, s = 256, h = 256, a = 8, float32), beside the
   formula where there is one (none: L/p x block_activation_bytes; selective: minus the lse; sqrt and full: one
   block input per segment; CP's internal copies have none):

       layout                 none    selective   sqrt (2 segments)   full
       TP2 x PP2              42.07   42.01       2.10                4.19
       PP2 x CP2 ring         35.75   33.59       1.05                2.10
       PP2 x CP2 all-gather   39.94   33.59       1.05                2.10

   (tests/test_train_gpt.py runs the report and checks this table against it.) These are kept bytes, what waits
   for the backward per micro-batch in flight; the backward's recomputation adds its working set once: one block
   under `full`, a whole segment under `sqrt`, so sqrt's peak is the higher one below hundreds of layers
   (checkpointing.py measures and explains it).
3. The FLOPs of one step, counted by FlopCounterMode, against train_gpt.model_flops_per_token x tokens plus the
   2 L h s per token that a flash kernel's backward recomputes (QK^T), for a dense and a MoE model.
4. The pipeline schedules: the actions each rank ran in one step, recorded from the run and replayed
   (train_gpt.replay_pipeline), against (m + p - 1) stage times and the bubble (p - 1) / (m + p - 1) for 1F1B, and
   against train_gpt.schedule_formulas for 1F1B, interleaved and zero bubble, with the in-flight peaks the executor
   measured; then the three timelines side by side.
"""
import math
import os
import sys
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import checkpointing  # noqa: E402
import train_gpt  # noqa: E402


class CollectiveLog(TorchDispatchMode):
    """The collectives this rank issues on `group` while the mode is on: a Counter of kinds ("all_gather",
    "reduce_scatter", "all_reduce") and the bytes of the whole tensor each assembles or reduces, read from the
    tensors the c10d ops receive."""
    KINDS = {"allreduce_": "all_reduce", "_allgather_base_": "all_gather", "_reduce_scatter_base_": "reduce_scatter"}

    def __init__(self, group):
        super().__init__()
        self.group, self.counts, self.bytes = group, Counter(), Counter()

    def _on_group(self, args):
        return any(isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type())
                   and dist.ProcessGroup.unbox(a) is self.group for a in args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = self.KINDS.get(func._schema.name.split("::")[-1]) if func.namespace == "c10d" else None
        if kind and self.group is not None and self._on_group(args):
            whole = {"all_reduce": args[0], "all_gather": [args[0]], "reduce_scatter": [args[1]]}[kind]
            self.counts[kind] += 1
            self.bytes[kind] += sum(t.numel() * t.element_size() for t in whole)
        return func(*args, **(kwargs or {}))


def ring_bytes_sent(whole_bytes, t):
    """Bytes one rank sends for collectives over t ranks whose whole tensors are `whole_bytes` (by kind), as
    ring algorithms move them: an all-gather or a reduce-scatter (t-1)/t of the tensor, an all-reduce twice that."""
    factor = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}
    return sum(factor[kind] * (t - 1) * n // t for kind, n in whole_bytes.items())


def measure_kept_bytes_settled(blocks, state, policy, log=None):
    """checkpointing.measure_kept_bytes, the smaller of two runs: gloo's worker thread may let go of the tensor
    it just all-reduced a moment after the call returned, which can only add bytes. Returns (bytes, the second
    run's output); `log`, a CollectiveLog, watches the second run."""
    first, _ = checkpointing.measure_kept_bytes(blocks, state, policy)
    with log or CollectiveLog(None):
        second, y = checkpointing.measure_kept_bytes(blocks, state, policy)
    return min(first, second), y


def _phase(log, phase):
    return {f"{kind}:{phase}": n for kind, n in sorted(log.counts.items())}


def measure_block(cfg, run, b):
    """Bytes one block keeps for backward on this rank, the TP collectives of its forward and of its backward
    ({"all_reduce:fwd": 2, ...}), and the bytes this rank sends in its forward's TP collectives."""
    plan, stage, _, _ = train_gpt.build_job(cfg, run)
    x = torch.randn(b, plan.seq_hidden, cfg.n_embd, generator=torch.Generator().manual_seed(0))
    blocks, state = nn.ModuleList(stage.blocks[:1]), (x, torch.zeros((), dtype=torch.float64))
    forward, backward = CollectiveLog(plan.tp), CollectiveLog(plan.tp)
    kept, (y, _) = measure_kept_bytes_settled(blocks, state, "none", forward)
    with backward:
        y.sum().backward()
    return kept, _phase(forward, "fwd"), _phase(backward, "bwd"), ring_bytes_sent(forward.bytes, run.tp)


def measure_stage_kept_bytes(cfg, run, b, policies=("none", "selective", "sqrt", "full")):
    """Bytes this rank's pipeline stage keeps for backward under each recomputation policy."""
    plan, stage, _, _ = train_gpt.build_job(cfg, run)
    state = (torch.randn(b, plan.seq_hidden, cfg.n_embd, generator=torch.Generator().manual_seed(0)),
             torch.zeros((), dtype=torch.float64))
    return {policy: measure_kept_bytes_settled(stage.blocks, state, policy)[0] for policy in policies}


def count_step_flops(stage, pipe, optimizer, tokens, micro_batch):
    """This rank's matmul FLOPs of one training step (a real one: the optimizer steps), as torch's
    FlopCounterMode counts them, plus the two kernels it has no formula for in torch 2.13: the CPU flash attention
    (the same count as the CUDA one) and the grouped expert GEMM (2 M K N per group). On one rank it equals
    `model_flops_per_token` x tokens plus 2 L h s per token: a flash kernel's backward recomputes QK^T (hardware
    FLOPs, not model FLOPs)."""
    from torch.utils import flop_counter as fc

    def grouped_mm(a, b, *args, out_shape=None, **kwargs):
        if len(b) == 3:  # (M, K) rows x (G, K, N) weights: each row through its group's matrix
            return 2 * math.prod(out_shape) * a[-1]
        return 2 * math.prod(out_shape[1:]) * a[1]  # (K, M) x (M, N) -> (G, K, N): weight gradients, M summed

    custom = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
              lambda q, k, v, *args, **kwargs: fc.sdpa_flop_count(q, k, v),
              torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
              lambda g, q, k, v, *args, **kwargs: fc.sdpa_backward_flop_count(g, q, k, v),
              torch.ops.aten._grouped_mm: grouped_mm}
    with fc.FlopCounterMode(display=False, custom_mapping=custom) as counter:
        train_gpt.train_step(stage, pipe, optimizer, tokens, micro_batch)
    return counter.get_total_flops()


def measure_step_flops(cfg, batch, micro_batch):
    """One rank's counted FLOPs of one float32 step on `batch` synthetic sequences (after a first step, so that
    what runs once, such as the optimizer's state creation, is not part of it)."""
    run = train_gpt.JobConfig(batch=batch, micro_batch=micro_batch, dtype="float32", log=False, data="synthetic",
                              moe_grouped_gemm=cfg.moe_every > 0)  # the experts' grouped GEMM: its FLOPs counted
    plan, stage, opt, pipe = train_gpt.build_job(cfg, run)
    tokens = train_gpt.synthetic_batch(0, batch, cfg.seq_len, cfg.vocab_size)
    train_gpt.train_step(stage, pipe, opt, tokens, micro_batch)
    return count_step_flops(stage, pipe, opt, tokens, micro_batch)


def measure_schedule(cfg, batch, kind="1f1b", v=1, peaks=False):
    """The actions every pipeline rank ran in one step (one micro-batch per sequence; PP = the world), gathered on
    every rank, first rank first; with `peaks`, also each rank's measured in-flight peak."""
    run = train_gpt.JobConfig(pp=dist.get_world_size(), batch=batch, micro_batch=1, dtype="float32", log=False,
                              data="synthetic", pp_schedule=kind, virtual_stages=v)
    plan, stage, opt, pipe = train_gpt.build_job(cfg, run)
    tokens = train_gpt.synthetic_batch(0, batch, cfg.seq_len, cfg.vocab_size)
    stats = train_gpt.train_step(stage, pipe, opt, tokens, 1)[-1]
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, (plan.parallel_state.pp_rank, stats.order, stats.peak))
    ranks = sorted(ranks)
    return ([o for _, o, _ in ranks], [k for _, _, k in ranks]) if peaks else [o for _, o, _ in ranks]


def _report_rank(rank, world, store_path, queue, fn, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))  # a collective that never comes fails, not hangs
    result = fn(*args)
    if rank == 0:
        queue.put(result)  # a few numbers: the pipe holds them until the parent reads after join
    dist.barrier()
    dist.destroy_process_group()


def on_cpu_ranks(world, fn, *args):
    """fn(*args) on `world` gloo processes of this machine (forked: milliseconds each); rank 0's answer."""
    import tempfile
    import torch.multiprocessing as mp
    queue = mp.get_context("fork").SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_report_rank, (world, os.path.join(tmp, "store"), queue, fn, args), nprocs=world,
                           start_method="fork")
    return queue.get()


GPTConfig, JobConfig = train_gpt.GPTConfig, train_gpt.JobConfig
# the shapes of the figures above
REPORT_BLOCK = GPTConfig(vocab_size=32, seq_len=32, n_layer=4, n_head=4, n_embd=32)       # b = 2
REPORT_MOE = GPTConfig(vocab_size=32, seq_len=32, n_layer=4, n_head=4, n_embd=32, moe_every=1, n_experts=4,
                       top_k=2)
REPORT_STAGE = GPTConfig(vocab_size=32, seq_len=256, n_layer=8, n_head=8, n_embd=256)     # b = 4, PP = 2
REPORT_STAGE_LAYOUTS = {"TP2 x PP2": dict(tp=2, pp=2), "PP2 x CP2 ring": dict(pp=2, cp=2, cp_impl="ring"),
                        "PP2 x CP2 all-gather": dict(pp=2, cp=2, cp_impl="allgather")}
REPORT_FLOPS = {"dense": GPTConfig(vocab_size=64, seq_len=32, n_layer=2, n_head=4, n_embd=32),
                "MoE": GPTConfig(vocab_size=64, seq_len=32, n_layer=2, n_head=4, n_embd=32, moe_every=1,
                                 n_experts=4, top_k=2)}
REPORT_PIPELINE_STAGES, REPORT_PIPELINE_MICRO_BATCHES = 4, (2, 8)
REPORT_SCHEDULE = GPTConfig(vocab_size=32, seq_len=32, n_layer=8, n_head=4, n_embd=32)  # 8 layers: p = 4, v = 2
REPORT_SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))


def stage_kept_bytes_formula(cfg, run, b, policy, e=4):
    """The kept bytes of one stage where there is a formula, else None: full keeps each block's input, sqrt each
    segment's; without CP, none keeps every block's `block_activation_bytes` and selective frees their lse. (Under
    CP the ring's and the all-gather's internal copies have no formula here.)"""
    layout = train_gpt.layout_of(cfg, run, run.tp * run.pp * run.cp)
    blocks, t, sp = layout.layers_per_stage, run.tp, layout.sequence_parallel
    if policy in ("full", "sqrt"):  # block inputs: this rank's tokens (its CP shard, its SP shard), whole h
        return checkpointing.kept_bytes(policy, blocks, b, layout.seq_hidden, cfg.n_embd, cfg.n_head, e)
    if run.cp > 1:
        return None
    terms = train_gpt.block_activation_bytes(b, cfg.seq_len, cfg.n_embd, cfg.n_head, t, sp, e, e)
    none = blocks * sum(terms.values())
    return none if policy == "none" else none - blocks * cfg.n_head // t * cfg.seq_len * b * e


def report():
    """What train_gpt.py states about memory, collectives and FLOPs, measured on gloo ranks of this machine
    (float32; LayerNorm statistics and the lse in float32 too on CPU) and printed beside the formula."""
    lines = []
    out = lines.append
    b = 2
    cfg = REPORT_BLOCK
    out(f"One block (b={b}, s={cfg.seq_len}, h={cfg.n_embd}, a={cfg.n_head}, float32; MoE: {REPORT_MOE.n_experts} "
        f"experts, top-{REPORT_MOE.top_k}): bytes kept for backward, bytes this rank sends in the forward's TP "
        "collectives, measured (formula), and the collectives of forward / backward:")
    out(f"  {'layout':<16s} {'kept':>18s} {'sent forward':>16s}   collectives")
    for name, cfg, world, sp in (("TP=1", REPORT_BLOCK, 1, False), ("TP2", REPORT_BLOCK, 2, False),
                                 ("TP2 with SP", REPORT_BLOCK, 2, True), ("TP2 MoE", REPORT_MOE, 2, False),
                                 ("TP2 with SP, MoE", REPORT_MOE, 2, True)):
        run = JobConfig(tp=world, sequence_parallel=sp, micro_batch=b, dtype="float32", log=False)
        kept, fwd, bwd, sent = on_cpu_ranks(world, measure_block, cfg, run, b)
        moe = cfg.is_moe(0)
        terms = train_gpt.block_activation_bytes(b, cfg.seq_len, cfg.n_embd, cfg.n_head, world, sp, 4, 4)
        kept_formula = "-" if moe else f"{sum(terms.values()):,d}"  # no formula here for the MoE block
        sent_formula = train_gpt.block_forward_comm_bytes(b, cfg.seq_len, cfg.n_embd, world, sp, moe, 4,
                                                          cfg.n_experts)
        out(f"  {name:<16s} {f'{kept:,d} ({kept_formula})':>18s} {f'{sent:,d} ({sent_formula:,d})':>16s}   "
            f"{fwd or '-'} / {bwd or '-'}")
    cfg, b = REPORT_STAGE, 4
    policies = ("none", "selective", "sqrt", "full")
    out(f"\nKept MB of one pipeline stage of {cfg.n_layer // 2} blocks (L={cfg.n_layer}, PP=2; b={b}, s={cfg.seq_len}, "
        f"h={cfg.n_embd}, a={cfg.n_head}, float32), measured (formula):")
    out(f"  {'layout':<22s}" + "".join(f"{p:>22s}" for p in policies))
    for name, layout in REPORT_STAGE_LAYOUTS.items():
        run = JobConfig(micro_batch=b, dtype="float32", log=False, **layout)
        kept = on_cpu_ranks(run.tp * run.pp * run.cp, measure_stage_kept_bytes, cfg, run, b)
        cells = []
        for p in policies:
            formula = stage_kept_bytes_formula(cfg, run, b, p)
            cells.append(f"{kept[p] / 1e6:.2f}" + (f" ({formula / 1e6:.2f})" if formula is not None else " (-)"))
        out(f"  {name:<22s}" + "".join(f"{c:>22s}" for c in cells))
    out("\nFLOPs of one step (batch 4 x 32 tokens, one rank): FlopCounterMode against model_flops_per_token x tokens "
        "+ 2 L h s per token (the flash backward's QK^T):")
    for name, cfg in REPORT_FLOPS.items():
        tokens = 4 * cfg.seq_len
        measured = on_cpu_ranks(1, measure_step_flops, cfg, 4, 2)
        model = train_gpt.model_flops_per_token(cfg) * tokens
        flash = 2 * cfg.n_layer * cfg.n_embd * cfg.seq_len * tokens
        out(f"  {name:<6s} measured {measured:>12,d}   formula {model:,d} + {flash:,d} = {model + flash:,d}")
    p = REPORT_PIPELINE_STAGES
    out(f"\n1F1B bubble: the order each of p={p} stages ran one step in, replayed with a forward taking 1 unit and a "
        "backward 2 (replay_pipeline), against (m + p - 1) x 3 and the bubble (p - 1) / (m + p - 1):")
    for m in REPORT_PIPELINE_MICRO_BATCHES:
        span = train_gpt.replay_pipeline(on_cpu_ranks(p, measure_schedule, REPORT_BLOCK, m))
        out(f"  m={m:<3d} replayed {span:>3d} units (formula {(m + p - 1) * 3}), bubble {1 - 3 * m / span:.3f} "
            f"(formula {(p - 1) / (m + p - 1):.3f})")
    m = REPORT_PIPELINE_MICRO_BATCHES[-1]
    out(f"\nEvery schedule, p={p} m={m}: the actions each rank ran (recorded from a step), replayed in units of one "
        "chunk's forward (B 2, or B 1 + W 1 when split), against the formula; in-flight peak per rank (chunks) "
        "measured by the executor (formula):")
    for kind, v in REPORT_SCHEDULES:
        orders, peaks = on_cpu_ranks(p, measure_schedule, REPORT_SCHEDULE, m, kind, v, True)
        split = kind == "zb-h1"
        span = train_gpt.replay_pipeline(orders, backward=1 if split else 2, v=v)
        formula, peak_formula = train_gpt.schedule_formulas(kind, p, m, v)
        bubble = (span - 3 * m * v) / span
        out(f"  {kind:<11s} v={v}  replayed {span:>3d} units (formula {formula:>3d}), bubble {bubble:.3f} of the step; "
            "in flight " + ", ".join(f"{k} ({f})" for k, f in zip(peaks, peak_formula)))
    out("\nThe three schedules side by side (train_gpt.py --show-schedule):")
    for kind, v in REPORT_SCHEDULES[:3]:
        out(train_gpt.timeline(kind, p, m, v) + "\n")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
