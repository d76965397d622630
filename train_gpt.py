"""Train a nanoGPT-style GPT with tensor, sequence, pipeline, data, context and expert parallelism, by torchrun.

    torchrun --nproc_per_node=8 train_gpt.py --tp 2 --sequence-parallel --pp 2 --cp 2 --ep 2 --moe-every 2 --experts 4
    python3 train_gpt.py --steps 10 --metrics metrics.jsonl          # one process: the plain GPT, nanoGPT's loop

Every parallel dimension is decided in ONE place, the `Plan` made at start-up from the layout flags (with every
value the layout implies: shard lengths, micro-batch count, this stage's layers); the model and the step read it:

    dimension     group (None: size 1)   what it splits                                 done by
    TP tensor     plan.tp                weights: heads, MLP columns and rows, the vocab plan.column/row_parallel
    SP sequence   plan.tp (same ranks)   LayerNorm and residual activations along s     _TPLinear, plan.reduce_tp
    CP context    plan.cp                the sequence, attention included                plan.attention (long_seq)
    PP pipeline   plan.pp                the layers                                      run_schedule, Pipeline
    DP data       plan.dp_cp             the batch, in sequences (the group spans CP)    plan.micro_batches
    EP expert     plan.ep, expert_dp     the experts of MoE layers, folded over DP x CP  moe_ep.MoE

Convention (Megatron-LM's): a linear layer is Y = X A, A = W^T of PyTorch's (out, in) weight W. Column-parallel
splits A's columns (the outputs: W's rows), row-parallel A's rows (the inputs: W's columns).
TP (Shoeybi et al. 2019): an MLP's first A split by columns and its second by rows need one all-reduce forward and
one backward, the pair f (identity forward, all-reduce backward: in _TPLinear's backward) and g (all-reduce
forward, identity backward: _ReduceFromTP); attention splits the heads alike; the tied embedding is split over the
vocabulary and the loss assembled from vocabulary-sharded logits (one MAX of (N,), one SUM of (2, N) values).
SP (Korthikanti et al. 2022): between the TP regions each rank holds s/t of the tokens; f becomes an all-gather
forward and a reduce-scatter backward (in _TPLinear), g a reduce-scatter forward and an all-gather backward
(_ReduceScatterToSP): the same bytes as the all-reduces, and every activation of a block is split by t.
Gradients (`gradient_reductions`): each a SUM over a group, then ONE normalisation by the global token count where
each backward starts. The tied embedding is summed over its two copies (first and last stage); what acts on a
token shard while replicated over TP (LayerNorms, row-parallel biases, positions under SP, MoE layers under TP)
over TP; dense weights over DP x CP and experts over expert DP, in the optimizer (all-reduce, or with --zero 1
Megatron-LM's distributed optimizer: reduce-scatter, each rank steps its shard, all-gather).
PP: a schedule is a list of actions per rank (forward F, backward B), run by one executor. 1F1B (Narayanan et al.
2021): p - 1 - i warm-up forwards on stage i, then one forward and one backward at a time: a bubble of
(p-1)/(m+p-1) of the step, at most p - i micro-batches in flight on stage i. At PP = 1 the step runs each
micro-batch's forward and backward directly.
DP and CP: DP ranks take other sequences of the batch, CP ranks shards of the same ones (zigzag: causal work
balanced). Each parameter is drawn whole from a generator named after it, so every layout trains the same model.
EP: MoE layers run on the TP ranks' token shards with whole expert weights, experts spread over EP by all-to-all;
the router losses come from statistics summed over the ranks that share a micro-batch (TP x CP), as Megatron-LM.
Memory and precision: recomputation per stage (checkpointing.py); FP32 main grads and masters, FP16 loss scaling,
per-tensor FP8 block GEMMs, ZeRO-1 (mixed_precision.py); micro-batches are grad_accum.py's steps.

One composed step, in reading order: `train` (nanoGPT's loop: learning rate, batch, step, one log line) ->
`train_step` -> `run_schedule` (PP > 1) or each micro-batch directly -> `forward_micro_batch` -> `GPTStage.forward`
-> `Block.forward` -> `Block.attention` -> `Plan.attention` (long_seq.py under CP) -> back: `gradient_reductions`'
sums -> `MixedPrecisionOptimizer.step`. `main` parses the chapter's flags and runs `train`.

These lines, up to the BEYOND THE CHAPTER banner, are the chapter, and train alone with the six files' lines above
theirs. The whole file goes on with interleaved, zero-bubble and V-shaped schedules, all-gather and hybrid CP,
finer FP8, NVFP4, ZeRO-2/3 and the formulas, then THE JOB: the same step with checkpoints, validation, the full
command line.
"""
import argparse
import functools
import json
import math
import os
import time
import zlib
from dataclasses import dataclass, fields
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

import checkpointing
import long_seq
import mixed_precision
import moe_ep
import topology


# ---- Configs: the model, and everything about a run that is not the model ----------------------------------

@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    seed: int = 0
    moe_every: int = 0        # every n-th block's MLP is a mixture of experts (0: dense model)
    n_experts: int = 8
    top_k: int = 2
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: float = 1e-3

    def is_moe(self, layer):
        return self.moe_every > 0 and (layer + 1) % self.moe_every == 0


# --dtype: the weights' (and activations') dtype; masters, main grads and optimizer states stay FP32 (float64 for
# float64). FP8 keeps BF16 weights and runs the block GEMMs in FP8.
PARAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "fp8": torch.bfloat16, "float64": torch.float64}


@dataclass
class TrainConfig:
    """Everything about a run that is not the model: layout, memory and precision, optimisation, logging."""
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1                       # expert parallel, folded over DP x CP
    sequence_parallel: bool = False
    cp_impl: str = "ring"             # ring | ulysses (CP_IMPLS)
    recompute: str = "none"           # none | full | sqrt | selective (checkpointing.POLICIES)
    dtype: str = "float32"            # PARAM_DTYPES: float32 | bfloat16 | float16 | fp8 | float64
    fp8_recipe: str = "tensorwise"    # with --dtype fp8: tensorwise | delayed (mixed_precision.PER_TENSOR_RECIPES)
    zero: int = 0                     # 1: the distributed optimizer, optimizer states sharded over DP x CP
    batch: int = 16                   # global batch, in sequences
    micro_batch: int = 2
    steps: int = 30
    data: str = "embedded"            # embedded (CPython's documentation, bytes) | synthetic (a bigram language)
    optimizer: str = "adamw"          # adamw | sgd
    lr: float = 3e-3
    min_lr: float = None              # cosine decay to min_lr at the last step (None: lr / 10, nanoGPT)
    warmup: int = 0                   # linear warm-up steps
    weight_decay: float = 0.1         # on 2-D weights only (AdamW: decoupled; SGD: L2)
    grad_clip: float = 1.0            # global gradient-norm clipping; 0 disables
    timeout_s: float = 300.0          # process-group timeout: a dead peer ends the run within it
    metrics: str = None               # a JSON-lines file, one record per step appended (None: none)
    peak_tflops: float = None         # for the MFU (None: a known GPU's dense BF16 peak)
    log: bool = True                  # a line per step on rank 0

    @property
    def param_dtype(self):
        return PARAM_DTYPES[self.dtype]

    @property
    def master_dtype(self):
        return torch.float64 if self.dtype == "float64" else torch.float32


# ---- The plan: every group, every layout-derived value, the attention and sharding functions, the recomputation ----

CP_IMPLS = {  # the causal attention of this rank's CP groups, and the sequence shard it expects
    "ring": (lambda plan, q, k, v: long_seq.ring_attention(q, k, v, plan.cp), long_seq.zigzag_shard),
    "ulysses": (lambda plan, q, k, v: long_seq.ulysses_attention(q, k, v, plan.cp), long_seq.contiguous_shard),
}


@dataclass(frozen=True)
class Layout:
    """What a layout makes of the model and the batch (`layout_of`), before any process group exists; the first
    part of every Plan."""
    dp: int                  # world / (tp cp pp)
    seq_cp: int              # tokens of one sequence on a CP rank: s / cp
    seq_hidden: int          # tokens of the hidden state between the TP regions: s / cp, and / tp under SP
    sequence_parallel: bool  # --sequence-parallel, with TP > 1
    moe_token_split: bool    # MoE layers run on 1/tp of the tokens, as SP shards (TP > 1): their weights stay whole
    micro_batch_count: int   # m = batch / (dp micro_batch): the pipeline's micro-batches, the accumulation steps
    layers_per_stage: int    # L / pp
    virtual_stages: int      # model chunks per pipeline rank: 1 here (the interleaved and V schedules set more)


def layout_of(cfg, train_cfg, world):
    tp, dp = train_cfg.tp, world // (train_cfg.tp * train_cfg.cp * train_cfg.pp)
    sequence_parallel = train_cfg.sequence_parallel and tp > 1
    seq_cp = cfg.seq_len // train_cfg.cp
    return Layout(dp=dp, seq_cp=seq_cp, seq_hidden=seq_cp // tp if sequence_parallel else seq_cp,
                  sequence_parallel=sequence_parallel, moe_token_split=tp > 1,
                  micro_batch_count=train_cfg.batch // (dp * train_cfg.micro_batch),
                  layers_per_stage=cfg.n_layer // train_cfg.pp, virtual_stages=1)


# Parameter placements: how a parameter lies across the ranks, set once where it is made (`set_placement`), read by
# the gradient reductions (and, beyond the chapter, the checkpoints): the whole contract between the model and the
# rest.
#   tp_dim         split over TP along this dim of W (Column/RowParallelLinear 0 / 1, the embedding 0); None: whole
#                  on every TP rank, so counted in the gradient norm on TP rank 0 only
#   tp_parts       ColumnParallelLinear(parts=3): Q, K and V each split over TP on its own
#   token_sharded  LayerNorms, row-parallel biases, wpe under SP; the MoE layer under TP: its gradient is partial
#                  over TP, summed there
#   expert         moe_ep.MoE's expert weights, split over EP along dim 0: summed over expert DP, not DP x CP
PLACEMENT_DEFAULTS = {"tp_dim": None, "tp_parts": 1, "token_sharded": False, "expert": False}


def set_placement(params, **placement):
    """Give parameters their placement (PLACEMENT_DEFAULTS): the attributes named here, the defaults for the others
    not set yet."""
    for p in params:
        for name, default in PLACEMENT_DEFAULTS.items():
            setattr(p, name, placement[name] if name in placement else getattr(p, name, default))
    return params


class Reduction(NamedTuple):
    """One SUM of gradients over a group. `data_parallel`: the optimizer's own (all-reduce, or the distributed
    optimizer's reduce-scatter); the others: all-reduces before it."""
    name: str
    params: list
    group: object
    data_parallel: bool


@dataclass(frozen=True)
class Plan(Layout):
    """This rank's parallel decisions, made once (make_plan), only read afterwards: the layout's values, its
    coordinates, its process groups (None where a dimension has size 1), this stage's layers, which ranks log the
    losses, and the functions that act on the layout."""
    parallel_state: topology.ParallelState
    world: object                # the default group (None on one rank): the global norm and the logged losses
    tp: object
    cp: object
    pp: object
    dp_cp: object                # the data-parallel sums' group: DP x CP (CP ranks saw other tokens too)
    ep: object
    expert_dp: object            # the ranks holding the same experts (Megatron-LM's expert data-parallel group)
    tp_and_cp: object            # the ranks that share a micro-batch: the router statistics' sums
    embedding: object            # the group of the tied embedding's two copies (first and last stage)
    cp_impl: str
    recompute: str
    layers: tuple                # the global indices of this rank's layers, chunk after chunk
    logs_lm_loss: bool           # the LM loss from the last stage's TP rank 0 (the other TP ranks hold the same)
    logs_router_loss: bool       # the router loss from TP rank 0, CP rank 0 of every stage (likewise over TP x CP)

    @property
    def sizes(self):
        """The size of every dimension: the one way to ask one (plan.sizes["tp"])."""
        return self.parallel_state.sizes

    def attention(self, q, k, v):
        """Causal attention of (b, heads, s_local, d) tensors over this rank's CP shard of the sequence."""
        if self.cp is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return CP_IMPLS[self.cp_impl][0](self, q, k, v)

    def shard(self, x, dim):
        """This rank's CP shard of a full-sequence tensor, in the layout `attention` expects."""
        if self.cp is None:
            return x
        return CP_IMPLS[self.cp_impl][1](x, dim, self.parallel_state.cp_rank, self.sizes["cp"])

    def run_blocks(self, blocks, state):
        return checkpointing.run_blocks(blocks, state, self.recompute)

    def column_parallel(self, x, weight, bias=None, gemm=F.linear):
        """X A + b with A split by columns over TP: (b, s, h_in) (under SP (b, s/t, h_in), gathered) -> (b, s, h_out/t).
        Through _TPLinear, or at TP = 1 the GEMM itself, whose backward autograd runs in C++ (no Python call)."""
        if self.tp is None:
            return gemm(x, weight, bias)
        return _TPLinear.apply(x, weight, bias, self.tp, self.sequence_parallel, gemm)

    def row_parallel(self, x, weight, bias, gemm=F.linear):
        """X A + b with A split by rows over TP: (b, s, h_in/t) -> the partial products summed by g, (b, s, h_out)
        (under SP reduce-scattered: (b, s/t, h_out)); the bias added once, after the sum."""
        if self.tp is None:
            return gemm(x, weight, bias)
        return self.reduce_tp(gemm(x, weight)) + bias

    def reduce_tp(self, x):
        """g, the end of a TP region: sum the partial results, into sequence shards under SP."""
        return reduce_scatter_to_sp(x, self.tp) if self.sequence_parallel else reduce_from_tp(x, self.tp)

    def to_token_shard(self, x):
        """The tokens a MoE layer runs on: the sequence-parallel shard (1/t of them per TP rank)."""
        return scatter_to_sp(x, self.tp) if self.moe_token_split and not self.sequence_parallel else x

    def from_token_shard(self, y):
        return gather_from_sp(y, self.tp) if self.moe_token_split and not self.sequence_parallel else y

    def micro_batches(self, tokens, micro_batch, device):
        """This rank's micro-batches of a global batch (B, s + 1): its DP slice of the sequences, cut into
        micro-batches, and its CP shard of the inputs, targets and (global) positions."""
        mine = tokens.chunk(self.dp)[self.parallel_state.dp_rank].to(device)
        positions = self.shard(torch.arange(tokens.shape[1] - 1, device=device), 0)
        return [(self.shard(mb[:, :-1], 1), positions, self.shard(mb[:, 1:], 1)) for mb in mine.split(micro_batch)]


def make_plan(cfg, train_cfg, parallel_state):
    group = lambda kind: parallel_state.groups[kind] if len(parallel_state.ranks[kind]) > 1 else None
    layout = layout_of(cfg, train_cfg, parallel_state.world_size)
    first = parallel_state.pp_rank * layout.layers_per_stage
    return Plan(parallel_state=parallel_state, world=dist.group.WORLD if parallel_state.world_size > 1 else None,
                tp=group("tp"), cp=group("cp"), pp=group("pp"), dp_cp=group("dp_cp"), ep=group("ep"),
                expert_dp=group("edp"), tp_and_cp=group("tp_cp"), embedding=group("embedding"),
                cp_impl=train_cfg.cp_impl, recompute=train_cfg.recompute, **vars(layout),
                layers=tuple(range(first, first + layout.layers_per_stage)),
                logs_lm_loss=parallel_state.is_last_stage and parallel_state.tp_rank == 0,
                logs_router_loss=parallel_state.tp_rank == 0 and parallel_state.cp_rank == 0)


# ---- Tensor and sequence parallelism: the communication (f and g), then the layers -------------------------
# Shapes: b micro-batch, s this rank's CP shard of the sequence (s/t: its SP shard), h width, t TP, N = b s tokens.

# torch 2.13 renames the flat collectives (the old names still work, with a deprecation warning)
_all_gather_flat = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _group_size(group):
    return 1 if group is None else dist.get_world_size(group)


def _all_gather_seq(x, group):
    """(b, s/t, h) sequence shards of every TP rank -> (b, s, h), in rank order."""
    out = x.new_empty((_group_size(group),) + tuple(x.shape))          # (t, b, s/t, h)
    _all_gather_flat(out.view(-1), x.contiguous().view(-1), group=group)  # flat: any backend
    return rearrange(out, "t b s h -> b (t s) h")                       # (b, s, h)


def _reduce_scatter_seq(x, group, async_op=False):
    """(b, s, h) partial sums -> this rank's (b, s/t, h) sequence shard of their sum. With async_op, returns
    the shard and a function that waits for it (and keeps the input alive until then)."""
    parts = rearrange(x, "b (t s) h -> t b s h", t=_group_size(group)).contiguous()  # (t, b, s/t, h)
    out = x.new_empty(parts.shape[1:])                                                # (b, s/t, h)
    work = _reduce_scatter_flat(out.view(-1), parts.view(-1), group=group, async_op=async_op)
    if not async_op:
        return out

    def wait():  # the collective reads `parts` until it completes: referring to it keeps it alive until then
        work.wait()
        return parts

    return out, wait


class _ReduceFromTP(torch.autograd.Function):
    """g of the TP pair (Megatron-LM's reduce_from_tensor_model_parallel_region). Forward: all-reduce the partial
    sums (in place: they are the fresh output of a GEMM whose backward does not need it, so no copy). Backward:
    identity (each rank's input gradient is the full one)."""

    @staticmethod
    def forward(ctx, x, group):                 # x (b, s, h) partial over TP
        if x._base is None:
            ctx.mark_dirty(x)
        else:  # a view (the FP8 GEMM's reshaped output) cannot be reduced in place
            x = x.clone()
        dist.all_reduce(x, group=group)         # (b, s, h) summed
        return x

    @staticmethod
    def backward(ctx, grad):                    # grad (b, s, h), the same on every TP rank
        return grad, None


class _ReduceScatterToSP(torch.autograd.Function):
    """g under SP (Megatron-LM's reduce_scatter_to_sequence_parallel_region). Forward: reduce-scatter the partial
    sums into sequence shards. Backward: all-gather the gradient."""

    @staticmethod
    def forward(ctx, x, group):                 # x (b, s, h) partial over TP
        ctx.group = group
        return _reduce_scatter_seq(x, group)    # (b, s/t, h)

    @staticmethod
    def backward(ctx, grad):                    # grad (b, s/t, h)
        return _all_gather_seq(grad, ctx.group), None  # (b, s, h)


class _ScatterToSP(torch.autograd.Function):
    """Megatron-LM's scatter_to_sequence_parallel_region. Forward: keep this rank's sequence shard of a replicated
    activation. Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group):                 # x (b, s, h), the same on every TP rank
        ctx.group = group
        return x.chunk(_group_size(group), dim=1)[dist.get_rank(group)].contiguous()  # (b, s/t, h)

    @staticmethod
    def backward(ctx, grad):                    # grad (b, s/t, h)
        return _all_gather_seq(grad, ctx.group), None  # (b, s, h)


class _GatherFromSP(torch.autograd.Function):
    """Megatron-LM's gather_from_sequence_parallel_region. Forward: all-gather sequence shards into the activation
    every TP rank holds whole. Backward: keep this rank's shard of the gradient (whole, and the same, on every TP
    rank). A TP-split GEMM's input is gathered inside _TPLinear instead, whose backward reduce-scatters the partial
    gradients."""

    @staticmethod
    def forward(ctx, x, group):                 # x (b, s/t, h)
        ctx.group = group
        return _all_gather_seq(x, group)        # (b, s, h)

    @staticmethod
    def backward(ctx, grad):                    # grad (b, s, h), the same on every TP rank
        return grad.chunk(_group_size(ctx.group), dim=1)[dist.get_rank(ctx.group)].contiguous(), None  # (b, s/t, h)


def reduce_from_tp(x, group):
    return x if group is None else _ReduceFromTP.apply(x, group)


def reduce_scatter_to_sp(x, group):
    return x if group is None else _ReduceScatterToSP.apply(x, group)


def scatter_to_sp(x, group):
    return x if group is None else _ScatterToSP.apply(x, group)


def gather_from_sp(x, group):
    return x if group is None else _GatherFromSP.apply(x, group)


class _TPLinear(torch.autograd.Function):
    """Y = X A + b, A = W^T split by columns over TP, with f folded in (Megatron-LM's
    LinearWithGradAccumulationAndAsyncCommunication). No SP: backward all-reduces the input gradient (f), overlapped
    with the weight-gradient GEMM. SP: forward all-gathers the input's sequence shards (only the local shard is
    saved, gathered again in backward); the input gradient is reduce-scattered, overlapped with the weight GEMM.
    `gemm`: F.linear, or an FP8 product (`fp8_product`), whose backward GEMMs here are in the weights' dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, gemm=F.linear):
        # x (b, s/t, h_in) under SP, else (b, s, h_in); weight (h_out/t, h_in), bias (h_out/t,)
        ctx.group, ctx.sp, ctx.has_bias = group, sequence_parallel and group is not None, bias is not None
        ctx.save_for_backward(x, weight)                                # under SP only x's shard is kept
        x_full = _all_gather_seq(x, group) if ctx.sp else x             # (b, s, h_in)
        return gemm(x_full, weight, bias)                               # (b, s, h_out/t)

    @staticmethod
    def backward(ctx, grad_out):                                        # grad_out (b, s, h_out/t)
        x, weight = ctx.saved_tensors
        x_full = _all_gather_seq(x, ctx.group) if ctx.sp else x         # (b, s, h_in), gathered again under SP
        g2 = grad_out.reshape(-1, grad_out.shape[-1])                   # (N, h_out/t)
        x2 = x_full.reshape(-1, x_full.shape[-1])                       # (N, h_in)
        grad_x, wait = _sum_input_grad(grad_out @ weight, ctx)          # (b, s, h_in) partial -> summed (f)
        grad_b = g2.sum(0) if ctx.has_bias else None                    # (h_out/t,)
        grad_w = g2.t() @ x2                                            # (h_out/t, h_in), while grad_x travels
        wait()                                                          # grad_x: (b, s/t, h_in) under SP
        return grad_x, grad_w, grad_b, None, None, None


def _sum_input_grad(grad_x, ctx):
    """Start f's backward on the (b, s, h_in) input gradient, partial over TP: its reduce-scatter into (b, s/t, h_in)
    shards under SP, else its all-reduce; returns the result and a function that waits for it."""
    if ctx.sp:
        return _reduce_scatter_seq(grad_x, ctx.group, async_op=True)
    if ctx.group is not None:
        return grad_x, dist.all_reduce(grad_x, group=ctx.group, async_op=True).wait
    return grad_x, lambda: None


def full_init(name, shape, std, seed, dtype):
    """N(0, std^2) weights of the WHOLE parameter `name`, from a generator seeded by that name."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * std).to(dtype)


# The layers below are, by hand so that every collective is in sight, what torch.distributed.tensor.parallel
# writes with DTensors (ColwiseParallel, RowwiseParallel, SequenceParallel).

class ColumnParallelLinear(nn.Module):
    """Y_local = X A_local + b_local: A split by columns (W by rows). `parts` > 1 splits each of `parts` equal
    blocks of the output (Q, K and V) separately, so every rank gets whole heads of each."""

    def __init__(self, name, d_in, d_out, plan, cfg, dtype, parts=1, std=0.02, fp8=None):
        super().__init__()
        t, r = plan.sizes["tp"], plan.parallel_state.tp_rank
        self.plan, self.gemm = plan, fp8_product(self, fp8)
        w = full_init(name + ".weight", (d_out, d_in), std, cfg.seed, dtype)
        w = rearrange(w, "(parts t o) i -> parts t o i", parts=parts, t=t)[:, r]
        self.weight = nn.Parameter(rearrange(w, "parts o i -> (parts o) i").contiguous())
        self.bias = nn.Parameter(torch.zeros(d_out // t, dtype=dtype))
        set_placement([self.weight, self.bias], tp_dim=0, tp_parts=parts)

    def forward(self, x):
        return self.plan.column_parallel(x, self.weight, self.bias, self.gemm)


class RowParallelLinear(nn.Module):
    """Y = g(X_local A_local) + b: A split by rows (W by columns); the bias is added once, after the sum (under SP
    to the sequence shard: its gradient is then partial over TP)."""

    def __init__(self, name, d_in, d_out, plan, cfg, dtype, std=0.02, fp8=None):
        super().__init__()
        self.plan, self.gemm = plan, fp8_product(self, fp8)
        w = full_init(name + ".weight", (d_out, d_in), std, cfg.seed, dtype)
        self.weight = nn.Parameter(w.chunk(plan.sizes["tp"], dim=1)[plan.parallel_state.tp_rank].contiguous())
        self.bias = nn.Parameter(torch.zeros(d_out, dtype=dtype))
        set_placement([self.weight], tp_dim=1)
        set_placement([self.bias], token_sharded=plan.sequence_parallel)

    def forward(self, x):
        return self.plan.row_parallel(x, self.weight, self.bias, self.gemm)


def fp8_product(layer, recipe):
    """A block linear's forward product: F.linear, or with --dtype fp8 (`recipe`: --fp8-recipe)
    mixed_precision.fp8_linear in FP8 E4M3; the backward GEMMs, the LM head and the experts in BF16. Per-tensor scales
    are agreed (MAX of the amax) over TP: the shards of one weight, and a row-parallel layer's input shards, are one
    tensor. Under CP and DP each rank quantises its own tokens (Transformer Engine also reduces the activation amax
    over CP). Delayed scaling keeps an amax history per layer (not checkpointed; a recomputation would record its
    amaxes again)."""
    if recipe is None:
        return F.linear
    if recipe == "delayed":
        layer.register_buffer("amax_history", torch.zeros(2, 16), persistent=False)

    def product(x, weight, bias=None):
        return mixed_precision.fp8_linear(x, weight, bias, amax_group=layer.plan.tp, recipe=recipe,
                                          amax_history=getattr(layer, "amax_history", None),
                                          record_amax=torch.is_grad_enabled())
    return product


class VocabParallelEmbedding(nn.Module):
    """Rows [r V/t, (r+1) V/t) of the token embedding; ids outside the shard look up zeros, so the output is
    a partial sum over the TP ranks (reduced by the caller)."""

    def __init__(self, name, vocab, dim, plan, cfg, dtype):
        super().__init__()
        t, r = plan.sizes["tp"], plan.parallel_state.tp_rank
        self.vocab, self.start, self.end = vocab, r * vocab // t, (r + 1) * vocab // t
        self.weight = nn.Parameter(full_init(name, (vocab, dim), 0.02, cfg.seed, dtype)[self.start:self.end].clone())
        set_placement([self.weight], tp_dim=0)

    def forward(self, ids):
        if self.end - self.start == self.vocab:  # the whole vocabulary (TP = 1): nothing to mask
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.end)
        x = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
        return x.masked_fill(outside[..., None], 0.0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from vocabulary-sharded logits (N, V/t): log(sum exp) - logit[target].

    One MAX all-reduce of (N,) (the stable shift) and one SUM all-reduce of the (2, N) stack [sum of exps,
    target logit]. Memory: the softmax is formed IN PLACE in one FP32 (or wider) (N, V/t) buffer, which is all
    that backward keeps; backward turns that buffer into the gradient in place (so it runs once)."""

    @staticmethod
    def forward(ctx, logits, targets, start, group):                    # logits (N, V/t), targets (N,)
        acc = torch.promote_types(logits.dtype, torch.float32)
        row_max = logits.max(dim=-1).values.to(acc)                     # (N,)
        if group is not None:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)  # (N,) over the whole vocabulary
        softmax = logits.to(acc) - row_max[:, None]                     # (N, V/t), a new buffer: the only big one
        inside = (targets >= start) & (targets < start + logits.shape[-1])  # (N,): target in this shard
        idx = (targets - start).masked_fill(~inside, 0)                 # (N,)
        target_logit = softmax.gather(1, idx[:, None]).squeeze(1).masked_fill(~inside, 0.0)  # (N,)
        sums = torch.stack([softmax.exp_().sum(-1), target_logit])      # (2, N); softmax now holds exps
        if group is not None:
            dist.all_reduce(sums, group=group)                          # (2, N) over the whole vocabulary
        softmax.div_(sums[0][:, None])                                  # (N, V/t) softmax, in place
        ctx.save_for_backward(softmax, idx, inside)
        ctx.dtype = logits.dtype
        return sums[0].log() - sums[1]                                  # (N,)

    @staticmethod
    def backward(ctx, grad):                                            # grad (N,)
        softmax, idx, inside = ctx.saved_tensors                        # (N, V/t), (N,), (N,)
        softmax[torch.arange(softmax.shape[0], device=softmax.device), idx] -= inside.to(softmax.dtype)
        return softmax.mul_(grad[:, None]).to(ctx.dtype), None, None, None  # (N, V/t): softmax - onehot


def vocab_parallel_cross_entropy(logits, targets, start, group):
    if group is None:  # the whole vocabulary here: torch's fused log-softmax (it too keeps one FP32 (N, V))
        return F.cross_entropy(logits if logits.dtype == torch.float64 else logits.float(), targets, reduction="none")
    return _VocabParallelCrossEntropy.apply(logits, targets, start, group)


# ---- The model: one pipeline stage of a GPT, and its gradient sums -------------------------------------

class LayerNorm(nn.Module):
    def __init__(self, dim, plan, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype))
        set_placement([self.weight, self.bias], token_sharded=plan.sequence_parallel)

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias)


class Block(nn.Module):
    """Pre-LN transformer block; the state it passes on is (hidden, running router loss)."""
    recompute_attention_core = False

    def __init__(self, i, cfg, plan, dtype, fp8=None, moe=moe_ep.MoE):
        super().__init__()
        h = cfg.n_embd
        self.plan, self.heads, self.layer = plan, cfg.n_head // plan.sizes["tp"], i
        std_out = 0.02 / math.sqrt(2 * cfg.n_layer)  # GPT-2: scale the residual projections
        self.ln1 = LayerNorm(h, plan, dtype)
        self.qkv = ColumnParallelLinear(f"h.{i}.attn.qkv", h, 3 * h, plan, cfg, dtype, parts=3, fp8=fp8)
        self.proj = RowParallelLinear(f"h.{i}.attn.proj", h, h, plan, cfg, dtype, std=std_out, fp8=fp8)
        self.ln2 = LayerNorm(h, plan, dtype)
        self.moe = None
        if cfg.is_moe(i):
            # moe_ep.MoE draws all its weights from the default RNG: seeding it by the layer's name makes them
            # the same in every layout. Its weights are whole on every TP rank (tokens are split instead).
            with torch.random.fork_rng(devices=[]):  # and leaves the process's RNG as it was
                torch.default_generator.manual_seed(cfg.seed * 1_000_003 + zlib.crc32(f"h.{i}.moe".encode()))
                self.moe = moe(h, 4 * h, cfg.n_experts, cfg.top_k, ep_group=plan.ep, stats_group=plan.tp_and_cp,
                               aux_loss_coeff=cfg.aux_loss_coeff, z_loss_coeff=cfg.z_loss_coeff).to(dtype)
            set_placement(self.moe.parameters(), token_sharded=plan.moe_token_split)
            set_placement(self.moe.expert_params(), expert=True)
        else:
            self.fc = ColumnParallelLinear(f"h.{i}.mlp.fc", h, 4 * h, plan, cfg, dtype, fp8=fp8)
            self.out = RowParallelLinear(f"h.{i}.mlp.proj", 4 * h, h, plan, cfg, dtype, std=std_out, fp8=fp8)

    def attention(self, x):
        q, k, v = rearrange(self.qkv(self.ln1(x)), "b s (three a d) -> three b a s d", three=3, a=self.heads)
        if self.recompute_attention_core:  # selective recomputation (checkpointing.run_blocks marks the block)
            y = checkpointing.run_attention_core(self, self.plan.attention, q, k, v)
        else:  # (a plain call: no frame between the block and the kernel)
            y = self.plan.attention(q, k, v)
        return self.proj(rearrange(y, "b a s d -> b s (a d)"))

    def mlp(self, x):
        if self.moe is None:
            return self.out(F.gelu(self.fc(x))), None
        y, aux = self.moe(self.plan.to_token_shard(x))
        return self.plan.from_token_shard(y), aux.to(torch.float64)

    def forward(self, x, aux):
        x = x + self.attention(x)
        y, router_loss = self.mlp(self.ln2(x))
        return x + y, aux if router_loss is None else aux + router_loss


class GPTStage(nn.Module):
    """The layers of one pipeline stage; the first stage embeds, the last one normalises and projects to
    the (vocabulary-sharded) logits with a copy of the token embedding (tied weights). Made with its parameters:
    `reductions`, the gradient sums of a step, and `norm_params`, what this rank counts in the gradient norm.
    `moe`: the MoE layer's class (beyond the chapter, moe_ep.GroupedGEMMMoE for --moe-grouped-gemm)."""

    def __init__(self, cfg, plan, dtype=torch.float32, fp8=None, moe=moe_ep.MoE):
        super().__init__()
        self.cfg, self.plan = cfg, plan
        parallel_state = plan.parallel_state
        self.first, self.last = parallel_state.is_first_stage, parallel_state.is_last_stage
        self.blocks = nn.ModuleList(Block(i, cfg, plan, dtype, fp8, moe) for i in plan.layers)
        if self.first:
            self.wte = VocabParallelEmbedding("wte", cfg.vocab_size, cfg.n_embd, plan, cfg, dtype)
            self.wpe = nn.Parameter(full_init("wpe", (cfg.seq_len, cfg.n_embd), 0.02, cfg.seed, dtype))
            set_placement([self.wpe], token_sharded=plan.sequence_parallel)
        if self.last:
            self.ln_f = LayerNorm(cfg.n_embd, plan, dtype)
            if self.first:
                self.lm_head = self.wte  # one stage: literally the same parameter
            else:  # a copy of the same initial weights; its gradient is summed with wte's every step
                self.lm_head = VocabParallelEmbedding("wte", cfg.vocab_size, cfg.n_embd, plan, cfg, dtype)
        self.reductions, self.norm_params = gradient_reductions(plan, self)

    def embed(self, ids, positions):
        """Token embedding (a partial sum over the vocabulary shards) reduced over TP (g), plus positions; under SP
        the sum is reduce-scattered and each rank adds the positions of its sequence shard."""
        x = self.plan.reduce_tp(self.wte(ids))
        if self.plan.sequence_parallel:
            positions = positions.chunk(self.plan.sizes["tp"])[self.plan.parallel_state.tp_rank]
        return x + F.embedding(positions, self.wpe)  # an embedding backward: no index_put

    # a chunk: the layers of one virtual stage; one per rank here (the interleaved and V schedules run more)
    def chunk_blocks(self, chunk):
        n = len(self.blocks) // self.plan.virtual_stages
        return self.blocks[chunk * n:(chunk + 1) * n]

    def is_first_chunk(self, chunk):
        return self.first and chunk == 0  # the first virtual stage embeds

    def is_last_chunk(self, chunk):
        return self.last and chunk == self.plan.virtual_stages - 1  # the last one projects to the logits

    def forward(self, x, positions=None, chunk=0):
        """The first virtual stage: x are token ids (b, s_local), positions their global positions; otherwise x is
        the previous virtual stage's hidden state. The last one returns vocabulary-sharded logits. Also returns the
        sum of the chunk's auxiliary (MoE router) losses."""
        if self.is_first_chunk(chunk):
            x = self.embed(x, positions)
        blocks, aux = self.chunk_blocks(chunk), torch.zeros((), dtype=torch.float64, device=x.device)
        if self.plan.recompute == "none":
            for block in blocks:
                x, aux = block(x, aux)
        else:  # a recomputation policy: checkpointing.py runs the blocks
            x, aux = self.plan.run_blocks(blocks, (x, aux))
        if self.is_last_chunk(chunk):  # the LM head is column-parallel over the vocabulary: input gathered under SP
            x = self.plan.column_parallel(self.ln_f(x), self.lm_head.weight)
        return x, aux

    def loss_sum(self, logits, targets):
        per_token = vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), self.lm_head.start,
                                                 self.plan.tp)
        return per_token.sum()


def gradient_reductions(plan, stage):
    """Every gradient SUM of a step, and the parameters this rank counts in the gradient norm (made once, with the
    stage's parameters). A gradient is complete once summed over every group that saw other tokens through the same
    weights. The norm counts each distinct parameter once in the world: one replicated over TP on TP rank 0 only,
    the tied embedding on the first stage only (the optimizer leaves out the DP x CP and expert DP replicas)."""
    params = [p for p in stage.parameters() if p.requires_grad]
    tied = []
    if plan.embedding is not None:  # the first stage's wte and the last stage's copy: the sum of both uses
        tied = [stage.wte.weight if stage.first else stage.lm_head.weight]
    tied_ids = {id(p) for p in tied}
    # the two copies of the tied embedding take their DP x CP sum in a buffer of their own, laid out alike on
    # both stages: summed in the same order, they stay equal to the bit (inside the other dense weights' buffer
    # an element's place, so the order of its sum, would differ between the stages)
    reductions = [r for r in (
        Reduction("tied embedding", tied, plan.embedding, False),
        Reduction("token-sharded, replicated over TP", [p for p in params if p.token_sharded], plan.tp, False),
        Reduction("tied embedding over DP x CP", tied, plan.dp_cp, True),
        Reduction("dense over DP x CP", [p for p in params if not p.expert and id(p) not in tied_ids], plan.dp_cp,
                  True),
        Reduction("experts over expert DP", [p for p in params if p.expert], plan.expert_dp, True),
    ) if r.params and (r.group is not None or r.data_parallel)]
    second_copy = {id(p) for p in tied if not stage.first}
    norm_params = [p for p in params
                   if id(p) not in second_copy and (plan.parallel_state.tp_rank == 0 or p.tp_dim is not None)]
    return reductions, norm_params


# ---- Pipeline parallelism: a schedule is a list of actions per rank; one executor runs any of them ---------
# A rank's schedule is the order of its actions: F (the forward of a micro-batch through a model chunk) and B (its
# backward). The executor runs each rank's list in its order, each action waiting only for its own input.

class Action(NamedTuple):
    kind: str        # "F" or "B" (zero bubble, beyond the chapter, splits B and adds "W")
    micro: int
    chunk: int = 0   # the model chunk (virtual stage) on this rank: 0 here


def schedule_1f1b(p, m, r):
    """1F1B (Narayanan et al. 2021): p - r - 1 warm-up forwards, then one forward and one backward, then the
    remaining backwards: at most p - r micro-batches in flight on rank r."""
    warmup = min(p - r - 1, m)
    steady = [action for j in range(m - warmup) for action in (Action("F", warmup + j), Action("B", j))]
    return [Action("F", i) for i in range(warmup)] + steady + [Action("B", j) for j in range(m - warmup, m)]


# --pp-schedule: every rank's list of actions, orders[r], for p ranks, m micro-batches and v chunks per rank
SCHEDULES = {"1f1b": lambda p, m, v: [schedule_1f1b(p, m, r) for r in range(p)]}


def forward_schedule(p, m, v=1):
    """Forwards only (a validation loss): every micro-batch through every chunk, in order."""
    return [[Action("F", i, c) for i in range(m) for c in range(v)] for _ in range(p)]


class ScheduleStats(NamedTuple):
    peak: int     # (chunk, micro-batch) activations alive at once on this rank
    held: int     # bytes of their outputs still held once sent (0: each output's storage is freed then)
    order: list   # the actions this rank ran, in order


class Pipeline:
    """The transfers of one rank's stage: where each virtual stage's output goes, and each send and receive posted
    on its own, waited for only when its tensor is needed. Shapes are fixed by the layout, so receives preallocate.
    A pair of ranks matches its point-to-point messages in posting order: a rank posts the receives from a peer in
    the order that peer sends them (its own list's order), whatever order it needs them in. `run_action` runs one
    action of the list."""

    def __init__(self, plan, shape, dtype, device, schedule="1f1b"):
        self.plan, self.shape, self.dtype, self.device = plan, shape, dtype, device
        self.schedule = schedule  # the step's (SCHEDULES: 1F1B here)
        self.ranks = plan.parallel_state.ranks["pp"]  # global ranks of this pipeline, by stage
        self.tables = {}  # (id of _orders' cached lists, rank): what that rank receives, made once per schedule

    def orders(self, kind, p, m, v):
        """Every rank's list of actions of the schedule `kind` (or "forward", for a validation loss)."""
        return _orders(kind, p, m, v)

    def consumer(self, r, action):
        """(rank, the action that reads it) of what rank r's `action` sends, or None (the loss, the embedding)."""
        p, v = self.plan.sizes["pp"], self.plan.virtual_stages
        stage = action.chunk * p + r  # the virtual stage
        if action.kind == "F" and stage < p * v - 1:
            return (stage + 1) % p, Action("F", action.micro, (stage + 1) // p)
        if action.kind == "B" and stage > 0:
            return (stage - 1) % p, Action("B", action.micro, (stage - 1) // p)
        return None

    def start(self, orders, rank):
        """Before a step: what this rank will receive, from which peer, in the order each peer sends it; and, for
        `collect_sends`, where each message's sender and each send's reader stand in their rank's list."""
        key = (id(orders), rank)
        if key not in self.tables:
            incoming = {}  # peer: the actions of this rank that read its messages, in the peer's sending order
            source, sink = {}, {}  # action: (the peer it reads from, its sender's index); (sends to, reader's index)
            for peer, order in enumerate(orders):
                for i, action in enumerate(order):
                    to = self.consumer(peer, action)
                    if to is not None and to[0] == rank:
                        incoming.setdefault(peer, []).append(to[1])
                        source[to[1]] = peer, i
                    elif to is not None and peer == rank:
                        sink[action] = to[0], orders[to[0]].index(to[1])
            self.tables[key] = orders, incoming, source, sink  # the lists kept: their id stays theirs
        _, incoming, self.source, self.sink = self.tables[key]
        self.incoming = {peer: list(actions) for peer, actions in incoming.items()}  # post_receive pops them
        self.receives, self.sending = {}, []  # action: (buffer, work) of a posted receive; `send`'s
        self.peer_posted_until = {}  # peer: its list's index up to which it has posted its receives

    def post_receive(self, action):
        """Post the receive `action` reads (and those its peer sends before it), if not posted yet."""
        peer, _ = self.source.get(action, (None, None))
        while peer is not None and action not in self.receives:
            reader = self.incoming[peer].pop(0)
            buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            self.receives[reader] = buf, dist.irecv(buf, self.ranks[peer], self.plan.pp)

    def receive(self, action):
        """The tensor `action` reads, once it has arrived (posting its receive if not done yet)."""
        self.post_receive(action)
        buf, work = self.receives.pop(action)
        work.wait()
        peer, sender = self.source[action]  # it sent this having posted its receives up to its next action
        self.peer_posted_until[peer] = max(self.peer_posted_until.get(peer, -1), sender + 1)
        return buf

    def send(self, tensor, action, free=False):
        """Post the send of `action`'s output; with `free`, the tensor's storage is released once the send
        completes (its backward needs only the graph behind it and its shape)."""
        peer, reader = self.sink[action]
        work = dist.isend(tensor.contiguous(), self.ranks[peer], self.plan.pp)
        self.sending.append((work, tensor, free, peer, reader))

    def collect_sends(self, wait=False):
        """Forget the sends that completed (all with `wait`), freeing the storage of those marked so. NCCL's work
        reports completion, gloo's only once waited on: a send whose receive is surely posted is waited on here."""
        still = []
        for work, tensor, free, peer, reader in self.sending:
            if wait or reader <= self.peer_posted_until.get(peer, -1):  # a transfer finishing, not the peer's progress
                work.wait()
            if not work.is_completed():
                still.append((work, tensor, free, peer, reader))
            elif free:
                tensor.untyped_storage().resize_(0)
        self.sending = still

    def run_action(self, stage, action, received, saved, micro_batches, tokens_per_micro_batch, loss_multiplier,
                   totals):
        """One action on this rank; returns what it sends on (an output, an input gradient), or None. F keeps, in
        `saved`, what its B needs."""
        first, last = stage.is_first_chunk(action.chunk), stage.is_last_chunk(action.chunk)
        key = (action.chunk, action.micro)
        if action.kind == "F":
            ids, positions, targets = micro_batches[action.micro]
            x = None if first else received
            out, aux = forward_micro_batch(stage, ids if first else x, positions, targets, action.chunk,
                                           tokens_per_micro_batch, totals)
            if torch.is_grad_enabled():
                saved[key] = (x, out, aux, last)
            return None if last else out
        x, out, aux, _ = saved.pop(key)
        if last:
            ((out + aux) * loss_multiplier).backward()
        elif aux.requires_grad:  # a MoE chunk: its router loss starts its own backward here
            torch.autograd.backward([out, aux], [received, torch.full_like(aux, loss_multiplier)])
        else:
            torch.autograd.backward(out, received)
        return None if x is None else x.grad

    def in_flight(self, saved):
        """(chunk, micro-batch) activations alive on this rank: those kept from F until B."""
        return len(saved)


def run_schedule(stage, pipe, kind, micro_batches, tokens_per_micro_batch, loss_multiplier=1.0):
    """Run this rank's list of the schedule `kind` (or "forward", for a validation loss, under no_grad) in its order,
    each action waiting only for its own input: the next one's receive is posted before it runs, each send completes
    in the background. Returns this rank's summed LM loss, its router loss (each micro-batch's weighted by its token
    count) and ScheduleStats. `loss_multiplier` multiplies the losses where each backward starts."""
    plan, rank = stage.plan, stage.plan.parallel_state.pp_rank
    orders = pipe.orders(kind, plan.sizes["pp"], len(micro_batches), plan.virtual_stages)
    totals = torch.zeros(2, dtype=torch.float64, device=next(stage.parameters()).device)  # LM loss, router loss
    saved, ran, peak, held = {}, [], 0, 0
    pipe.start(orders, rank)
    order = orders[rank]
    for i, action in enumerate(order):
        if i + 1 < len(order):
            pipe.post_receive(order[i + 1])
        received = None  # its input: the previous stage's output (F), the next stage's input gradient (B)
        if action in pipe.source:
            received = pipe.receive(action).requires_grad_(action.kind == "F" and torch.is_grad_enabled())
        out = pipe.run_action(stage, action, received, saved, micro_batches, tokens_per_micro_batch,
                              loss_multiplier, totals)
        ran.append(action)
        peak = max(peak, pipe.in_flight(saved))
        if action in pipe.sink:  # its output goes to another rank
            # an output leaves this stage: its storage is freed once sent (as Megatron-LM's deallocate_output_tensor),
            # not at its backward, which needs only the graph behind it and its shape
            pipe.send(out, action, free=out.grad_fn is not None)
        pipe.collect_sends()
        sending = {id(tensor) for _, tensor, *_ in pipe.sending}
        held = max(held, sum(o.untyped_storage().nbytes() for _, o, _, last in saved.values()
                             if not last and id(o) not in sending))
    pipe.collect_sends(wait=True)
    return totals[0], totals[1], ScheduleStats(peak, held, ran)


@functools.lru_cache(maxsize=64)
def _orders(kind, p, m, v):
    """Every rank's list of actions (made once per shape)."""
    return forward_schedule(p, m, v) if kind == "forward" else SCHEDULES[kind](p, m, v)


def forward_micro_batch(stage, x, positions, targets, chunk, tokens_per_micro_batch, totals):
    """One micro-batch through one chunk: its output, or at the last virtual stage its summed LM loss; and its
    router loss weighted by its token count. Both losses are added to `totals` (LM, router) for the log."""
    out, aux = stage(x, positions, chunk=chunk)
    if stage.is_last_chunk(chunk):
        out = stage.loss_sum(out, targets)
        totals[0] += out.detach().double()
    aux = aux * tokens_per_micro_batch
    totals[1] += aux.detach()
    return out, aux


# ---- One training step -------------------------------------------------------------------------------------

def train_step(stage, pipe, optimizer, tokens, micro_batch, grad_clip=0.0):
    """Forward and backward of the global batch (B, s + 1), the stage's gradient sums, one optimizer step.
    Returns (LM loss, router loss, global gradient norm, whether the step was taken, the schedule's ScheduleStats)."""
    plan = stage.plan
    device = next(stage.parameters()).device
    micro_batches = plan.micro_batches(tokens, micro_batch, device)
    # the one normalisation: the loss is a sum over tokens, divided by the global batch's token count where
    # each backward starts (so 16-bit gradients have the magnitude of a mean loss's), times the FP16 loss scale
    # that the optimizer divides out again
    global_tokens = tokens.shape[0] * (tokens.shape[1] - 1)
    loss_scale = optimizer.loss_scaler.scale if optimizer.loss_scaler is not None else 1.0
    tokens_per_micro_batch, loss_multiplier = micro_batch * (tokens.shape[1] - 1), loss_scale / global_tokens
    if plan.pp is None and pipe.schedule == "1f1b":  # one stage of 1F1B: each micro-batch's forward, then backward
        totals = torch.zeros(2, dtype=torch.float64, device=device)  # LM loss, router loss
        for ids, positions, targets in micro_batches:
            loss, aux = forward_micro_batch(stage, ids, positions, targets, 0, tokens_per_micro_batch, totals)
            ((loss + aux) * loss_multiplier).backward()
        loss_sum, aux_sum, schedule = totals[0], totals[1], ScheduleStats(min(1, len(micro_batches)), 0,
                                                                          schedule_1f1b(1, len(micro_batches), 0))
    else:  # (and the other schedules, beyond the chapter, even at PP = 1)
        loss_sum, aux_sum, schedule = run_schedule(stage, pipe, pipe.schedule, micro_batches, tokens_per_micro_batch,
                                                   loss_multiplier)
    for reduction in stage.reductions:
        if not reduction.data_parallel:  # the optimizer runs the data-parallel sums (the distributed optimizer's too)
            optimizer.all_reduce_grads(reduction.params, reduction.group)
    stepped, grad_norm = optimizer.step(max_norm=grad_clip, norm_group=plan.world, norm_params=stage.norm_params)
    # for the log: each loss from the ranks the plan names, summed over the rest of the world
    report = torch.stack([loss_sum * plan.logs_lm_loss, aux_sum * plan.logs_router_loss])
    if plan.world is not None:
        dist.all_reduce(report)
    loss, aux = (report / global_tokens).tolist()
    return loss, aux, grad_norm, stepped, schedule


# ---- Build: process groups -> plan -> this rank's stage (with its gradient reductions) -> optimizer -> pipeline ----

def build(cfg, train_cfg, optimizer=True):
    """Process groups, the plan, this rank's stage of the model, its optimizer (None without `optimizer`: its FP32
    gradient buffers are 4 bytes per parameter) and its pipeline transfers."""
    parallel_state = topology.init_parallel(tp=train_cfg.tp, pp=train_cfg.pp, cp=train_cfg.cp, ep=train_cfg.ep,
                                            with_mesh=False, timeout_s=train_cfg.timeout_s)
    plan = make_plan(cfg, train_cfg, parallel_state)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    fp8 = train_cfg.fp8_recipe if train_cfg.dtype == "fp8" else None
    stage = GPTStage(cfg, plan, train_cfg.param_dtype, fp8=fp8).to(device)
    opt = make_optimizer(stage, train_cfg) if optimizer else None
    pipe = Pipeline(plan, (train_cfg.micro_batch, plan.seq_hidden, cfg.n_embd), train_cfg.param_dtype, device)
    return plan, stage, opt, pipe


def make_optimizer(stage, train_cfg, shard_groups=None, optimizer_class=None, **options):
    """mixed_precision.py's optimizer for every dtype: gradients accumulate in FP32 (float64 in tests) from
    the first micro-batch, the data-parallel sums are its shard groups (--zero 1, Megatron-LM's distributed
    optimizer, shards them: 6 + 12/d bytes per parameter for BF16, 8 + 8/d for FP32, against 18 and 16), FP16 scales
    the loss. Weight decay applies to the 2-D weights only (nanoGPT), with AdamW or SGD. `shard_groups`,
    `optimizer_class` and `options`: the whole program's (its optimizer forms, hybrid sharding, ZeRO-2/3 units, the
    FP8 gather)."""
    params = [p for p in stage.parameters() if p.requires_grad]
    if train_cfg.optimizer == "adamw":
        opt_class, defaults = torch.optim.AdamW, dict(lr=train_cfg.lr, betas=(0.9, 0.95))
    else:  # SGD's weight decay is L2 in the gradient, AdamW's decoupled: the flag decays the same weights
        opt_class, defaults = torch.optim.SGD, dict(lr=train_cfg.lr)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": train_cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    scaler = mixed_precision.DynamicLossScaler() if train_cfg.dtype == "float16" else None
    if shard_groups is None:
        shard_groups = [(r.params, r.group) for r in stage.reductions if r.data_parallel]
    return (optimizer_class or mixed_precision.MixedPrecisionOptimizer)(
        [g for g in groups if g["params"]], opt_class, zero=train_cfg.zero, loss_scaler=scaler,
        shard_groups=shard_groups, master_dtype=train_cfg.master_dtype, **options, **defaults)


# ---- The loop: the learning rate, the data, what a step logs -----------------------------------------------

def lr_at(step, train_cfg):
    """nanoGPT's schedule: linear warm-up over `warmup` steps, then cosine decay to `min_lr` at the last step
    (a warm-up as long as the run, warmup >= steps - 1, leaves no step to decay: the last one runs at `lr`)."""
    min_lr = train_cfg.lr / 10 if train_cfg.min_lr is None else train_cfg.min_lr
    if step < train_cfg.warmup:
        return train_cfg.lr * (step + 1) / train_cfg.warmup
    decay = (step - train_cfg.warmup) / max(1, train_cfg.steps - 1 - train_cfg.warmup)
    return min_lr + 0.5 * (1 + math.cos(math.pi * min(decay, 1.0))) * (train_cfg.lr - min_lr)


VAL_FRACTION = 0.1  # of a text corpus, held out at its end


def synthetic_batch(step, batch, seq_len, vocab, seed=0):
    """(batch, seq_len + 1) tokens of a fixed random bigram language, the same on every rank."""
    table_gen = torch.Generator().manual_seed(seed)
    next_token = torch.randint(vocab, (vocab, 4), generator=table_gen)  # 4 likely successors per token
    gen = torch.Generator().manual_seed(seed * 7919 + step + 1)
    tokens = torch.empty(batch, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (batch,), generator=gen)
    choice = torch.randint(4, (batch, seq_len), generator=gen)
    for t in range(seq_len):
        tokens[:, t + 1] = next_token[tokens[:, t], choice[:, t]]
    return tokens


class TokenData:
    """A training and a validation token stream, and the sampler: the batch of step k is drawn from a generator
    seeded by (seed, split, k), so every layout sees the same global batch at every step and a resumed run
    continues the same sequence of batches (its data position is the step)."""

    def __init__(self, source, train=None, val=None, vocab=256, text=False):
        self.source, self.train, self.val, self.vocab = source, train, val, vocab  # vocab: ids the data uses
        self.text = text  # the ids are the bytes of a text: a sample is decoded as UTF-8

    def batch(self, split, step, batch, seq_len, seed, device="cpu"):
        if self.source == "synthetic":  # validation batches from their own seeds (negative steps)
            return synthetic_batch(step if split == "train" else -1 - step, batch, seq_len, self.vocab,
                                   seed).to(device)
        stream = self.train if split == "train" else self.val
        gen = torch.Generator().manual_seed(seed * 1_000_003 + 2 * step + (split == "val"))
        starts = torch.randint(len(stream) - seq_len, (batch,), generator=gen)
        index = starts[:, None] + torch.arange(seq_len + 1)  # every sequence in one gather
        if isinstance(stream, torch.Tensor):
            return stream[index].to(device)
        return torch.from_numpy(stream[index.numpy()].astype(np.int64)).to(device)  # a uint16 memmap


def chapter_data(spec, seq_len, vocab):
    """`embedded` (CPython's pydoc topics, ~466 KB of English, as bytes) or `synthetic` (a bigram language over the
    model's whole vocabulary)."""
    if spec == "synthetic":
        return TokenData("synthetic", vocab=vocab)
    if spec != "embedded":
        raise ValueError(f"--data {spec}: choose embedded or synthetic (text files and nanoGPT's .bin files are the "
                         "whole program's)")
    import pydoc_data.topics
    text = "".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)).encode()
    return _split_text("embedded corpus", _text_tokens(text), seq_len)


def _text_tokens(text_bytes):
    return torch.from_numpy(np.frombuffer(text_bytes, dtype=np.uint8).astype(np.int64))


def _split_text(name, tokens, seq_len):
    n_val = int(len(tokens) * VAL_FRACTION)
    if n_val <= seq_len or len(tokens) - n_val <= seq_len:
        raise ValueError(f"{name} holds {len(tokens)} bytes: too few for --seq {seq_len} (each split needs more "
                         f"than --seq tokens, the validation split is the last {VAL_FRACTION:.0%}); pass more text "
                         "or a smaller --seq")
    return TokenData(name, tokens[:-n_val], tokens[-n_val:], vocab=int(tokens.max()) + 1, text=True)


def step_record(step, lr, loss, aux, grad_norm, stepped, dt, stage, opt, cfg, train_cfg):
    """What a step logs: step, loss, aux_loss (the router loss), lr, grad_norm, tokens_per_s, step_time_s (the step
    itself: the batch is drawn before the clock starts); mfu with --peak-tflops or a known GPU (its dense BF16 peak,
    whatever --dtype); loss_scale and skipped under FP16. (The whole program's job adds val_loss on eval steps, and
    on the first line this rank's memory and the batch's make-up.)"""
    device = next(stage.parameters()).device
    record = {"step": step, "loss": loss, "aux_loss": aux, "lr": lr,
              "grad_norm": grad_norm if math.isfinite(grad_norm) else None,  # JSON has no inf (FP16 skips)
              "tokens_per_s": train_cfg.batch * cfg.seq_len / dt, "step_time_s": dt}
    peak = peak_tflops(train_cfg, device)
    if peak:
        world = stage.plan.parallel_state.world_size
        record["mfu"] = model_flops_per_token(cfg) * record["tokens_per_s"] / (peak * 1e12 * world)
    if opt.loss_scaler is not None:
        record["loss_scale"] = opt.loss_scaler.scale
    if not stepped:
        record["skipped"] = True  # FP16 overflow: no update, the loss scale backed off
    return record


GPU_PEAK_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "A100": 312.0,
                   "L40S": 362.0}  # dense BF16 per GPU; the first name that the device's name contains


def peak_tflops(train_cfg, device):
    if train_cfg.peak_tflops:
        return train_cfg.peak_tflops
    if device.type == "cuda":
        name = torch.cuda.get_device_name()
        return next((v for k, v in GPU_PEAK_TFLOPS.items() if k in name), None)
    return None  # no known peak on CPU: no MFU


def model_flops_per_token(cfg):
    """Training FLOPs per token (PaLM appendix B, as nanoGPT's MFU): 6 N + 12 L h s, N the weights of every
    matmul a token goes through, forward and backward (x 3): per dense block 12 h^2 (QKV 3, projection 1, MLP
    8); per MoE block 4 h^2 + E h (the router) + k 8 h^2 (its top-k experts) + k h (the router-weighted sum of
    the k expert outputs, a (1 x k)(k x h) product); and the LM head V h (tied to the embedding, whose lookup
    is not a matmul). 12 L h s is attention's QK^T and AV over the whole sequence (a causal kernel skips half
    of it; PaLM and FlopCounterMode count all of it). benchmarks/report.py measures the same number."""
    h, k = cfg.n_embd, cfg.top_k
    n = cfg.vocab_size * h
    for layer in range(cfg.n_layer):
        n += 4 * h * h + (cfg.n_experts * h + k * 8 * h * h + k * h if cfg.is_moe(layer) else 8 * h * h)
    return 6 * n + 12 * cfg.n_layer * h * cfg.seq_len


def step_line(record, skipped, moe):
    """The one line a step prints on rank 0, numbered as the checkpoint of the state after it is (the metrics'
    "step" counts from 0: its line of step 59 is logged as step 60, and saved as step_000060)."""
    r = record
    return (f"step {r['step'] + 1}: loss {r['loss']:.4f}" + (f", val {r['val_loss']:.4f}" if "val_loss" in r else "")
            + (f", aux {r['aux_loss']:.4f}" if moe else "") + f", lr {r['lr']:.2e}, |g| "
            + (f"{r['grad_norm']:.3f}, " if r["grad_norm"] is not None else "inf, ")
            + (f"skipped (FP16 overflow, {skipped} in a row, loss scale now {r['loss_scale']:g}), "
               if r.get("skipped") else "")
            + f"{r['step_time_s'] * 1000:.0f} ms, {r['tokens_per_s']:,.0f} tok/s"
            + (f", mfu {r['mfu']:.1%}" if "mfu" in r else ""))


def begin_step(step, opt, data, cfg, train_cfg, device):
    """A step's learning rate, set on every parameter group, and its batch: made before the step's clock starts."""
    lr = lr_at(step, train_cfg)
    for group in opt.param_groups:
        group["lr"] = lr
    tokens = data.batch("train", step, train_cfg.batch, cfg.seq_len, cfg.seed, device)
    if device.type == "cuda":
        torch.cuda.synchronize()  # the clock times the step alone
    return lr, tokens


def train(cfg, train_cfg, data=None):
    """nanoGPT's loop: for each step the learning rate, the batch, the step (`train_step`: forward and backward of
    the micro-batches through the schedule, the gradient sums, the optimizer), one line on rank 0, and with --metrics
    the step's record (`step_record`) appended as one JSON line. Returns the records."""
    data = data or chapter_data(train_cfg.data, cfg.seq_len, cfg.vocab_size)
    if data.vocab > cfg.vocab_size:
        raise ValueError(f"--vocab {cfg.vocab_size} is smaller than the data's vocabulary ({data.vocab}): pass --vocab "
                         f"{data.vocab} or more")
    plan, stage, opt, pipe = build(cfg, train_cfg)
    rank, device = plan.parallel_state.rank, next(stage.parameters()).device
    metrics = open(train_cfg.metrics, "a") if train_cfg.metrics and rank == 0 else None
    records, skipped = [], 0
    for step in range(train_cfg.steps):
        lr, tokens = begin_step(step, opt, data, cfg, train_cfg, device)
        t0 = time.perf_counter()
        loss, aux, grad_norm, stepped, _ = train_step(stage, pipe, opt, tokens, train_cfg.micro_batch,
                                                      train_cfg.grad_clip)
        # train_step ends with a host sync (the loss), so this is the whole step
        record = step_record(step, lr, loss, aux, grad_norm, stepped, time.perf_counter() - t0, stage, opt, cfg,
                             train_cfg)
        records.append(record)
        skipped = 0 if stepped else skipped + 1  # FP16 steps skipped in a row
        if metrics:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        if train_cfg.log and rank == 0:
            print(step_line(record, skipped, moe=cfg.moe_every > 0), flush=True)
    if metrics:
        metrics.close()
    return records


# ---- The command line --------------------------------------------------------------------------------------

FLAG_GROUPS = ("model", "parallelism (DP is the world over TP x CP x PP)", "precision", "memory",
               "data and optimisation", "run")


def chapter_flags(ap, group_names=FLAG_GROUPS, choices=None, more_help=None):
    """Add the chapter's flags to `ap`, in the groups FLAG_GROUPS names; returns every group's add_argument by name.
    A longer command line passes more groups, more `choices` (by flag, as below) and `more_help`, a sentence added
    to a flag's help."""
    group = {name: ap.add_argument_group(name).add_argument for name in group_names}
    more = lambda dest: (more_help or {}).get(dest, "")
    choices = {"cp_impl": sorted(CP_IMPLS), "dtype": list(PARAM_DTYPES), "zero": [0, 1],
               "fp8_recipe": mixed_precision.PER_TENSOR_RECIPES, "recompute": checkpointing.POLICIES, **(choices or {})}
    model, parallel = group["model"], group["parallelism (DP is the world over TP x CP x PP)"]
    model("--layers", type=int, default=4, help="transformer blocks")
    model("--heads", type=int, default=4, help="attention heads")
    model("--hidden", type=int, default=64, help="model width h (the MLP is 4h)")
    model("--seq", type=int, default=64, help="sequence length in tokens")
    model("--vocab", type=int, default=256, help="vocabulary size (256: bytes of text; pad to a multiple of --tp)")
    model("--moe-every", type=int, default=0, help="every n-th block's MLP is a mixture of experts (0: dense)")
    model("--experts", type=int, default=8, help="experts per MoE block")
    model("--top-k", type=int, default=2, help="experts each token is routed to")
    parallel("--tp", type=int, default=1, help="tensor parallel ranks (inside a node)")
    parallel("--pp", type=int, default=1, help="pipeline stages")
    parallel("--cp", type=int, default=1, help="context parallel ranks (the sequence split over them)")
    parallel("--ep", type=int, default=1, help="expert parallel ranks, folded over DP x CP")
    parallel("--sequence-parallel", action="store_true", help="split the LayerNorm and residual activations over TP")
    parallel("--cp-impl", default="ring", choices=choices["cp_impl"], help="how CP attends across the ranks")
    group["precision"]("--dtype", default="float32", choices=choices["dtype"], help="the weights' and "
                       "activations' dtype; masters, main grads and optimizer states stay FP32" + more("dtype"))
    group["precision"]("--fp8-recipe", default="tensorwise", choices=choices["fp8_recipe"], help="with "
                       "--dtype fp8: the scaling granularity (tensorwise: current per-tensor scales; delayed: from "
                       "an amax history" + more("fp8_recipe") + ")")
    group["memory"]("--zero", type=int, default=0, choices=choices["zero"], help="1: shard the optimizer states "
                    "over DP x CP (Megatron-LM's distributed optimizer)" + more("zero"))
    group["memory"]("--recompute", default="none", choices=choices["recompute"], help="activation recomputation policy "
                    "(full: every block's input kept; sqrt: one in sqrt(L) blocks; selective: all but the attention "
                    "core)" + more("recompute"))
    data = group["data and optimisation"]
    data("--data", default="embedded", help="embedded (CPython's documentation) or synthetic" + more("data"))
    data("--batch", type=int, default=16, help="global batch in sequences")
    data("--micro-batch", type=int, default=2, help="sequences per micro-batch on one DP rank")
    data("--steps", type=int, default=30, help="optimizer steps of the run (the cosine schedule ends there)")
    data("--optimizer", default="adamw", choices=["adamw", "sgd"], help="the inner optimizer of the FP32 masters")
    data("--lr", type=float, default=3e-3, help="peak learning rate")
    data("--min-lr", type=float, default=None, help="cosine decay target (default: --lr / 10)")
    data("--warmup", type=int, default=0, help="linear warm-up steps")
    data("--weight-decay", type=float, default=0.1, help="of the 2-D weights (AdamW: decoupled; SGD: L2)")
    data("--grad-clip", type=float, default=1.0, help="global gradient-norm clipping (0: off)")
    data("--seed", type=int, default=0, help="the weights' and the batches' seed")
    group["run"]("--metrics", default=None, help="the metrics file, one JSON object per step" + more("metrics"))
    group["run"]("--timeout-s", type=float, default=300.0, help="how long any collective waits for a rank")
    group["run"]("--peak-tflops", type=float, default=None, help="per GPU, for MFU (default on A100/H100/H200: "
                 "the dense BF16 peak, whatever --dtype)")
    return group


def configs_of(flags, config_class):
    """The parsed flags as (GPTConfig, config_class), every field the flags name."""
    cfg = GPTConfig(vocab_size=flags.vocab, seq_len=flags.seq, n_layer=flags.layers, n_head=flags.heads,
                    n_embd=flags.hidden, seed=flags.seed, moe_every=flags.moe_every, n_experts=flags.experts,
                    top_k=flags.top_k)
    return cfg, config_class(**{f.name: getattr(flags, f.name) for f in fields(config_class) if hasattr(flags, f.name)})


def parse_args(argv=None):
    """The chapter's flags -> (GPTConfig, TrainConfig)."""
    ap = argparse.ArgumentParser(description="Train a GPT with TP x CP x DP x PP (DP = world / (tp*cp*pp)) and EP, "
                                 "by torchrun: the chapter's run.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    chapter_flags(ap)
    cfg, train_cfg = configs_of(ap.parse_args(argv), TrainConfig)
    if train_cfg.dtype == "fp8" and train_cfg.fp8_recipe == "delayed" and train_cfg.recompute in ("full", "sqrt"):
        # a recomputed forward runs the block's GEMMs again and would push each amax into the history twice
        ap.exit(2, f"train_gpt.py: error: --fp8-recipe delayed with --recompute {train_cfg.recompute} records each "
                "GEMM's amax twice: use --recompute none or selective, or --fp8-recipe tensorwise\n"
                if os.environ.get("RANK", "0") == "0" else None)
    return cfg, train_cfg


def main(argv=None):
    cfg, train_cfg = parse_args(argv)
    if os.environ.get("OMP_NUM_THREADS") is None and not torch.cuda.is_available():  # a CPU process: its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    records = train(cfg, train_cfg)
    if dist.get_rank() == 0:
        print(f"loss {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f} in {len(records)} steps")
    dist.barrier()
    dist.destroy_process_group()


# Run as a program, the chapter alone runs its `main`; the whole file (a banner follows) runs `main_job` at its end.
if __name__ == "__main__" and not any(line.startswith("# BEYOND THE CHAPTER") for line in open(__file__)):
    main()


# BEYOND THE CHAPTER: interleaved, zero-bubble and V schedules, all-gather and hybrid CP, finer FP8, NVFP4, ZeRO-2/3
# ====================================================================================================
# What follows extends the core above rather than copying it, each form under its own name, picked by its flag
# (`build_at_scale`): JobConfig; PlanAtScale (a Plan with all-gather and hybrid CP, offloading, and TP linears
# through _TPLinearAtScale where a backward needs it: FP8 or NVFP4 backward GEMMs, zero bubble's deferred weight
# GEMM); PipelineAtScale (the interleaved and zero-bubble lists), ZeroBubblePipeline (the split B and W) and
# VPipeline (the V schedules: two chunks in a V, DualPipeV's F&B pairs overlapped); a block forward for ZeRO-2/3
# units; fine-grained FP8 and NVFP4 products; moe_ep.GroupedGEMMMoE and OverlappedMoE. A run without these flags
# builds the chapter's Plan and Pipeline and runs the core's code as written.


import threading
from dataclasses import replace
from functools import partial


@dataclass
class JobConfig(TrainConfig):
    """The whole program's configuration: the chapter's TrainConfig, the options of the forms beyond it, and the
    job's (data files, validation, checkpoints, initial weights)."""
    cp_ulysses: int = 1               # --cp-impl hybrid: the Ulysses ranks inside each CP group (CP = u x ring)
    pp_schedule: str = "1f1b"         # 1f1b | interleaved | zb-h1
    virtual_stages: int = 1           # model chunks per pipeline rank (interleaving)
    nvfp4_bf16_last: int = None       # with --dtype nvfp4: the last K blocks stay BF16 (None: the last 15 %)
    fp8_backward: str = "bf16"        # with --dtype fp8: bf16 (16-bit backward GEMMs) | fp8 (E5M2 gradients)
    fp8_param_gather: bool = False    # ZeRO 1-3: all-gather the weights in MXFP8 + scales instead of BF16
    zero_shard_size: int = None       # hybrid sharding: shard over groups of this many DP x CP ranks, replicate across
    eval_every: int = 0               # steps between validation losses (0: none)
    eval_batches: int = 4
    out_dir: str = None               # checkpoints: out_dir/step_NNNNNN
    save_every: int = 0               # steps between checkpoints (0: only at the end, if out_dir is set)
    keep_last: int = 0                # keep the newest N checkpoints (0: all)
    async_save: bool = False          # checkpoints copied to host memory, written by a background thread
    resume: bool = False              # continue from the latest complete checkpoint in out_dir, if any
    init_from_hf: str = None          # a GPT-2 folder (config.json, model.safetensors): the initial weights
    moe_grouped_gemm: bool = False    # each MoE layer's local experts as one grouped GEMM (moe_ep.GroupedGEMMMoE)
    memory_report: bool = False       # step 2's peak per rank and part, measured from live tensors, beside topology's
    # also: data may be a text file, a folder of them, or train.bin/val.bin; recompute offload, selective+offload;
    # zero 2 and 3; dtype nvfp4; cp_impl allgather and hybrid; fp8_recipe rowwise, blockwise, mxfp8

    @property
    def param_dtype(self):  # NVFP4 block GEMMs on BF16 weights (below)
        return torch.bfloat16 if self.dtype == "nvfp4" else super().param_dtype

# ---- Context parallelism: two more implementations (PlanAtScale runs them) ----------------------------------

CP_IMPLS_AT_SCALE = {
    # all-gather CP: each rank gathers the whole K and V and attends its zigzag query shard to them
    "allgather": (lambda plan, q, k, v: long_seq.allgather_attention(q, k, v, plan.cp), long_seq.zigzag_shard),
    # hybrid (USP): Ulysses over the inner cp_ulysses ranks, the ring across them; its shards: the ring's zigzag ones
    "hybrid": (lambda plan, q, k, v: long_seq.hybrid_attention(q, k, v, plan.cp_ulysses, plan.cp_ring),
               long_seq.zigzag_shard)}
ALL_CP_IMPLS = {**CP_IMPLS, **CP_IMPLS_AT_SCALE}  # --cp-impl


# ---- Tensor parallelism as torch.distributed.tensor.parallel writes it -------------------------------------
# The TP/SP layers above are the plan torch.distributed.tensor.parallel writes with DTensors, as production code
# (torchtitan) does, here by hand so that every collective is in sight. For one block, with SP:
#     parallelize_module(block, tp_mesh, {"ln1": SequenceParallel(), "ln2": SequenceParallel(),
#         "q": ColwiseParallel(input_layouts=Shard(1)), "k": ..., "v": ...,  # ColwiseParallel splits one weight's
#         "proj": RowwiseParallel(output_layouts=Shard(1)),                # rows contiguously: Q, K and V as
#         "fc": ColwiseParallel(input_layouts=Shard(1)),                   # three linears (our QKV splits its
#         "out": RowwiseParallel(output_layouts=Shard(1))})                # three blocks apart, tp_parts=3)
# without SP, ColwiseParallel() and RowwiseParallel() and no SequenceParallel; the embedding RowwiseParallel
# (vocabulary rows), the LM head ColwiseParallel(use_local_output=False) under loss_parallel().


# ---- The Plan beyond the chapter: hybrid CP's and hybrid sharding's groups, the at-scale TP backward -------

@dataclass(frozen=True)
class PlanAtScale(Plan):
    """The Plan with what the at-scale forms read (`make_plan_at_scale`): the hybrid CP's two groups, hybrid
    sharding's, zero bubble's split backward; its attention and shards also all-gather and hybrid CP's
    (CP_IMPLS_AT_SCALE), its blocks run offloaded (--recompute offload), its TP linears run _TPLinearAtScale where a
    backward needs it."""
    cp_ulysses: object           # the hybrid's two sub-groups of cp: Ulysses inside, the ring across
    cp_ring: object
    dp_cp_shard: object          # hybrid sharding: the data-parallel sums' shards of DP x CP ...
    dp_cp_replicate: object      # ... replicated over these (None without hybrid sharding)
    split_backward: bool         # zero bubble: each backward split into B (input grads) and W (weight grads)

    def column_parallel(self, x, weight, bias=None, gemm=F.linear):
        if self.tp is None and not self.split_backward:
            return gemm(x, weight, bias)
        return _TPLinearAtScale.apply(x, weight, bias, self.tp, self.sequence_parallel, gemm)

    def attention(self, q, k, v):
        if self.cp is not None and self.cp_impl in CP_IMPLS_AT_SCALE:
            return CP_IMPLS_AT_SCALE[self.cp_impl][0](self, q, k, v)
        return Plan.attention(self, q, k, v)

    def shard(self, x, dim):
        if self.cp is not None and self.cp_impl in CP_IMPLS_AT_SCALE:
            return CP_IMPLS_AT_SCALE[self.cp_impl][1](x, dim, self.parallel_state.cp_rank, self.sizes["cp"])
        return Plan.shard(self, x, dim)

    def run_blocks(self, blocks, state):
        if self.recompute in checkpointing.OFFLOAD_POLICIES:  # offloading: a Policy below checkpointing.py's banner
            return checkpointing.run_blocks(blocks, state, checkpointing.OFFLOAD_POLICIES[self.recompute])
        return Plan.run_blocks(self, blocks, state)

    def row_parallel(self, x, weight, bias, gemm=F.linear):
        if not self.split_backward:  # the local product runs its own backward
            return Plan.row_parallel(self, x, weight, bias, gemm)
        # the local product through _TPLinearAtScale, whose weight GEMM W can run later
        y = _TPLinearAtScale.apply(x, weight, None if self.tp else bias, None, False, gemm)
        return y if self.tp is None else self.reduce_tp(y) + bias


def needs_hybrid_groups(job_cfg):  # topology.init_hybrid_parallel's groups: hybrid CP's, hybrid sharding's
    return job_cfg.cp_impl == "hybrid" or job_cfg.zero_shard_size is not None


def needs_plan_at_scale(job_cfg):
    return (needs_hybrid_groups(job_cfg) or job_cfg.cp_impl in CP_IMPLS_AT_SCALE or splits_backward(job_cfg)
            or job_cfg.recompute in
            checkpointing.OFFLOAD_POLICIES or job_cfg.dtype == "nvfp4" or (job_cfg.dtype == "fp8" and
                                                                            job_cfg.fp8_backward == "fp8"))


def splits_backward(job_cfg):  # zero bubble's B and W: ZB-H1, and the V schedules (DualPipeV: some of its B's)
    return job_cfg.pp_schedule == "zb-h1" or job_cfg.pp_schedule in V_SCHEDULES


def make_plan_at_scale(cfg, job_cfg, parallel_state):
    """The chapter's Plan (make_plan) with this rank's model chunks under interleaving (chunk c: virtual stage
    c p + r), and where a flag needs it a PlanAtScale."""
    plan, v = make_plan(cfg, job_cfg, parallel_state), job_cfg.virtual_stages
    if job_cfg.pp_schedule in V_SCHEDULES:
        plan = v_placement(plan)
    elif v > 1:
        per_chunk, p = plan.layers_per_stage // v, plan.sizes["pp"]
        chunks = [(c * p + parallel_state.pp_rank) * per_chunk for c in range(v)]
        layers = tuple(i for first in chunks for i in range(first, first + per_chunk))
        plan = replace(plan, virtual_stages=v, layers=layers)
    if not needs_plan_at_scale(job_cfg):
        return plan
    hybrid = {kind: None for kind in ("cp_ulysses", "cp_ring", "dp_cp_replicate")} | {"dp_cp_shard": plan.dp_cp}
    if needs_hybrid_groups(job_cfg):  # a HybridParallelState
        hybrid = {kind: parallel_state.groups[kind] if len(parallel_state.ranks[kind]) > 1 else None for kind in hybrid}
    return PlanAtScale(**{f.name: getattr(plan, f.name) for f in fields(plan)}, **hybrid,
                       split_backward=splits_backward(job_cfg))


class _TPLinearAtScale(_TPLinear):
    """_TPLinear with the at-scale backward: the product's own backward GEMMs (`gemm.backward_gemms`: FP8 with E5M2
    gradients, NVFP4), and zero bubble's split: while a B runs (`deferred_weight_grads`), the weight GEMM is left
    for the schedule's W (with group None where TP = 1)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, gemm=F.linear):
        ctx.backward_gemms = getattr(gemm, "backward_gemms", None)
        ctx.parameter = weight  # W adds into the parameter itself (a recomputed graph saves only its values)
        return _TPLinear.forward(ctx, x, weight, bias, group, sequence_parallel, gemm)

    @staticmethod
    def backward(ctx, grad_out):                                        # grad_out (b, s, h_out/t)
        x, weight = ctx.saved_tensors
        x_full = _all_gather_seq(x, ctx.group) if ctx.sp else x         # (b, s, h_in), gathered again under SP
        g2 = grad_out.reshape(-1, grad_out.shape[-1])                   # (N, h_out/t)
        x2 = x_full.reshape(-1, x_full.shape[-1])                       # (N, h_in)
        wgrad = None  # the weight GEMM: g2^T x2 in the weights' dtype, or the product's
        if ctx.backward_gemms is None:
            grad_x = grad_out @ weight                                  # (b, s, h_in)
        else:  # the dgrad now, with the scales both GEMMs use; the wgrad with the same scales, now or in W
            (grad_x, _), scales = ctx.backward_gemms(g2, x2, weight, (True, False))       # (N, h_in)
            grad_x = grad_x.reshape(*grad_out.shape[:-1], weight.shape[1])             # (b, s, h_in)
            wgrad = lambda g2, x2: ctx.backward_gemms(g2, x2, weight, (False, True), scales)[0][1]
        grad_x, wait = _sum_input_grad(grad_x, ctx)                     # summed (f): (b, s/t, h_in) under SP
        grad_b = g2.sum(0) if ctx.has_bias else None                    # (h_out/t,)
        if _deferred is not None:  # zero bubble: this GEMM belongs to W
            _deferred.append(partial(_weight_grad, ctx.parameter, g2, x2, gemm=wgrad))
            wait()
            return grad_x, None, grad_b, None, None, None
        grad_w = g2.t() @ x2 if wgrad is None else wgrad(g2, x2)        # (h_out/t, h_in), while grad_x travels
        wait()
        return grad_x, grad_w, grad_b, None, None, None


# ---- FP8 beyond per-tensor scales: the fine-grained recipes, and FP8 backward GEMMs ------------------------
# Rowwise, blockwise and MXFP8 scales (--fp8-recipe) are local in a column-parallel layer (every block lies on one
# rank) and agreed over TP where a row-parallel layer cuts K; per-row and per-block activation scales do not depend
# on the CP and DP split. `use_fine_grained_fp8` gives each block linear `fine_grained_fp8_product`, which passes
# the recipe, the backward and the layer's TP split to mixed_precision.fine_grained_fp8_linear; with --fp8-backward
# fp8 it adds the backward GEMMs that _TPLinearAtScale runs (`fp8_backward_gemms`).

BLOCK_LINEARS = (("qkv", "attn.qkv", "column"), ("proj", "attn.proj", "row"), ("fc", "mlp.fc", "column"),
                 ("out", "mlp.proj", "row"))  # attribute, name, TP split; a MoE block has no fc/out (experts: BF16)


class FP8(NamedTuple):
    recipe: str      # --fp8-recipe
    backward: str    # --fp8-backward: "bf16" or "fp8"


def use_fine_grained_fp8(stage, fp8):
    """A fine-grained --fp8-recipe or --fp8-backward fp8: each block linear's product is `fine_grained_fp8_product`."""
    for block in stage.blocks:
        for attr, _, split in BLOCK_LINEARS:
            layer = getattr(block, attr, None)
            if layer is not None:
                layer.gemm = fine_grained_fp8_product(layer, fp8, split)


def fine_grained_fp8_product(layer, fp8, split):
    """fp8_product beyond per-tensor scales: mixed_precision.fine_grained_fp8_linear, the recipe's blocks agreed over
    TP where the layer's `split` cuts K, and the FP8 backward's GEMMs (E5M2 gradients) for _TPLinearAtScale."""
    def product(x, weight, bias=None):
        return mixed_precision.fine_grained_fp8_linear(x, weight, bias, amax_group=layer.plan.tp, recipe=fp8.recipe,
                                                       backward=fp8.backward,
                                                       split=split if layer.plan.tp is not None else None,
                                                       amax_history=getattr(layer, "amax_history", None),
                                                       record_amax=torch.is_grad_enabled())

    if fp8.backward == "fp8":
        product.backward_gemms = partial(fp8_backward_gemms, layer, fp8, split)
    return product


def fp8_backward_gemms(layer, fp8, split, g2, x2, weight, needs, scales=None):
    """_TPLinear's FP8 backward (--fp8-backward fp8): ((grad_x, grad_w), scales), FP8 with E5M2 gradients at the
    recipe's granularity (mixed_precision.fp8_backward_gemms). In the backward it is the column-parallel dgrad that
    cuts its reduction dimension (the layer's outputs) over TP, and those blocks are agreed there. Through _TPLinear
    (TP, or zero bubble) both backward GEMMs take per-tensor scales from the current amaxes (delayed scaling
    included), agreed on the first call."""
    group = layer.plan.tp
    if scales is None and fp8.recipe not in mixed_precision.FINE_GRAINED:  # per-tensor scales
        scales = mixed_precision.fp8_backward_scales(g2, x2, weight, group)
    return mixed_precision.fp8_backward_gemms(g2, x2, weight, fp8.recipe, group, split if group else None,
                                              needs=needs, scales=scales), scales


# ---- NVFP4 block linears (--dtype nvfp4): all three GEMMs in 4 bits, the last blocks and the LM head in BF16 ----
# mixed_precision.nvfp4_linear's recipe (E2M1 values, one E4M3 scale per 16 along K, an FP32 scale per tensor;
# 16 x 16 weight blocks; the wgrad's operands Hadamard-transformed along the tokens; the gradients rounded
# stochastically) in the block linears before the last --nvfp4-bf16-last blocks; those, the LM head and the experts
# stay BF16 (NVIDIA's recipe keeps the last ~15 % of the blocks in BF16: the default). Weights BF16 with FP32
# masters, as under FP8, at every ZeRO level. Under TP the shards of x, W and G are one tensor each: their FP32
# tensor scales are MAX-agreed over TP (one all-reduce in the forward for x and W, one in the backward for G,
# G^T R and x^T R, and W where _TPLinear quantises it again), and each 16-block must lie on one rank: a
# row-parallel layer cuts K, a column-parallel one its outputs (the dgrad's K), into n_embd / TP (x 4 for the
# MLP) per rank, so validate asks n_embd / TP to be a multiple of 16. The Hadamard signs come from --seed: the
# same on every rank.
#
# The stochastic rounding does not depend on the layout: the draws of micro-batch j (its index in the global
# batch: DP rank x m + its index on this rank, so the same sequences) of a step are a hash of (--seed, step, layer
# name, GEMM, j) and of each element's row and column in the whole tensor (all outputs and all tokens of the
# micro-batch): a rank makes only its TP and CP shard's draws, the values one draw over the whole tensor gives there
# (`counter_uniforms`; drawing the whole and cutting it costs TP x CP times the shard). The step is the loop's, so a
# resumed run draws what the uninterrupted one drew; only backward GEMMs draw, so a recomputed forward changes
# nothing. The tensor scales are agreed over TP x CP, since CP ranks hold the other tokens of one micro-batch. The
# wgrad's Hadamard transform mixes blocks of 16 tokens: where a CP shard keeps them whole (zigzag chunks, s / 2cp
# tokens, a multiple of 16) they are the one-rank blocks; otherwise each CP rank transforms its own 16 and draws
# its own (seeded by its CP rank too), and CP layouts agree statistically, not to the bit. Layouts then agree with
# one rank to the FP32 order of the sums that they split (one layer's outputs and gradients: 4e-8 relative; DP:
# none, to the bit), whose last bits, carried into BF16 activations, can flip a later rounding (tests/ measures).

NVFP4_TOKENS = mixed_precision.NVFP4_BLOCK  # the wgrad's Hadamard transform mixes blocks of 16 tokens


def nvfp4_bf16_last(cfg, train_cfg):
    """K: the last K blocks stay BF16 (--nvfp4-bf16-last; default the last 15 %, rounded: 1 of 4, 2 of 12)."""
    k = train_cfg.nvfp4_bf16_last
    return round(0.15 * cfg.n_layer) if k is None else k


def whole_token_blocks(positions):
    """Whether a CP shard's token positions keep the wgrad's Hadamard blocks (16 tokens from a multiple of 16)
    whole: then they are the one-rank blocks."""
    if len(positions) % NVFP4_TOKENS:
        return False
    blocks = positions.reshape(-1, NVFP4_TOKENS)
    starts = blocks[:, :1]
    return bool((starts % NVFP4_TOKENS == 0).all() and (blocks == starts + torch.arange(NVFP4_TOKENS)).all())


def _mix32(x):
    """lowbias32, a 32-bit integer hash (a bijection of [0, 2^32)), in place on an int64 tensor of values below 2^32.
    Every product stays below 2^63, so int64 holds it exactly on every device: the multiplier above 2^31 is applied
    as x (c - 2^31) + (x mod 2) 2^31, which is x c mod 2^32."""
    x ^= x >> 16
    x.mul_(0x7FEB352D).bitwise_and_(0xFFFFFFFF)
    x ^= x >> 15
    odd = (x & 1) << 31
    x.mul_(0x846CA68B - 2 ** 31).add_(odd).bitwise_and_(0xFFFFFFFF)
    x ^= x >> 16
    return x


HASHED_AT_ONCE = 2 ** 22  # counter_uniforms' elements per pass: ~100 MB of int64 working set


def counter_uniforms(seed, rows, cols):
    """U[0, 1) at the elements (rows[i], cols[j]) of a tensor, given their indices in the whole tensor (each below
    2^32): a hash of (64-bit seed, row, column), so that a rank makes its shard's draws alone and they are the values
    the whole tensor's would be there (a counter-based generator, as Philox is on a GPU, in integer ops that every
    device computes alike). Distinct rows (columns) get distinct keys; 24 bits each, as torch.rand's float32. The
    int64 working set (24 bytes an element) is bounded by hashing HASHED_AT_ONCE elements at a time (whole rows,
    at least one) into the float32 result."""
    low, high = seed & 0xFFFFFFFF, seed >> 32 & 0xFFFFFFFF
    # the columns' keys take a constant besides the seed's halves, so that rows and columns never share a key
    # function (with low = high, they would, and the tensor would be symmetric)
    row_keys, col_keys = _mix32(_mix32(rows ^ low) ^ high), _mix32(_mix32(cols ^ high) ^ low ^ 0x9E3779B9)
    out = torch.empty(len(rows), len(cols), device=rows.device)
    rows_at_once = max(1, HASHED_AT_ONCE // max(1, len(cols)))
    for part, keys in zip(out.split(rows_at_once), row_keys.split(rows_at_once)):
        bits = _mix32(keys[:, None] ^ col_keys[None, :])
        bits >>= 8
        part.copy_(bits).mul_(2.0 ** -24)
    return out


class NVFP4Rounding:
    """One layer's stochastic-rounding draws: U[0, 1) for micro-batch `micro` of the stage's current step, the
    values of one draw over the whole tensor (the layer's whole outputs, the micro-batch's whole sequences) at this
    rank's TP and CP shard, made for the shard alone (`counter_uniforms`)."""

    def __init__(self, name, layer, stage, seed, split):
        self.name, self.stage, self.seed, self.plan = name, stage, seed, layer.plan
        self.parts = getattr(layer.weight, "tp_parts", 1) if split == "column" else None  # None: not cut
        self.device, self.step, self.count = layer.weight.device, None, {}
        sequence = torch.arange(self.plan.seq_cp * self.plan.sizes["cp"])
        self.cp_blocks_whole = whole_token_blocks(self.plan.shard(sequence, 0))

    def next_micro(self, role):
        """This rank's index of the micro-batch whose `role` backward runs now (each runs once per micro-batch, in
        order, whatever the schedule and the recomputation)."""
        step = getattr(self.stage, "step", 0)
        if step != self.step:
            self.step, self.count = step, {}
        self.count[role] = self.count.get(role, 0) + 1
        return self.count[role] - 1

    def uniforms(self, role, shape, micro):
        """U[0, 1) of `shape` (this rank's shard of G for "dgrad", of G^T R for "wgrad") for micro-batch `micro`."""
        plan, ps = self.plan, self.plan.parallel_state
        t, cp = plan.sizes["tp"], plan.sizes["cp"]
        j = ps.dp_rank * plan.micro_batch_count + micro  # the micro-batch's index in the global batch
        tokens, outputs = (0, 1) if role == "dgrad" else (1, 0)  # G (tokens, N), G^T R (N, tokens)
        cut_tp = self.parts is not None and t > 1
        cut_cp = cp > 1 and (role == "dgrad" or self.cp_blocks_whole)
        key = f"{self.seed} {self.step} {self.name} {role} {j}" + (f" cp {ps.cp_rank}" if cp > 1 and not cut_cp
                                                                   else "")
        # a 64-bit seed (CRC32 and Adler-32 of the key): a long run has more keys than 2^32, and two GEMMs that
        # shared a 32-bit seed would round alike
        seed = zlib.crc32(key.encode()) << 32 | zlib.adler32(key.encode())
        # the indices of this rank's outputs and tokens in the whole tensor, cut as the tensor is
        output_index = torch.arange(shape[outputs] * (t if cut_tp else 1), device=self.device)
        if cut_tp:  # this rank's 1/t of each of the layer's `parts` output blocks (as its weight rows)
            output_index = rearrange(output_index, "(parts t o) -> parts t o", parts=self.parts, t=t)[:, ps.tp_rank]
        token_index = torch.arange(shape[tokens] * (cp if cut_cp else 1), device=self.device)
        if cut_cp:  # this rank's CP shard of each sequence's tokens
            token_index = plan.shard(token_index.unflatten(0, (-1, plan.seq_cp * cp)), 1)
        token_index, output_index = token_index.flatten(), output_index.flatten()
        if role == "dgrad":
            return counter_uniforms(seed, token_index, output_index)
        return counter_uniforms(seed, output_index, token_index)

    def counted(self, role, shape):  # nvfp4_linear's own backward asks once per GEMM and micro-batch
        return self.uniforms(role, shape, self.next_micro(role))


def use_nvfp4(stage, cfg, train_cfg):
    """Give the block linears before the last K blocks NVFP4 products (build calls it under --dtype nvfp4)."""
    hadamard_seed, last = cfg.seed, cfg.n_layer - nvfp4_bf16_last(cfg, train_cfg)
    for block in stage.blocks:
        for attr, name, split in BLOCK_LINEARS:
            layer = getattr(block, attr, None)
            if block.layer < last and layer is not None:
                rounding = NVFP4Rounding(f"h.{block.layer}.{name}", layer, stage, cfg.seed, split)
                layer.gemm = nvfp4_product(layer, rounding, hadamard_seed)


def nvfp4_product(layer, rounding, hadamard_seed):
    """The layer's product: mixed_precision.nvfp4_linear (called directly: TP = 1, or a row-parallel layer's local
    product), with `backward_gemms` for _TPLinear (TP, zero bubble) running the same backward arithmetic. The tensor
    scales are agreed over TP x CP: the CP ranks hold the other tokens of the same micro-batch."""
    group = layer.plan.tp_and_cp
    hadamard = mixed_precision.random_hadamard(mixed_precision.NVFP4_BLOCK, hadamard_seed, device=layer.weight.device)

    def product(x, weight, bias=None):
        return mixed_precision.nvfp4_linear(x, weight, bias, hadamard_seed=hadamard_seed, amax_group=group,
                                            uniforms=rounding.counted, hadamard=hadamard)

    product.backward_gemms = partial(nvfp4_backward_gemms, rounding, group, hadamard)
    return product


def nvfp4_backward_gemms(rounding, group, hadamard, g2, x2, weight, needs, prepared=None):
    """_TPLinear's NVFP4 backward: ((grad_x, grad_w), prepared). The first call (B) quantises W again (as the
    forward did) and agrees the tensor scales of W and of the gradient operands over TP x CP in one all-reduce, and
    fixes the micro-batch of the draws; a later call (W, under zero bubble) reuses them, communicating nothing."""
    operands = None  # the gradient operands, made once per call (B's agreement reads them too)
    if prepared is None:
        operands = mixed_precision.nvfp4_gradient_operands(g2, x2, hadamard)
        amax = mixed_precision.nvfp4_amaxes([weight, *operands], group)
        qw = mixed_precision.quantize_nvfp4(weight, (mixed_precision.NVFP4_BLOCK,) * 2, tensor_amax=amax[0])
        prepared = (qw, amax[1:], rounding.next_micro("backward"))
    qw, amaxes, micro = prepared
    options = mixed_precision.NVFP4Options(None, hadamard, True, group, partial(rounding.uniforms, micro=micro))
    grad_x, grad_w = mixed_precision.nvfp4_backward_gemms(g2, x2, qw, options, needs, amaxes, operands)
    return (grad_x, None if grad_w is None else grad_w.to(weight.dtype)), prepared


# ---- Interleaved and zero-bubble pipeline schedules: the action lists, the W split, the timeline -----------
# With v virtual stages per rank (interleaving), rank r holds the model chunks c = 0..v-1, chunk c being virtual
# stage c p + r of the p v (each L / (p v) layers): micro-batches pass rank 0, 1, ..., p-1, then rank 0 again with
# its next chunk. Under zero bubble each backward is split into B (the input gradients, which the previous stage
# waits for) and W (the weight gradients, which nobody waits for). Replayed with each action's duration (F 1 unit,
# B 2 or B 1 + W 1), the lists give the step time, the bubble and what is in flight, checked against the
# published formulas (`schedule_formulas`) and drawn by `timeline`.

def schedule_interleaved(p, m, v, r):
    """Megatron-LM's interleaved 1F1B: micro-batches advance through the chunks in groups of p; rank r runs
    (p - r - 1) 2 + (v - 1) p warm-up forwards (of chunks), then alternates, then drains. Needs m a multiple of p."""
    def place(k, forward):  # the k-th forward (or backward) of this rank: its micro-batch and chunk
        group, within = divmod(k, p * v)
        chunk = within // p
        return group * p + within % p, chunk if forward else v - 1 - chunk

    total, warmup = m * v, min((p - r - 1) * 2 + (v - 1) * p, m * v)
    steady = [action for k in range(total - warmup) for action in (Action("F", *place(warmup + k, True)),
                                                         Action("B", *place(k, False)))]
    return ([Action("F", *place(k, True)) for k in range(warmup)] + steady +
            [Action("B", *place(k, False)) for k in range(total - warmup, total)])


def schedule_zero_bubble(order, r):
    """ZB-H1 (Qi et al. 2023) from a 1F1B (or interleaved) order: each backward split into B, the input gradient
    the previous stage waits for, and W, the weight gradient nobody waits for. Rank r defers r of its W's through
    the steady state and runs one after each B of the drain, where 1F1B's rank r would idle: the bubble falls from
    (p - 1)(F + B + W) to (p - 1)(F + B - W), and rank r holds at most p - r micro-batches before B (1F1B's) plus
    r waiting for W (a part of their activations: the inputs of the linears)."""
    out, waiting = [], []
    steady_ends = max(i for i, action in enumerate(order) if action.kind == "F")
    for i, action in enumerate(order):
        out.append(action)
        if action.kind == "B":
            waiting.append(Action("W", action.micro, action.chunk))
            if len(waiting) > (r if i < steady_ends else 0):
                out.append(waiting.pop(0))
    return out + waiting


# ---- V-shaped pipelines: ZB-V and DualPipeV ----------------------------------------------------------------
# A V schedule gives each rank two chunks placed in a V: chunk 0 is stage r, chunk 1 stage 2p - 1 - r of the 2p
# (each L / 2p layers). A micro-batch goes down the ranks through their chunk 0 and back up through their chunk 1,
# so rank p - 1 hands its chunk 0's output to its own chunk 1 (no transfer) and the last stage sits on rank 0 beside
# the first: the loss is computed where the tokens were embedded, and the tied embedding is one parameter. Both
# schedules split backwards as zero bubble does: a B whose W its rank's list holds computes the input gradients
# only; a B whose list holds no W for it is a whole backward, weight gradients included (DualPipeV runs both). The
# lists are torch.distributed.pipelining's (ScheduleZBVZeroBubble, ScheduleDualPipeV: tests/test_vpipe.py compares
# them rank by rank), written as that order's phases.

class Overlapped(NamedTuple):
    """DualPipe's F&B (DeepSeek-AI 2024): the forward of one (micro-batch, chunk) and the whole backward of another,
    one action, so that the communication of each half proceeds while the other half computes."""
    forward: Action
    backward: Action
    kind = "F&B"  # a class attribute, not a field: what the executor and the replay dispatch on


V_SCHEDULES = ("zbv", "dualpipev")  # the --pp-schedule values whose chunks lie in a V


def v_stage(p, r, chunk):
    """The stage of rank r's chunk under the V placement: chunk 0 is stage r, chunk 1 stage 2p - 1 - r."""
    return 2 * p - 1 - r if chunk else r


def halves(action):
    """The actions an entry of a list runs: an F&B pair's two, or the action itself."""
    return tuple(action) if isinstance(action, Overlapped) else (action,)


class _Counter:
    """The next micro-batch of each (kind, chunk) in one rank's list, and the list itself: V schedules are written as
    phases of "the next forward of chunk 1", "the next backward of chunk 0", ..."""

    def __init__(self):
        self.order, self.counts = [], {}

    def next(self, kind, chunk):
        micro = self.counts.get((kind, chunk), 0)
        self.counts[(kind, chunk)] = micro + 1
        return Action(kind, micro, chunk)

    def add(self, kind, chunk):
        action = self.next(kind, chunk)
        self.order.append(action)
        return action


def schedule_zbv(p, m, r):
    """ZB-V (Qi et al. 2023, section 6), in the order of torch's ScheduleZBVZeroBubble: 2 (p - r) - 1 forwards of
    chunk 0, then r pairs of (chunk 1, chunk 0) forwards, then p - r rounds of chunk 1's F B W: rank p - 1 turns the
    first micro-batch around at the V's bottom and its backward climbs back while the forwards still descend. The
    steady state runs F B W on chunk 0 then on chunk 1; the drain runs r pairs of B's (their W's wait), p - r rounds
    of a chunk 0 B and the oldest waiting W, then the waiting W's. Each B's W follows it, or fills the drain. With
    fewer than 2p - 1 micro-batches the order is the one of 2p - 1 with the missing ones left out."""
    n, rank = max(m, 2 * p - 1), _Counter()
    waiting = ([], [])  # per chunk: B's whose W has not run, oldest first

    def backward(chunk, then_weight=True):
        waiting[chunk].append(rank.add("B", chunk))
        if then_weight:
            weight(chunk)

    def weight(chunk):
        rank.order.append(Action("W", waiting[chunk].pop(0).micro, chunk))

    for _ in range(2 * (p - r) - 1):
        rank.add("F", 0)
    for _ in range(r):
        rank.add("F", 1)
        rank.add("F", 0)
    for _ in range(p - r):
        rank.add("F", 1)
        backward(1)
    while rank.counts[("F", 1)] < rank.counts[("F", 0)] or rank.counts[("F", 0)] < n:
        if rank.counts[("F", 0)] < n:
            rank.add("F", 0)
        backward(0)
        rank.add("F", 1)
        backward(1)
    for _ in range(r):
        backward(0, then_weight=False)
        backward(1, then_weight=False)
    for _ in range(p - r):
        backward(0)
    for chunk in (1, 0):
        while waiting[chunk]:
            weight(chunk)
    return [action for action in rank.order if action.micro < m]


def schedule_dualpipev(p, m, r):
    """DualPipeV (DeepSeek-AI 2024's DualPipe cut in half), in the order of torch's ScheduleDualPipeV: the
    forwards of chunk 0 fill the V (2 (p - r - 1), then r + 1 pairs of chunk 0 and chunk 1 forwards), p - r - 1
    rounds of a chunk 1 B, the oldest waiting W and a chunk 1 F; then the two directions meet: F&B pairs (chunk 0's
    forward with chunk 1's whole backward, chunk 1's forward with chunk 0's whole backward; rank p - 1's first
    pair runs apart), then p - r - 1 rounds of a chunk 1 backward and a pair; the drain runs r + 1 pairs of
    backwards (from the middle one on, zero bubble's split ones: their W's fill what is left), then the W's.
    Needs m >= 2p."""
    rank, waiting = _Counter(), []  # waiting: the split B's whose W has not run, oldest first

    def backward(chunk, split):
        action = rank.add("B", chunk)
        if split:
            waiting.append(action)

    def weight():
        if waiting:
            action = waiting.pop(0)
            rank.order.append(Action("W", action.micro, action.chunk))

    def pair(forward_chunk, backward_chunk):
        rank.order.append(Overlapped(rank.next("F", forward_chunk), rank.next("B", backward_chunk)))

    for _ in range(2 * (p - r - 1)):
        rank.add("F", 0)
    for _ in range(r + 1):
        rank.add("F", 0)
        rank.add("F", 1)
    for _ in range(p - r - 1):
        backward(1, split=True)
        weight()
        rank.add("F", 1)
    for i in range(m - 2 * p + r + 1):
        if i == 0 and r == p - 1:  # the bottom of the V: its first backward is due at once, nothing to overlap
            rank.add("F", 0)
            backward(1, split=False)
        else:
            pair(0, 1)
        pair(1, 0)
    for _ in range(p - r - 1):
        backward(1, split=False)
        pair(1, 0)
    split = False
    for i in range(r + 1):  # from the middle pair on (odd ranks: from its chunk 1 B), the B's are split
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        backward(1, split)
        split = split or i == (r + 1) // 2
        backward(0, split)
    for _ in range(p - r - 1):
        weight()
        backward(0, split=True)
    for _ in range(r + 1):
        weight()
    return rank.order


class VOrders(list):
    """Every rank's list of a V schedule (orders[r]): a list that says its chunks lie in a V."""
    v_shape = True


def v_orders(schedule):
    """Every rank's list of a V schedule, `schedule(p, m, r)` (its v is 2)."""
    return lambda p, m, v: replayed(VOrders(schedule(p, m, r) for r in range(p)), 2)


def replayed(orders, v):
    """The ranks' lists, checked by the replay to finish when each action waits only for its own input."""
    replay_pipeline(orders, v=v)
    return orders


def interleaved_orders(p, m, v):
    return replayed([schedule_interleaved(p, m, v, r) if v > 1 else schedule_1f1b(p, m, r) for r in range(p)], v)


# the schedules beyond the chapter (1F1B's lists where v = 1): PipelineAtScale runs them, ZeroBubblePipeline zb-h1,
# VPipeline the V-shaped ones
SCHEDULES_AT_SCALE = {"interleaved": interleaved_orders,
                      "zb-h1": lambda p, m, v: replayed([schedule_zero_bubble(order, r)
                                                         for r, order in enumerate(interleaved_orders(p, m, v))], v),
                      "zbv": v_orders(schedule_zbv), "dualpipev": v_orders(schedule_dualpipev)}
ALL_SCHEDULES = {**SCHEDULES, **SCHEDULES_AT_SCALE}  # --pp-schedule


def pipeline_schedule(kind, p, m, v=1):
    """Every rank's list of actions of any schedule: orders[r]."""
    return ALL_SCHEDULES[kind](p, m, v)


@functools.lru_cache(maxsize=64)
def _orders_at_scale(kind, p, m, v):
    return forward_schedule(p, m, v) if kind == "forward" else pipeline_schedule(kind, p, m, v)


class PipelineAtScale(Pipeline):
    """The executor of the schedules beyond the chapter (--pp-schedule interleaved; ZeroBubblePipeline's zb-h1)."""

    def orders(self, kind, p, m, v):
        return _orders_at_scale(kind, p, m, v)




_deferred = None  # while a zero-bubble B runs: the list its linears leave their weight-gradient GEMMs in


class deferred_weight_grads:
    """`with deferred_weight_grads() as w: loss.backward()` computes only the input gradients of the linears (and
    every other gradient); `w.run()` later computes their weight gradients, each once (Qi et al. 2023's B and W).
    Each _TPLinearAtScale's weight-gradient GEMM so waits, with its operands, for the schedule's W, which runs it
    without any communication: the gathered input is kept from B, and FP8 backward scales are agreed in B."""

    def __enter__(self):
        global _deferred
        self.gemms, _deferred = [], []
        return self

    def __exit__(self, *exc):
        global _deferred
        self.gemms, _deferred = _deferred, None

    def run(self):
        for gemm in self.gemms:
            gemm()
        self.gemms = []


def _weight_grad(weight, g2, x2, gemm=None):
    """W of one linear: its weight gradient G^T x (16-bit, or `gemm`: the FP8 one), added where autograd and the
    optimizer's hook would have put it: .grad (an FP32 weight's is the FP32 main grad that mixed_precision.py
    keeps, a view of its flat buffer), or the main grad itself (16-bit weights, whose .grad the hook frees)."""
    with torch.no_grad():
        _add_weight_grad(weight, g2.t() @ x2 if gemm is None else gemm(g2, x2))


def _add_weight_grad(weight, grad):
    if weight.grad is not None:
        weight.grad += grad
    elif hasattr(weight, "main_grad"):
        weight.main_grad.add_(grad)
    else:
        weight.grad = grad


def run_weight_grads(stage, chunk, weight_grads):
    """The executor's W: the weight gradients a zero-bubble B left, then (ZeRO-2/3) their reduce-scatter."""
    weight_grads.run()
    reduce_chunk_grads(stage, chunk)


def reduce_chunk_grads(stage, chunk):
    """ZeRO-2/3 under a split backward: the chunk's blocks' gradients reduce-scattered once complete."""
    for block in stage.chunk_blocks(chunk):
        if getattr(block, "unit", None) is not None:
            block.unit.reduce_grads(async_op=True)


class ZeroBubblePipeline(PipelineAtScale):
    """The executor under zero bubble (--pp-schedule zb-h1): B computes the input gradients only, its linears'
    weight GEMMs left (`deferred_weight_grads`) for the schedule's W, which runs them (`run_weight_grads`)."""

    def start(self, orders, rank):
        super().start(orders, rank)
        self.waiting = {}  # (chunk, micro-batch): the weight GEMMs its B left for its W

    def run_action(self, stage, action, received, saved, *rest):
        key = (action.chunk, action.micro)
        if action.kind == "W":
            return run_weight_grads(stage, action.chunk, self.waiting.pop(key))
        if action.kind == "F" or not self.splits(action):
            return super().run_action(stage, action, received, saved, *rest)
        with deferred_weight_grads() as weight_grads:  # B: _TPLinearAtScale leaves its weight GEMM in it
            grad = super().run_action(stage, action, received, saved, *rest)
        self.waiting[key] = weight_grads
        return grad

    def splits(self, action):
        """Whether this B leaves its weight GEMMs for a W: every B under ZB-H1."""
        return True

    def in_flight(self, saved):  # and those waiting for W, which still needs the linears' inputs
        return len(saved) + len(self.waiting)


class Baton:
    """The two halves of an F&B pair, on two threads, one computing at a time (so that a rank issues its collectives
    in one order, the same on every rank of their groups): a half that has posted a transfer hands the turn to the
    other (`switch`), which computes until it posts one of its own or ends, and takes the turn back to wait for its
    data. `beside[kind]` sums the seconds posted transfers ("all-to-all": a MoE layer's; "p2p": a half's input from
    the neighbouring stage) travelled while the other half computed (`handovers[kind]` times), `exposed[kind]` those
    their half then still waited for."""

    def __init__(self):
        self.cond = threading.Condition()
        self.turn, self.running = None, [False, False]  # the half that may compute (None: no pair running)
        self.beside, self.exposed = {"all-to-all": 0.0, "p2p": 0.0}, {"all-to-all": 0.0, "p2p": 0.0}
        self.handovers = {"all-to-all": 0, "p2p": 0}

    def switch(self, work, kind="all-to-all"):
        """A half has posted `work` (a moe_ep.OverlappedMoE all-to-all, or the receive of its input): the other half
        computes meanwhile, if it is still running; then this one waits for the data."""
        t0 = time.perf_counter()
        with self.cond:
            me = self.turn
            if me is not None and self.running[1 - me]:
                self.turn = 1 - me
                self.handovers[kind] += 1
                self.cond.notify_all()
                self.cond.wait_for(lambda: self.turn == me)
        t1 = time.perf_counter()
        work.wait()
        self.beside[kind] += t1 - t0
        self.exposed[kind] += time.perf_counter() - t1

    def run(self, forward, backward, device):
        """The pair: `forward` on a thread of its own (on `device`), `backward` on this one; the forward starts."""
        errors = []

        def half(i, fn):
            if i == 0 and device.type == "cuda":  # a new thread starts on GPU 0
                torch.cuda.set_device(device)
            with self.cond:
                self.cond.wait_for(lambda: self.turn == i)
            try:
                fn()
            except BaseException as error:  # raised on this thread once the pair is over
                errors.append(error)
            finally:
                with self.cond:
                    self.running[i] = False
                    self.turn = 1 - i if self.running[1 - i] else None
                    self.cond.notify_all()
        self.running, self.turn = [True, True], 0
        thread = threading.Thread(target=half, args=(0, forward))
        thread.start()
        half(1, backward)
        thread.join()
        if errors:
            raise errors[0]


class HandedWait(NamedTuple):
    """A posted transfer whose wait hands the turn to the pair's other half first (a gloo receive is waited on once:
    Baton.switch waits for it)."""
    baton: Baton
    work: object
    kind: str

    def wait(self):
        self.baton.switch(self.work, self.kind)


class VPipeline(ZeroBubblePipeline):
    """The executor of the V schedules (--pp-schedule zbv, dualpipev): chunk 0 of rank r is stage r, chunk 1 stage
    2p - 1 - r (`v_placement` gives the plan those layers). Rank p - 1 hands chunk 0's output to its chunk 1, and
    chunk 1's input gradient back to chunk 0, in memory (`local`): no transfer. A B whose W its list holds computes
    the input gradients only (zero bubble's split); one without is whole. An F&B pair (`Overlapped`) runs its two
    halves overlapped (`overlap`): each on a thread of its own, taking turns where a MoE layer's all-to-all or a
    half's input travels (`baton`, the MoE layers' `wait`), so that one half's transfers travel while the other
    computes; with `overlap` False one after the other (`run_pair`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.flat = {}  # id(orders): (the orders, kept alive; every rank's actions, pairs' halves one by one)
        self.baton, self.overlap, self.chunk_exchanges = Baton(), True, {}

    def orders(self, kind, p, m, v):
        if kind == "forward":  # a validation loss: every micro-batch down the V, then back up
            return _v_forward_orders(p, m)
        return super().orders(kind, p, m, v)

    def stage_consumer(self, r, action):
        """(rank, the action that reads it) of what rank r's `action` sends on, on whatever rank, or None (the
        loss, the embedding, a W)."""
        p = self.plan.sizes["pp"]
        if action.kind not in ("F", "B"):
            return None
        to = v_stage(p, r, action.chunk) + (1 if action.kind == "F" else -1)  # the stage its output goes to
        if not 0 <= to < 2 * p:
            return None
        return (to, Action(action.kind, action.micro, 0)) if to < p else (2 * p - 1 - to, Action(action.kind,
                                                                                               action.micro, 1))

    def consumer(self, r, action):  # what goes to another rank: the transfers
        to = self.stage_consumer(r, action)
        return None if to is None or to[0] == r else to

    def start(self, orders, rank):
        """The core's tables over each rank's actions one by one (an F&B pair's two halves in their order); the
        handoffs that stay on this rank; which B's this rank splits."""
        key = id(orders)
        if key not in self.flat:
            self.flat[key] = orders, [[a for entry in order for a in halves(entry)] for order in orders]
        flat = self.flat[key][1]
        super().start(flat, rank)
        self.local, self.handoff = {}, {}  # reader: its input; producer: its reader on this rank
        for action in flat[rank]:
            to = self.stage_consumer(rank, action)
            if to is not None and to[0] == rank:
                self.handoff[action] = to[1]
        self.deferred = {(a.chunk, a.micro) for a in flat[rank] if a.kind == "W"}
        self.pair_peak = 0

    def splits(self, action):
        return (action.chunk, action.micro) in self.deferred

    def post_receive(self, entry):
        for action in halves(entry):
            super().post_receive(action)

    def run_action(self, stage, action, received, saved, *rest):
        if isinstance(action, Overlapped):
            return self.run_pair(stage, action, saved, *rest)
        if received is None and action in self.local:
            received = self.local.pop(action)
        out = super().run_action(stage, action, received, saved, *rest)
        if action.kind == "B" and not self.splits(action):  # a whole backward: ZeRO-2/3 reduce now, as W would
            reduce_chunk_grads(stage, action.chunk)
        if action in self.handoff:  # to this rank's other chunk, as a transfer would: a new leaf (F), a gradient (B)
            self.local[self.handoff[action]] = self.hand_over(out) if action.kind == "F" else out
            return None
        return out

    @staticmethod
    def hand_over(out):
        """Chunk 0's output as chunk 1's input on rank p - 1: a leaf of its own, as a received buffer is, and the
        output's storage freed as a sent one's is (its backward needs only the graph behind it)."""
        if out.grad_fn is None:  # forwards only (a validation loss)
            return out
        leaf = out.detach().clone().requires_grad_()
        out.untyped_storage().resize_(0)
        return leaf

    def run_pair(self, stage, pair, saved, *rest):
        """DualPipe's F&B: both halves' inputs posted, then the forward and the backward, overlapped or one after the
        other; each half's output sent as soon as it exists and those of the pair before it have been (a peer reads
        this rank's messages in the order of its list). The forward's activations are made while the backward's
        are held: one chunk more than before the pair."""
        self.post_receive(pair)
        self.pair_peak = max(self.pair_peak, super().in_flight(saved) + 1)
        outputs, sent = {}, []

        def run_half(action):
            received = None
            if action in self.source:  # posted with the pair: the other half computes while it travels
                buf, work = self.receives[action]
                self.receives[action] = buf, HandedWait(self.baton, work, "p2p")
                received = self.receive(action).requires_grad_(action.kind == "F" and torch.is_grad_enabled())
            outputs[action] = self.run_action(stage, action, received, saved, *rest)
            for half in pair[len(sent):]:
                if half not in outputs:
                    break
                if half in self.sink:
                    self.send(outputs[half], half, free=outputs[half].grad_fn is not None)
                sent.append(half)
        if self.overlap and any(self.exchanges(stage, action.chunk) for action in pair):
            self.baton.run(partial(run_half, pair.forward), partial(run_half, pair.backward), self.device)
        else:
            run_half(pair.forward)
            run_half(pair.backward)
        return None

    def exchanges(self, stage, chunk):
        """Whether the chunk's layers post all-to-alls a pair's other half can compute beside (else the halves run one
        after the other: a second thread would only cost its start)."""
        if chunk not in self.chunk_exchanges:
            self.chunk_exchanges[chunk] = any(isinstance(block.moe, moe_ep.OverlappedMoE) and block.moe.ep_size > 1
                                              for block in stage.chunk_blocks(chunk))
        return self.chunk_exchanges[chunk]

    def in_flight(self, saved):  # the most during the action just run: an F&B pair's forward beside its backward
        peak, self.pair_peak = max(self.pair_peak, super().in_flight(saved)), 0
        return peak


@functools.lru_cache(maxsize=64)
def _v_forward_orders(p, m):
    return VOrders([[Action("F", i, c) for c in (0, 1) for i in range(m)] for _ in range(p)])


def v_placement(plan):
    """A V schedule's plan: this rank's two chunks, stages r and 2p - 1 - r (L / 2p layers each); rank 0 is the first
    and the last stage (it embeds and it computes the loss, with one tied embedding: nothing to all-reduce)."""
    p, r = plan.sizes["pp"], plan.parallel_state.pp_rank
    per_chunk = plan.layers_per_stage // 2
    layers = tuple(i for s in (r, 2 * p - 1 - r) for i in range(s * per_chunk, (s + 1) * per_chunk))
    ends = replace(plan.parallel_state, is_first_stage=r == 0, is_last_stage=r == 0)
    return replace(plan, virtual_stages=2, layers=layers, parallel_state=ends, embedding=None,
                   logs_lm_loss=r == 0 and ends.tp_rank == 0)


def replay_pipeline(orders, forward=1, backward=2, weight=1, v=1, slots=False, v_shape=None):
    """The time the ranks' orders take when each action waits only for its input: F for the previous stage's F of its
    micro-batch, B for the next one's B (the last stage for its own F), W for its own B; F takes `forward` units, B
    `backward`, W `weight`, and where a schedule splits backwards a B it does not split (no W of its own) takes
    `backward + weight`; an F&B pair starts once both halves' inputs are in and hands both outputs on at its end.
    Communication is free. orders[r] are rank r's actions (Action, Overlapped, or (kind, micro) pairs for one chunk);
    chunk c of rank r is stage c p + r, or with `v_shape` (default: the orders' own, VOrders) stage `v_stage`. With
    slots, also every action's start: {(r, action): t}."""
    p = len(orders)
    v_shape = getattr(orders, "v_shape", False) if v_shape is None else v_shape
    stage_of = partial(v_stage, p) if v_shape else (lambda r, chunk: chunk * p + r)
    orders = [[a if isinstance(a, (Action, Overlapped)) else Action(*a) for a in order] for order in orders]
    whole = whole_backwards(orders)
    last, done, start = p * v - 1, {}, {}
    clock, pos = [0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                entry = orders[r][pos[r]]
                needs = []
                for action in halves(entry):
                    vs = stage_of(r, action.chunk)
                    need = {"F": ("F", vs - 1), "B": ("B", vs + 1) if vs < last else ("F", vs),
                            "W": ("B", vs)}[action.kind]
                    if need[1] >= 0:  # not the first stage's forward
                        needs.append((*need, action.micro))
                if any(need not in done for need in needs):
                    break
                start[(r, entry)] = max([clock[r]] + [done[need] for need in needs])
                clock[r] = start[(r, entry)] + sum(
                    {"F": forward, "B": backward, "W": weight}[a.kind] + weight * ((r, a) in whole)
                    for a in halves(entry))
                for action in halves(entry):
                    done[(action.kind, stage_of(r, action.chunk), action.micro)] = clock[r]
                pos[r], progress = pos[r] + 1, True
    if pos != [len(o) for o in orders]:
        raise ValueError("the ranks' orders wait on each other forever")
    return (max(clock), start) if slots else max(clock)


def whole_backwards(orders):
    """{(r, B action)} of the B's that a schedule splitting backwards does not split (no W of their own on their
    rank): DualPipeV's whole backwards. Empty for schedules with no W at all (their B is whole by definition)."""
    deferred = [{(a.chunk, a.micro) for a in order if a.kind == "W"} for order in orders]
    if not any(deferred):
        return set()
    return {(r, a) for r, order in enumerate(orders) for entry in order for a in halves(entry)
            if a.kind == "B" and (a.chunk, a.micro) not in deferred[r]}


def in_flight_peak(order, split):
    """The most (chunk, micro-batch) activations alive at once on a rank: from its F until its B (or, with a split
    backward, until its W, which still needs the linears' inputs; a B with no W of its own is whole and ends it).
    In an F&B pair the forward's activations are made while the backward's are still held: one more at its peak."""
    deferred = {(a.chunk, a.micro) for a in order if a.kind == "W"} if split else set()
    live = peak = 0
    for entry in order:
        for action in halves(entry):
            ends = (action.kind == "W" and split) or (action.kind == "B" and (action.chunk, action.micro) not in
                                                        deferred)
            live += (action.kind == "F") - ends
            peak = max(peak, live)
    return peak


def schedule_formulas(kind, p, m, v=1):
    """The published step time (in units of one chunk's forward, B = 2 F, or B = W = F when split) and in-flight
    peaks (chunks, per rank): 1F1B 3 (m + p - 1), p - r; interleaved 3 (v m + p - 1), i.e. a bubble of (p - 1)/(v m)
    of the ideal, (p - r - 1) 2 + (v - 1) p + 1; ZB-H1 3 v m + p - 1 for m >= p: the bubble (p - 1) units, one third
    of 1F1B's, and 1F1B's or the interleaved peak plus the r deferred W's. The V schedules (v = 2, `v_bubble`):
    ZB-V 6 m + p - 1 for m >= 2p - 1, 2p chunks on every rank (p micro-batches of a 1F1B stage's layers: 1F1B's
    first stage), min(2p, m + r + 1, 2m) below; DualPipeV 6 m + 2 (p - 1), 2p + 1 chunks (DualPipe's PP + 1: 2p
    before a pair, and its forward's beside its backward's)."""
    if kind == "1f1b":
        return 3 * (m + p - 1), [min(p - r, m) for r in range(p)]
    if kind in V_SCHEDULES:
        peaks = [min(2 * p, m + r + 1, 2 * m) for r in range(p)] if kind == "zbv" else [2 * p + 1] * p
        return 6 * m + v_bubble(kind, p, m), peaks
    peak = [min((p - r - 1) * 2 + (v - 1) * p + 1, m * v) if v > 1 else min(p - r, m) for r in range(p)]
    if kind == "interleaved":
        return 3 * (v * m + p - 1), peak
    return 3 * v * m + p - 1, [min(k + r, m * v) for r, k in enumerate(peak)]


def v_bubble(kind, p, m, forward=1, backward=1, weight=1):
    """Each rank's idle time in a V schedule's step, in units with F = B = W = 1 (a whole backward B + W = 2).
    ZB-V: p - 1 for m >= 2p - 1 (the first micro-batch's way down the V: rank p - 1 starts after p - 1 forwards and
    every slot after it is filled), 4 (p - 1) - 2 (m - 1) below. DualPipeV (m >= 2p): DualPipe's table's
    (PP/2 - 1)(F&B + B - 3W), PP its stages (2p here), F&B the pair (F + B + W: communication hidden, the compute
    both halves' own), B a whole backward (B + W): (p - 1)(F + 2 B - W) = 2 (p - 1)."""
    if kind == "zbv":
        return max(p - 1, 4 * (p - 1) - 2 * (m - 1))
    pair, whole = forward + backward + weight, backward + weight
    return (p - 1) * (pair + whole - 3 * weight)


def timeline(kind, p, m, v=1):
    """The schedule as text: one row per rank, one column per time unit (F 1, B 2 or B 1 + W 1), each cell the
    action and micro-batch (and chunk, with v > 1: F3.1 is micro-batch 3 on chunk 1); under it the step time and
    bubble beside the formulas, and each rank's in-flight peak."""
    split = kind in ("zb-h1",) + V_SCHEDULES
    orders = pipeline_schedule(kind, p, m, v)
    span, start = replay_pipeline(orders, backward=1 if split else 2, v=v, slots=True)
    whole = whole_backwards(orders)
    label = lambda a: f"{a.kind}{a.micro}" + (f".{a.chunk}" if v > 1 else "")  # noqa: E731
    width = len(f"F{m - 1}" + (f".{v - 1}" if v > 1 else "")) + 1 + any(isinstance(a, Overlapped) for a in orders[0])
    rows = []
    for r, order in enumerate(orders):
        cells = ["."] * span
        for entry in order:
            t = start[(r, entry)]
            for i, action in enumerate(halves(entry)):  # an F&B pair: its forward, then '&' and its backward
                for _ in range(2 if action.kind == "B" and (not split or (r, action) in whole) else 1):
                    cells[t], t = "&" * i + label(action), t + 1
        rows.append(f"rank {r}  " + "".join(c.ljust(width) for c in cells).rstrip())
    formula, peaks = schedule_formulas(kind, p, m, v)
    ideal = 3 * m * v
    holds = ", which holds for m >= p" if kind == "zb-h1" and m < p else ""  # fewer W's than idle slots to fill
    rows.append(f"{kind}, p={p} m={m} v={v}: {span} units (formula {formula}{holds}), bubble "
                f"{(span - ideal) / span:.3f} of the step, {(span - ideal) / ideal:.3f} of the ideal {ideal}")
    rows.append("in flight per rank (chunks): " + ", ".join(
        f"{in_flight_peak(o, split)} ({f})" for o, f in zip(orders, peaks)))
    rows.append("legend: a column is one time unit, a forward's time; Fi: the forward of micro-batch i (Fi.c: on "
                "model chunk c, with virtual stages), 1 unit;\n        Bi: its backward, 2 units (zb-h1: the input "
                "gradients only, 1 unit); Wi: its weight gradients (zb-h1), 1 unit; '.': the rank waits (the bubble)")
    if kind in V_SCHEDULES:
        rows += [f"V placement: chunk 0 of rank r is stage r, chunk 1 stage 2p - 1 - r = {2 * p - 1} - r; a B lasts "
                 "1 unit where its W comes later, 2 where it is whole (no W of its own)",
                 f"bubble per rank {span - ideal} units, formula {v_bubble(kind, p, m)}: " + (
                     "p - 1, the first micro-batch's way down the V (m >= 2p - 1)" if kind == "zbv" else
                     "(p - 1)(F&B + B - 3W) with F&B = 3 (the pair: F + B + W), B = 2 (whole), W = 1: DualPipe's "
                     "(PP/2 - 1)(F&B + B - 3W), PP = 2p stages") + "; in flight, formula " + (
                     "min(2p, m + r + 1, 2m)" if kind == "zbv" else "2p + 1 (DualPipe's PP + 1)") +
                 " chunks of L/2p layers",
                 ] + (["F&B: an overlapped pair, its forward's cell then '&' before the backward it runs beside"]
                      if kind == "dualpipev" else [])
    return "\n".join(rows)



# ---- ZeRO-2/3: each block a unit, gathered while it computes -----------------------------------------------

def zero_unit_forward(block, x, aux):
    """ZeRO-2/3 (`attach_zero_units` makes it the block's forward): the block's parameters gathered while it computes
    (the next block's all-gather prefetched), its gradients reduce-scattered when its backward is done (after W
    under zero bubble)."""
    return mixed_precision.sharded_call(block.unit, partial(Block.forward, block), (x, aux), block.next_unit,
                                        block.prev_unit, reduce_grads=not getattr(block.plan, "split_backward", False))


def attach_zero_units(stage, opt):
    """Each block a ZeRO-2/3 unit (`block.unit`, its forward then `zero_unit_forward`); its neighbours within its
    chunk (`block.next_unit`, `block.prev_unit`), for the prefetch."""
    n = len(stage.blocks) // stage.plan.virtual_stages
    for i, (block, unit) in enumerate(zip(stage.blocks, opt.units)):
        block.unit = unit
        block.next_unit = opt.units[i + 1] if (i + 1) % n else None
        block.prev_unit = opt.units[i - 1] if i % n else None
        block.forward = partial(zero_unit_forward, block)



# ---- Formulas: a block's kept activations and communication (the FLOPs per token: the core's) -------------

def block_activation_bytes(b, s, h, a, t, sequence_parallel, e, acc_e):
    """Bytes one dense block keeps for backward, term by term (b the micro-batch, s this rank's CP shard of
    the sequence, t TP, e bytes of the activations, acc_e of the LayerNorm statistics and the attention's
    row log-sum-exp, FP32 on CUDA). Without SP the LayerNorm inputs and outputs are whole on every TP rank; with
    SP every term is split by t. Against Korthikanti et al.'s 16-bit layer:

        no SP   s b h e (4 + 12/t) + the LN statistics + lse / t   his sbh (10 + 24/t + 5as/(ht))
        SP      s b h e (16/t)     + (LN statistics + lse) / t     his sbh (34/t + 5as/(ht))

    our 4 replicated terms are the two LayerNorm inputs and outputs, his 10 add dropout masks; his as/h terms are
    the s x s softmax that a fused attention kernel never stores. Measured equal in tests/test_train_gpt.py and
    benchmarks/report.py (CPU float32: acc_e = e)."""
    sbh = s * b * h
    sp = t if sequence_parallel else 1
    return {
        "LN1 input, LN1 output (QKV input), LN2 input, LN2 output (fc input)": 4 * sbh * e // sp,
        "LayerNorm mean and 1/std (2 LNs)": 4 * s * b * acc_e // sp,
        "q, k, v (views of the QKV output)": 3 * sbh * e // t,
        "attention output (kept by the fused kernel; the projection's input is a view of it)": sbh * e // t,
        "attention row log-sum-exp": a * s * b * acc_e // t,
        "GELU input (fc output)": 4 * sbh * e // t,
        "fc2 input (GELU output)": 4 * sbh * e // t,
    }


def block_forward_comm_bytes(b, s, h, t, sequence_parallel, moe, e, experts=0, stats_e=4):
    """Bytes one TP rank sends in one block's forward (ring algorithms): a dense block 4 (t-1)/t b s h e, with
    or without SP (2 all-reduces, or 2 all-gathers and 2 reduce-scatters); a MoE block the attention's half of that,
    plus without SP one all-gather of the MoE outputs, (t-1)/t b s h e (the experts run on the token shard, so the
    MLP's all-reduce is gone), plus the all-reduce of its router statistics over the ranks that share the
    micro-batch (TP x CP): 2 (t-1)/t (2 E + 2) stats_e (token counts, probability sums, z-loss sum and count)."""
    sbhe = s * b * h * e
    if not moe:
        return 4 * (t - 1) * sbhe // t
    return (2 if sequence_parallel else 3) * (t - 1) * sbhe // t + 2 * (t - 1) * (2 * experts + 2) * stats_e // t


# ---- Build beyond the chapter: the forms the flags ask for --------------------------------------------------

def build_at_scale(cfg, job_cfg, optimizer=True):
    """build() with the forms beyond the chapter that job_cfg asks for: hybrid CP's and hybrid sharding's groups
    and PlanAtScale, the FP8 backward and NVFP4 products, ZeRO-2/3 units (make_optimizer_at_scale), the interleaved
    and zero-bubble executors."""
    topology.init_distributed(job_cfg.timeout_s, say=_warn_on_rank_0)
    layout = dict(tp=job_cfg.tp, pp=job_cfg.pp, cp=job_cfg.cp, ep=job_cfg.ep, with_mesh=False,
                  timeout_s=job_cfg.timeout_s)
    if needs_hybrid_groups(job_cfg):
        parallel_state = topology.init_hybrid_parallel(**layout, cp_ulysses=job_cfg.cp_ulysses,
                                                       zero_shard=job_cfg.zero_shard_size)
    else:
        parallel_state = topology.init_parallel(**layout)
    plan = make_plan_at_scale(cfg, job_cfg, parallel_state)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    overlapped = job_cfg.pp_schedule == "dualpipev"  # its F&B pairs: the MoE all-to-alls beside the other half
    moe = {(False, False): moe_ep.MoE, (True, False): moe_ep.GroupedGEMMMoE, (False, True): moe_ep.OverlappedMoE,
           (True, True): moe_ep.OverlappedGroupedGEMMMoE}[(job_cfg.moe_grouped_gemm, overlapped)]
    stage = GPTStage(cfg, plan, job_cfg.param_dtype, fp8=job_cfg.fp8_recipe if job_cfg.dtype == "fp8" else None,
                     moe=moe).to(device)
    if job_cfg.dtype == "fp8" and (job_cfg.fp8_recipe in mixed_precision.FINE_GRAINED or job_cfg.fp8_backward == "fp8"):
        use_fine_grained_fp8(stage, FP8(job_cfg.fp8_recipe, job_cfg.fp8_backward))
    if job_cfg.dtype == "nvfp4":
        use_nvfp4(stage, cfg, job_cfg)
    opt = make_optimizer_at_scale(stage, job_cfg) if optimizer else None
    if opt is not None and job_cfg.zero >= 2:
        attach_zero_units(stage, opt)
    executor = {"1f1b": Pipeline, "zb-h1": ZeroBubblePipeline, "zbv": VPipeline,
                "dualpipev": VPipeline}.get(job_cfg.pp_schedule, PipelineAtScale)
    pipe = executor(plan, (job_cfg.micro_batch, plan.seq_hidden, cfg.n_embd), job_cfg.param_dtype, device,
                    schedule=job_cfg.pp_schedule)
    for block in stage.blocks if overlapped else ():
        if block.moe is not None:
            block.moe.wait = pipe.baton.switch
    return plan, stage, opt, pipe


def make_optimizer_at_scale(stage, job_cfg):
    """make_optimizer with the optimizer's checkpoint state (mixed_precision.CheckpointableOptimizer: the chapter's
    step, sums and copy back as written); or mixed_precision.ShardedOptimizer for ZeRO-2/3 (the blocks as its units),
    the FP8 parameter gather, and hybrid sharding (the dense weights' sums over the DP x CP shards, then across them;
    the experts' stay over expert DP)."""
    plan, options, shard_groups = stage.plan, {}, None
    sharded = job_cfg.zero >= 2 or job_cfg.fp8_param_gather or job_cfg.zero_shard_size is not None
    if sharded:
        units = [[p for p in block.parameters() if p.requires_grad] for block in stage.blocks]
        options = dict(fp8_param_gather=job_cfg.fp8_param_gather, units=units if job_cfg.zero >= 2 else None)
    if job_cfg.zero_shard_size is not None:
        shard_groups = [(r.params, plan.dp_cp_shard, plan.dp_cp_replicate)
                        if r.group is plan.dp_cp and not r.params[0].expert else (r.params, r.group)
                        for r in stage.reductions if r.data_parallel]
    optimizer_class = mixed_precision.ShardedOptimizer if sharded else mixed_precision.CheckpointableOptimizer
    return make_optimizer(stage, job_cfg, shard_groups, optimizer_class, **options)



# ####################################################################################################
# THE JOB: what a training program needs around the training itself. Data; checkpoints (atomic, verified,
# loading no code, resharded to any layout); one writer per folder; checks of every input before any process group
# exists; sampling; the command line and how a job ends.
# ####################################################################################################

import collections
import contextlib
import errno
import io
import itertools
import pickle
import re
import shutil
import signal
import socket
import stat
import sys
import warnings
import weakref
from dataclasses import asdict

from torch.utils._python_dispatch import TorchDispatchMode

import grad_accum

# ---- Around the step: the validation loss ----------------------------------------------------------------

@torch.no_grad()
def evaluate(stage, pipe, data, train_cfg, cfg):
    """Mean validation loss per token over `eval_batches` fixed batches: forwards only, every micro-batch of every
    batch through the pipeline (run_schedule's "forward" lists)."""
    plan, device = stage.plan, next(stage.parameters()).device
    micro = [mb for j in range(train_cfg.eval_batches)
             for mb in plan.micro_batches(data.batch("val", j, train_cfg.batch, cfg.seq_len, cfg.seed, device),
                                          train_cfg.micro_batch, device)]
    total = run_schedule(stage, pipe, "forward", micro, 0)[0] * plan.logs_lm_loss
    if plan.world is not None:
        dist.all_reduce(total)
    return total.item() / (train_cfg.eval_batches * train_cfg.batch * cfg.seq_len)


# ---- The job's loop: the core's step, with resume, validation, checks, the metrics file and checkpoints ----

def build_job(cfg, job_cfg, optimizer=True):
    """build_at_scale, after every input check that needs no process group (`validate`)."""
    validate(cfg, job_cfg, _world_size())
    return build_at_scale(cfg, job_cfg, optimizer)


def train_job(cfg, train_cfg, data=None):
    """The core's loop (`train`: the learning rate, the batch, `train_step`, `step_record`, `step_line`) with the job
    around it: resuming from out_dir's newest checkpoint that passes its checks (with train_cfg.resume), the lock,
    stall and divergence checks, validation, the first step's figures, the metrics file, checkpoints. Returns one
    record per step run, each printed in one line on rank 0 and appended to --metrics."""
    metrics = None
    try:
        data = data or check_inputs(cfg, train_cfg, _world_size())
        with stalls_in_one_line(train_cfg, lambda: "while starting (process groups, the checkpoint)"):
            plan, stage, opt, pipe = build_job(cfg, train_cfg)
            say_on_rank_0(train_cfg, plan.parallel_state.rank, what_runs(cfg, train_cfg, plan, stage, data))
            start = resume_step(train_cfg, stage, opt)  # 0, or with --resume the step out_dir's checkpoint holds
        parallel_state, device = plan.parallel_state, next(stage.parameters()).device
        predicted = predicted_memory(cfg, train_cfg, parallel_state.world_size, device)  # every rank's peak, predicted
        if predicted:
            say_on_rank_0(train_cfg, parallel_state.rank, memory_line(predicted))
        metrics = open_metrics(train_cfg.metrics, start) if train_cfg.metrics and parallel_state.rank == 0 else None
        records, skipped, step = [], 0, start
        with stalls_in_one_line(train_cfg, lambda: f"step {step}"):
            for step in range(start, train_cfg.steps):
                lr, tokens = begin_step(step, opt, data, cfg, train_cfg, device)
                t0 = time.perf_counter()
                stage.step = step  # what NVFP4's stochastic rounding draws from (beyond the chapter)
                measured = step == min(start + 1, train_cfg.steps - 1)  # memory: the second step (its states exist)
                with MemoryMeter(stage, opt, device, measured, train_cfg.memory_report, [tokens]) as meter:
                    loss, aux, grad_norm, stepped, schedule = train_step(stage, pipe, opt, tokens,
                                                                         train_cfg.micro_batch, train_cfg.grad_clip)
                # train_step ends with a host sync (the loss), so this is the whole step
                record = step_record(step, lr, loss, aux, grad_norm, stepped, time.perf_counter() - t0, stage, opt,
                                     cfg, train_cfg)
                skipped = check_progress(step, record, opt, train_cfg, skipped)
                if train_cfg.eval_every and ((step + 1) % train_cfg.eval_every == 0 or step == train_cfg.steps - 1):
                    record["val_loss"] = evaluate(stage, pipe, data, train_cfg, cfg)
                if step == start:  # this rank's memory, from the live tensors, and what makes the batch
                    record.update(first_step_figures(opt, schedule, plan, train_cfg))
                if measured and (predicted or meter.measured is not None):  # each rank's peak, predicted and measured
                    meter.step = step
                    record.update(memory_figures(meter, predicted, plan, train_cfg))
                    say_on_rank_0(train_cfg, parallel_state.rank, memory_step_line(record["memory"]))
                records.append(record)
                metrics = log_step(metrics, record, skipped, cfg, train_cfg, parallel_state.rank)
                save_due = train_cfg.save_every and (step + 1) % train_cfg.save_every == 0
                if train_cfg.out_dir and (save_due or step + 1 == train_cfg.steps):
                    path = save_checkpoint(train_cfg.out_dir, step + 1, stage, opt, cfg, train_cfg, text=data.text)
                    say_on_rank_0(train_cfg, parallel_state.rank, f"saved {path}")
        return records
    finally:
        if metrics:
            with contextlib.suppress(OSError):
                metrics.close()
        release_out_dir(train_cfg.out_dir)


def main_job(argv=None):
    """The whole program: train (`train_job`), sample, export or show the schedule, from the full command line; every
    input checked before any process group, and the job ends in one line and an exit code."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if torchrun:
        watch_launcher()
    with ends_in_one_line(rank, torchrun, starting=True):  # the flags and every input, before any process group
        cfg, train_cfg, flags = parse_job_args(argv)
        if flags.show_schedule:
            print(timeline(train_cfg.pp_schedule, train_cfg.pp, flags.micro_batches, train_cfg.virtual_stages))
            return
        other_job = job_without_training(train_cfg, flags, world)  # --sample or an export: its checkpoint checked
        if other_job is None:
            if train_cfg.init_from_hf:
                cfg = config_from_hf(train_cfg.init_from_hf, cfg, flags.shape_given)
            data = check_inputs(cfg, train_cfg, world)
    if os.environ.get("OMP_NUM_THREADS") is None and not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    with ends_in_one_line(rank, torchrun):
        if other_job is not None:
            print(other_job())
        else:
            records = train_job(cfg, train_cfg, data)
            if dist.get_rank() == 0 and records:
                print(f"loss {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f} in {len(records)} steps"
                      + (f"; metrics in {train_cfg.metrics}" if train_cfg.metrics else ""))
    dist.barrier()
    dist.destroy_process_group()



# ---- How a run stops and what it logs: one line for a stall, a divergence or a full disk -------------------

@contextlib.contextmanager
def stalls_in_one_line(train_cfg, when):
    """A collective that failed (of the start-up, a step, the evaluation or a save) becomes Stalled: one line naming
    the rank and `when()`, and the job ends at once instead of a traceback per rank."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, (Diverged, Stalled, CannotSave)) or not _is_communication_failure(e):
            raise
        raise Stalled(f"rank {_global_rank()}, {when()}: a collective waited past --timeout-s "
                      f"{train_cfg.timeout_s:g} or lost its peer: a rank stopped, hung or died "
                      f"({str(e).splitlines()[0]})") from e


def _is_communication_failure(error):
    """gloo raises RuntimeError("... Timed out waiting ...") at the timeout, or a closed connection when a peer died;
    NCCL's watchdog raises DistBackendError (or aborts the process itself)."""
    return isinstance(error, dist.DistError) or any(
        s in str(error) for s in ("Timed out", "Connection closed", "Connection reset", "Broken pipe", "gloo"))


class Diverged(RuntimeError):
    """Training went non-finite (or FP16's loss scale collapsed): the run stops at that step, and no checkpoint of
    non-finite weights is written."""


class Stalled(RuntimeError):
    """A collective failed: a peer stopped, hung or died, and the wait reached --timeout-s (or its socket closed)."""


class CannotSave(RuntimeError):
    """A checkpoint or a metrics line could not be written (a full disk, the --out-dir lock lost): the run stops
    without writing, and every checkpoint written before stays intact."""


MIN_LOSS_SCALE = 1.0  # FP16: a scale below this (Megatron-LM's default --min-loss-scale) stops the run ...
MAX_SKIPPED_STEPS = 20  # ... and so do this many overflowing steps in a row


def check_progress(step, record, opt, train_cfg, skipped):
    """Stop a diverging run with one line (the step, the value, the flag to look at); returns the count of FP16
    steps skipped in a row. A non-finite loss stops every dtype (the loss scale does not act on the forward); a
    non-finite gradient norm stops every dtype but FP16, whose loss scaler skips the step and backs off, unless it
    does so MAX_SKIPPED_STEPS times in a row or the scale falls below MIN_LOSS_SCALE: then no scale fits the
    gradients. Every rank holds the same all-reduced loss and norm, so all stop together."""
    hint = (f"lower --lr ({train_cfg.lr:g}), keep --grad-clip on ({train_cfg.grad_clip:g}), or try --dtype bfloat16 "
            "or float32")
    if not math.isfinite(record["loss"]):
        raise Diverged(f"step {step}: the loss is {record['loss']}: training diverged; {hint}")
    if opt.loss_scaler is None:
        if record["grad_norm"] is None:
            raise Diverged(f"step {step}: the gradient norm is not finite: training diverged; {hint}")
        return 0
    skipped = skipped + 1 if record.get("skipped") else 0
    scale = opt.loss_scaler.scale
    if skipped >= MAX_SKIPPED_STEPS or scale < MIN_LOSS_SCALE:
        raise Diverged(f"step {step}: FP16 skipped {skipped} steps in a row and its loss scale fell to {scale:g}: the "
                       f"gradients overflow at any scale; {hint}")
    return skipped


def write_metrics(metrics, record, path):
    """Append the step's record; a write that fails (a full disk) is said in one line and the run goes on without
    metrics (what was written stays): the training, not its log, is what a full disk must not lose."""
    try:
        metrics.write(json.dumps(record) + "\n")
        metrics.flush()
        return metrics
    except OSError as e:
        _warn(f"--metrics {path} could not be written at step {record['step']} ({e.strerror}): the run goes on "
              "without recording metrics")
        with contextlib.suppress(OSError):
            metrics.close()
        return None


def first_step_figures(opt, schedule, plan, train_cfg):
    """What the first step's record adds: this rank's memory, from the live tensors, and what makes the batch."""
    return dict(opt.memory_bytes(), in_flight_peak=schedule.peak, micro_batches=plan.micro_batch_count, dp=plan.dp,
                effective_batch=grad_accum.effective_batch_size(train_cfg.micro_batch, plan.dp, 1,
                                                                plan.micro_batch_count))


def log_step(metrics, record, skipped, cfg, train_cfg, rank):
    """A step's record appended to the metrics file (returns it, or None once it cannot be written) and its line."""
    if metrics:
        metrics = write_metrics(metrics, record, train_cfg.metrics)
    say_on_rank_0(train_cfg, rank, step_line(record, skipped, moe=cfg.moe_every > 0))
    return metrics


def say_on_rank_0(train_cfg, rank, line):
    if train_cfg.log and rank == 0:
        print(line, flush=True)


# ---- Memory: each rank's peak, measured, beside topology.py's prediction -----------------------------------
# CUDA counts it: torch.cuda.max_memory_allocated() after reset_peak_memory_stats() at the measured step's start.
# On CPU (and for the parts, --memory-report) `LiveTensorBytes` follows every storage a tensor of this rank holds,
# from its creation to its release: those alive when the step starts (the states) and those the step's ops create
# (a dispatch mode sees each op's outputs; a weak reference to the storage sees its release; storage resize_, which
# ZeRO-3's gathers and the pipeline's freed sends call, bypasses the dispatcher and is wrapped). Each storage is
# tagged when created with the part it belongs to and the instant (action, micro-batch, block) that made it; the
# peak keeps the parts alive at its instant. Left out, as the planner leaves them: a kernel's scratch, the
# communication backend's own copies (gloo's reduce-scatter and all-gather stage whole buffers on its threads,
# NCCL has its buffers), and the host copies of offloaded activations.

MEMORY_PARTS = ("weights", "main grads", "optimizer states", "activations", "LM head and loss", "backward",
                "receive buffers", "ZeRO gathered", "ZeRO grad buffers", "step temporaries", "other")
# functions whose new storages belong to a part of their own, whatever the instant (innermost caller first)
_MADE_BY = {"post_receive": "receive buffers", "reduce_unit_grads": "ZeRO grad buffers", "pack": None}


class LiveTensorBytes(TorchDispatchMode):
    """This rank's live tensor bytes through one step, their peak, its parts and its instant (see above).
    `with LiveTensorBytes(stage, opt, [tokens]) as live: train_step(...)`; then live.peak, live.peak_parts,
    live.instant. `extra`: the tensors besides the model's and the optimizer's that live at the step's start."""

    def __init__(self, stage, opt, extra=()):
        super().__init__()
        self.stage, self.opt, self.extra = stage, opt, extra
        self.live, self.refs = {}, {}  # id(storage) -> [bytes, part]; -> its weak reference
        self.parts = dict.fromkeys(MEMORY_PARTS, 0)
        self.total = self.peak = 0
        self.peak_parts, self.instant = dict(self.parts), "the step's start"
        self.action, self.micro, self.chunk, self.where = "start", None, 0, ""
        self.counts = {}  # (kind, chunk) -> forwards or backwards seen
        self.undo = []

    # -- the storages --
    def _add(self, storage, part):
        key = id(storage)
        if key in self.live or part is None:
            return
        self.live[key] = [storage.nbytes(), part]
        self.refs[key] = weakref.ref(storage, lambda _, k=key: self._drop(k))
        self._grew(self.live[key][0], part)

    def _grew(self, nbytes, part):
        self.parts[part] += nbytes
        self.total += nbytes
        if self.total > self.peak:
            self.peak, self.peak_parts, self.instant = self.total, dict(self.parts), self._instant()

    def _drop(self, key):
        nbytes, part = self.live.pop(key)
        self.refs.pop(key, None)
        self.parts[part] -= nbytes
        self.total -= nbytes

    def _resized(self, storage):
        entry = self.live.get(id(storage))
        if entry is not None and storage.nbytes() != entry[0]:
            change, entry[0] = storage.nbytes() - entry[0], storage.nbytes()
            self._grew(change, entry[1])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out,) if isinstance(out, torch.Tensor) else torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if id(storage) in self.live:
                    self._resized(storage)
                elif not func.is_view:  # a view of a storage never seen: the backend's own (gloo's staging)
                    self._add(storage, self._part_of_new())
        return out

    def _part_of_new(self):
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_name
            if name in _MADE_BY:
                return _MADE_BY[name]
            frame = frame.f_back
        return {"forward": "activations", "head": "LM head and loss", "backward": "backward",
                "head backward": "LM head and loss", "recompute": "backward", "W": "backward",
                "gradient sums": "step temporaries", "the optimizer step": "step temporaries"}.get(self.action, "other")

    def _instant(self):
        """The instant in topology.py's words: "backward of micro-batch 3, block 0, stage 0", "the loss of ..."."""
        chunk = f", chunk {self.chunk}" if self.stage.plan.virtual_stages > 1 else ""
        micro = "" if self.micro is None else f" of micro-batch {self.micro}{chunk}"
        action = {"head": "the loss", "head backward": "backward",
                  "recompute": "backward"}.get(self.action, self.action)
        where = "" if self.action == "head" else self.where
        return f"{action}{micro}{where}, stage {self.stage.plan.parallel_state.pp_rank}"

    # -- the states, and the hooks that say where the step is --
    def _states(self):
        """What lives when the step starts, by part: the weights (this rank's at rest: ZeRO-3's shards), main grads
        and optimizer states (the masters, the moments), ZeRO-3's gathered buffers (empty at rest), the model's
        buffers and the batch (`extra`). Found from these roots, not by a scan of every object: a run's host data
        (its token corpus) is no device memory."""
        opt, stage = self.opt, self.stage
        owned = getattr(opt, "owned_param", lambda p: (None, p))
        at_rest = [owned(p)[1] for p in opt.params]
        pieces = [q for group in opt.optimizer.param_groups for q in group["params"]]
        rest = {id(t.untyped_storage()) for t in at_rest}
        for part, tensors in (("weights", at_rest),
                              ("main grads", [q.grad for q in pieces if q.grad is not None]
                               + [p.main_grad for p in opt.params if hasattr(p, "main_grad")]),
                              ("optimizer states", pieces + [t for state in opt.optimizer.state.values()
                                                             for t in state.values() if torch.is_tensor(t)]),
                              ("ZeRO gathered", [p for p in opt.params if id(p.untyped_storage()) not in rest]),
                              ("other", list(stage.buffers()) + [p for p in stage.parameters()] + list(self.extra))):
            for t in tensors:
                self._add(t.untyped_storage(), part)

    def _set(self, action, micro=None, chunk=0, where=""):
        self.action, self.micro, self.chunk, self.where = action, micro, chunk, where

    def _count(self, kind, chunk):
        n = self.counts.get((kind, chunk), 0)
        self.counts[(kind, chunk)] = n + 1
        return n

    def _hooks(self):
        stage, last = self.stage, self.stage.plan.virtual_stages - 1

        def before_stage(module, args, kwargs):
            chunk = kwargs.get("chunk", 0)
            self._set("forward", self._count("F", chunk), chunk,
                      ", embedding" if stage.is_first_chunk(chunk) else "")

        def after_stage(module, args, kwargs, out):
            chunk, micro = kwargs.get("chunk", 0), self.micro
            if stage.is_last_chunk(chunk):
                self._set("head", micro, chunk, ", LM head and loss")
            top = f", block {stage.chunk_blocks(chunk)[-1].layer}"
            if out[0].requires_grad and not stage.is_last_chunk(chunk):
                out[0].register_hook(lambda g: self._set("backward", self._count("B", chunk), chunk, top))
            elif out[0].requires_grad:
                out[0].register_hook(lambda g: self._set("head backward", self.micro, chunk, ", LM head"))

        def before_head(module, args):
            if torch._C._current_graph_task_id() == -1:
                self._set("head", self.micro, self.chunk, ", LM head and loss")

        def loss_sum(logits, targets, chunk=last):
            loss = type(stage).loss_sum(stage, logits, targets)
            if loss.requires_grad:
                loss.register_hook(lambda g: self._set("head backward", self._count("B", chunk), chunk,
                                                       ", cross-entropy"))
            return loss

        def before_block(block, args):
            if torch._C._current_graph_task_id() != -1:  # a recomputation inside the backward
                self._set("recompute", self.micro, self.chunk, f", block {block.layer}")
                return
            self.where = f", block {block.layer}"
            if args[0].requires_grad and block is stage.chunk_blocks(self.chunk)[0]:
                chunk, first = self.chunk, stage.is_first_chunk(self.chunk)
                args[0].register_hook(lambda g: self._set("backward", self.micro, chunk,
                                                          ", embedding" if first else ", its input"))

        def after_block(block, args, out):
            top = block is stage.chunk_blocks(self.chunk)[-1]
            if torch._C._current_graph_task_id() == -1 and out[0].requires_grad and not top:
                out[0].register_hook(lambda g: self._set("backward", self.micro, self.chunk, f", block {block.layer}"))
            elif torch._C._current_graph_task_id() == -1 and out[0].requires_grad and stage.is_last_chunk(self.chunk):
                chunk = self.chunk
                out[0].register_hook(lambda g: self._set("backward", self.micro, chunk, f", block {block.layer}"))

        def wrap(obj, name, action):
            method = getattr(obj, name)

            def run(*a, **k):
                self._set(action)
                return method(*a, **k)
            setattr(obj, name, run)
            self.undo.append(lambda: delattr(obj, name))

        handles = [stage.register_forward_pre_hook(before_stage, with_kwargs=True),
                   stage.register_forward_hook(after_stage, with_kwargs=True)]
        for block in stage.blocks:
            handles += [block.register_forward_pre_hook(before_block), block.register_forward_hook(after_block)]
        if stage.last:
            handles.append(stage.ln_f.register_forward_pre_hook(before_head))
        self.undo += [h.remove for h in handles]
        stage.loss_sum = loss_sum
        self.undo.append(lambda: delattr(stage, "loss_sum"))
        wrap(self.opt, "all_reduce_grads", "gradient sums")
        wrap(self.opt, "step", "the optimizer step")
        resize = torch.UntypedStorage.resize_

        def resize_(storage, size):
            out = resize(storage, size)
            self._resized(storage)
            return out
        torch.UntypedStorage.resize_ = resize_
        self.undo.append(lambda: setattr(torch.UntypedStorage, "resize_", resize))

    def __enter__(self):
        self._states()
        self.peak, self.peak_parts = self.total, dict(self.parts)
        self._hooks()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        for undo in reversed(self.undo):
            undo()
        return out


def predicted_memory(cfg, train_cfg, world, device):
    """topology.py's prediction for this run (`topology.py memory` with the same flags): every rank's peak bytes,
    parts and instant; None where the planner does not model the run (it says why)."""
    flags = argparse.Namespace(
        world=world, device=device.type, imbalance=1.0, gpu_mem_gb=topology.DEFAULT_GPU_MEM_GB, layers=cfg.n_layer,
        heads=cfg.n_head, hidden=cfg.n_embd, seq=cfg.seq_len, vocab=cfg.vocab_size, moe_every=cfg.moe_every,
        experts=cfg.n_experts, top_k=cfg.top_k, **{f.name: getattr(train_cfg, f.name) for f in fields(train_cfg)
                                                   if f.name in MEMORY_FLAGS})
    try:
        return topology.every_rank_peak(*topology.train_gpt_run(flags))
    except ValueError as e:
        _warn_on_rank_0(f"memory: no prediction for this run ({e})")
        return None


MEMORY_FLAGS = ("tp", "pp", "cp", "ep", "sequence_parallel", "cp_impl", "cp_ulysses", "pp_schedule", "virtual_stages",
                "recompute", "dtype", "zero", "zero_shard_size", "batch", "micro_batch", "optimizer", "nvfp4_bf16_last")


def memory_line(predicted):
    """The start-up line: the fullest rank's predicted peak, where it falls, and against this GPU's memory."""
    fullest = max(predicted, key=lambda r: r["peak_bytes"])
    where = ""
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        where = f", {fullest['peak_bytes'] / total:.1%} of this GPU's {total / 2 ** 30:.1f} GiB"
    return (f"memory: predicted peak {fullest['peak_bytes'] / 2 ** 20:,.1f} MiB on rank {fullest['rank']} (the "
            f"fullest){where}, at {fullest['instant']}; measured at step 2")


class MemoryMeter:
    """This rank's peak during one step: CUDA's max_memory_allocated (reset at the step's start), and with
    `report` (always on CPU, where nothing else measures) the live tensors' `LiveTensorBytes`, which gives the
    parts and the instant. Off (`on` False) it does nothing."""

    def __init__(self, stage, opt, device, on, report, batch=()):
        self.stage, self.opt, self.device, self.on, self.report, self.batch = stage, opt, device, on, report, batch
        self.live = self.measured = None

    def __enter__(self):
        if self.on and self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if self.on and self.report:
            self.live = LiveTensorBytes(self.stage, self.opt, self.batch).__enter__()
        return self

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.__exit__(*exc)
        if self.on and self.device.type == "cuda":
            self.measured = torch.cuda.max_memory_allocated()
        elif self.live is not None:
            self.measured = self.live.peak
        return False


def memory_figures(meter, predicted, plan, train_cfg):
    """What the measured step's record adds, every rank's: "memory": [{rank, predicted_bytes, measured_bytes,
    instant (measured, where the live tensors were followed), predicted_instant}], and with --memory-report
    "memory_parts": {part: [[predicted, measured] per rank]} (the live tensors' parts)."""
    rank = plan.parallel_state.rank
    mine = {"measured_bytes": meter.measured, "instant": meter.live.instant if meter.live else None,
            "parts": dict(meter.live.peak_parts) if meter.live else None}
    every = [None] * plan.parallel_state.world_size
    if plan.world is not None:
        dist.all_gather_object(every, mine, group=plan.world)
    else:
        every = [mine]
    rows = [{"rank": r, "predicted_bytes": None if predicted is None else int(predicted[r]["peak_bytes"]),
             "measured_bytes": m["measured_bytes"], "instant": m["instant"],
             "predicted_instant": None if predicted is None else predicted[r]["instant"]} for r, m in enumerate(every)]
    out = {"memory": rows}
    if train_cfg.memory_report and rank == 0:
        say = [f"memory per rank and part, predicted / measured MiB (step {meter.step + 1}):"]
        parts = [p for p in MEMORY_PARTS
                 if any((m["parts"] or {}).get(p) or (predicted and predicted[r]["parts"].get(p))
                        for r, m in enumerate(every))]
        out["memory_parts"] = {p: [[None if predicted is None else int(predicted[r]["parts"].get(p, 0)),
                                    (m["parts"] or {}).get(p)] for r, m in enumerate(every)] for p in parts}
        for r, m in enumerate(every):
            say.append(f"rank {r}: " + ", ".join(
                f"{p} {(predicted[r]['parts'].get(p, 0) if predicted else 0) / 2 ** 20:.2f} / "
                f"{((m['parts'] or {}).get(p) or 0) / 2 ** 20:.2f}" for p in parts))
        say_on_rank_0(train_cfg, rank, "\n".join(say))
    return out


def memory_step_line(rows):
    """The measured step's memory, one line: per rank predicted / measured MiB and the instant of the peak."""
    return "memory (predicted / measured MiB, the peak's instant): " + "; ".join(
        f"rank {r['rank']} " + ("-" if r["predicted_bytes"] is None else f"{r['predicted_bytes'] / 2 ** 20:.2f}")
        + " / " + ("-" if r["measured_bytes"] is None else f"{r['measured_bytes'] / 2 ** 20:.2f}")
        + (f" at {r['instant']}" if r["instant"] else "") for r in rows)


# ---- Data: text files and folders, nanoGPT .bin files (the embedded corpus, the synthetic language: the core's) ----

def _kind(mode):
    return next((name for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
                                          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                                          (stat.S_ISSOCK, "a socket")) if test(mode)), "not a regular file")


def input_file(what, path, error=ValueError):
    """os.stat of `path` if it is a regular file this process may read, else `error`, one line naming `what` (the flag
    or the checkpoint) and the file: opening a FIFO would block forever, a folder or a device holds no data."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise error(f"{what}: {path} cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{what}: {path} is {_kind(st.st_mode)}, not a regular file")
    if not os.access(path, os.R_OK):
        raise error(f"{what}: {path} is not readable (its permissions)")
    return st


def _read_bytes(what, path):
    input_file(what, path)
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{what}: {path} cannot be read ({e.strerror})") from None


def _text_files(what, files):
    """The bytes of text files as one uint8 array: one file memory-mapped (nanoGPT's train.bin, read as bytes: a file
    larger than memory is paged in as batches touch it), several read into one array of their total size."""
    sizes = [input_file(what, f).st_size for f in files]  # each file checked before it is opened: a FIFO blocks
    if len(files) == 1:
        return np.memmap(files[0], dtype=np.uint8, mode="r") if sizes[0] else np.zeros(0, np.uint8)
    tokens, at = np.empty(sum(sizes), dtype=np.uint8), 0
    for path, size in zip(files, sizes):
        try:
            with open(path, "rb") as f:
                read = f.readinto(memoryview(tokens)[at:at + size])
        except OSError as e:
            raise ValueError(f"{what}: {path} cannot be read ({e.strerror})") from None
        if read != size:
            raise ValueError(f"{what}: {path} changed while it was read")
        at += size
    return tokens


def load_data(spec, seq_len, vocab):
    """`embedded` (CPython's pydoc topics, ~466 KB of English), `synthetic`, a text file (memory-mapped, one byte a
    token: it may be larger than memory), a folder of text files, or a folder (or the path of a train.bin in one)
    with nanoGPT's uint16 train.bin and val.bin. Raises ValueError naming --data for anything missing, empty or too
    short."""
    if spec in ("synthetic", "embedded"):
        return chapter_data(spec, seq_len, vocab)
    what = f"--data {spec}"
    if not os.path.exists(spec):
        raise ValueError(f"{what}: no such file or folder; pass a text file, a folder of text files, a "
                         "folder with train.bin and val.bin, or 'embedded'")
    folder = os.path.dirname(os.path.abspath(spec)) if spec.endswith(".bin") else spec
    if os.path.isdir(folder) and os.path.exists(os.path.join(folder, "train.bin")):
        streams = []
        for name in ("train.bin", "val.bin"):
            path = os.path.join(folder, name)
            if not os.path.exists(path):
                raise ValueError(f"{what}: {path} is missing (a nanoGPT folder holds train.bin and val.bin)")
            size = input_file(what, path).st_size
            if size % 2:
                raise ValueError(f"{what}: {path} holds {size} bytes, an odd number: not uint16 token ids")
            if size < 2 * (seq_len + 1):
                raise ValueError(f"{what}: {path} is shorter than --seq + 1 = {seq_len + 1} tokens")
            streams.append(np.memmap(path, dtype=np.uint16, mode="r"))
        vocab = 1 + max(int(s.max()) for s in streams)  # one pass over the ids: catches a too small --vocab
        return TokenData(spec, *streams, vocab=vocab)
    if os.path.isdir(spec):
        files = sorted(os.path.join(root, f) for root, _, names in os.walk(spec) for f in names
                       if not f.startswith("."))
    else:
        files = [spec]
        if spec.endswith(".bin") and _global_rank() == 0:
            _warn(f"--data {spec}: a .bin file without train.bin and val.bin beside it is read as bytes of text "
                  "(nanoGPT's token ids are a folder holding both)")
    return _split_text(what, _text_files(what, files), seq_len)


# ---- Outputs: never through a link, never onto a device or a FIFO ------------------------------------------

class OutputRefused(ValueError):
    """An output this program cannot write where it was asked to (a link, a device, a FIFO, /proc, a full disk): one
    line, exit code 2, and nothing left half-written."""


def check_output_name(flag, path):
    """A file this program replaces whole (a metrics file, an export) is absent or a regular file: a symbolic link
    would have its target written (or a file made where a dangling one points), and a device or a FIFO would be
    replaced by a regular file. Refused in one line."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return  # its folder is checked where it is made
    except OSError as e:
        raise OutputRefused(f"{flag} {path} cannot be looked at ({e.strerror}): pass another path") from None
    if stat.S_ISLNK(st.st_mode):
        raise OutputRefused(f"{flag} {path} is a symbolic link (to {os.readlink(path)}), which this program never "
                            "writes through: pass the path of a regular file")
    if not stat.S_ISREG(st.st_mode):
        raise OutputRefused(f"{flag} {path} is {_kind(st.st_mode)}, not a regular file: pass another path")


def create_exclusive(path):
    """A new file at `path`, open for writing (a file descriptor): whatever a crash or a user left under that name
    (a file, a link: unlink removes a link, never its target) is removed first, then the file is created with
    O_EXCL | O_NOFOLLOW, so that nothing is ever written through a link planted there, even in between."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(os.lstat(path).st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        os.unlink(path)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)


def open_metrics(path, start):
    """The metrics file, opened for appending; a resumed run keeps the lines of the steps its checkpoint holds and
    drops those past it (replaced at once: a crash now loses no line); a fresh run never appends to an earlier
    run's file: that one is moved aside to PATH.N, said in one line, as is a file with lines that cannot be read
    (`_metrics_before`): never a reason not to resume. Written through a temporary created exclusively."""
    kept, damaged = _metrics_before(path, start) if start and os.path.lexists(path) else ([], {})
    if os.path.lexists(path) and (damaged or not start and os.path.getsize(path)):
        aside = next(f"{path}.{n}" for n in itertools.count(1) if not os.path.lexists(f"{path}.{n}"))
        os.rename(path, aside)
        _warn(f"--metrics {path} held an earlier run's metrics: moved to {aside}" if not damaged else
              f"--metrics {path}: {sum(damaged.values())} of its lines cannot be read ({', '.join(damaged)}): set "
              f"aside with the whole file as {aside}; the run goes on with its {len(kept)} readable lines")
    with os.fdopen(create_exclusive(path + ".tmp"), "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW), "a")


METRICS_LINE_MAX_BYTES = 1 << 16  # a step's record is a few hundred bytes


def _metrics_before(path, step):
    """The metrics lines of the steps before `step`, and {why: count} of the lines that cannot be read (a byte that is
    not UTF-8, JSON nested deeper than a record, a line longer than METRICS_LINE_MAX_BYTES, not a step's record),
    read a bounded line at a time: a 3 GB line is skipped, never held. A last line without its newline is one a
    crash tore: dropped without a word."""
    kept, damaged = [], collections.Counter()
    with open(path, "rb") as f:
        while line := f.readline(METRICS_LINE_MAX_BYTES + 1):
            if len(line) > METRICS_LINE_MAX_BYTES:  # skip the rest of it, a block at a time
                while line and not line.endswith(b"\n"):
                    line = f.readline(1 << 20)
                damaged[f"longer than {METRICS_LINE_MAX_BYTES:,} bytes"] += 1
                continue
            if not line.endswith(b"\n") or not line.strip():
                continue  # torn by a crash, or empty
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError:
                damaged["a byte that is not UTF-8"] += 1
                continue
            if line.count(b"[") + line.count(b"{") > JSON_MAX_DEPTH and json_depth(line) > JSON_MAX_DEPTH:
                damaged[f"nested {json_depth(line):,} deep"] += 1
                continue
            try:
                record = json.loads(text)
                is_record = isinstance(record, dict) and type(record.get("step")) is int
            except ValueError:
                is_record = False
            if not is_record:
                damaged["not a step's record"] += 1
            elif record["step"] < step:
                kept.append(text)
    return kept, damaged


# ---- Checkpoints: torch.distributed.checkpoint, sharded as the run holds it, resharded to any layout on load ----
# Every tensor is saved as one entry of the WHOLE parameter, under its global name ("model/h.5.mlp.fc.weight",
# whatever stage holds layer 5; "optim/NAME/exp_avg" for its optimizer states), and each rank hands DCP the parts
# of it that it holds (`Boxes`: each rank's TP or EP slice is one box; a ZeRO flat range of it is at most 2 ndim - 1
# boxes, `flat_range_boxes`). DCP plans the rest itself, as it does for DTensors: it writes a part that several
# ranks hold (replicas over DP, CP, EDP, TP) once, and on load reads into each rank's parts whatever saved parts
# overlap them, in place, so a checkpoint saved at TP2 x PP2 with ZeRO-1 resumes at DP4 or PP1 x CP2. Saving
# gathers nothing and allocates nothing on the device (gathering each parameter's whole state would cost 12 bytes
# per parameter for Adam, all that ZeRO-1 saves); DCP's writer stages a host copy of this rank's own parts. The
# rest (step, model shape, learning-rate schedule, loss scale) is JSON. Written last, MANIFEST holds the size and
# CRC32 of every other file and its own CRC32. A checkpoint is written to step_NNNNNN.tmp and renamed when complete,
# so out_dir only ever holds complete ones. Loading verifies before it parses: MANIFEST's own CRC32 first, then each
# file's size and CRC32 before its bytes are parsed (JSON) or unpickled (DCP's metadata, whose unpickler resolves
# DCP's own classes only); then every value read is bounded before anything is built from it.
CHECKPOINT_FORMAT = "chunks+manifest"  # in train_state.json: DCP chunks of whole tensors, a MANIFEST of CRC32s
MANIFEST = "MANIFEST"
MANIFEST_HEADER = re.compile(rb"train_gpt\.py checkpoint manifest; CRC32 of the lines below: ([0-9a-f]{8})")
MANIFEST_LINE = re.compile(rb"(\.metadata|train_state\.json|__(\d{1,9})_\d{1,9}\.distcp) (\d{1,18}) ([0-9a-f]{8})")
MANIFEST_MAX_BYTES = 1 << 26  # 60 bytes a file: a million ranks
METADATA_MAX_BYTES = 1 << 31
JSON_MAX_DEPTH = 8  # train_state.json nests 5 deep
SHAPE_FLAGS = {"vocab_size": "--vocab", "seq_len": "--seq", "n_layer": "--layers", "n_head": "--heads",
               "n_embd": "--hidden", "moe_every": "--moe-every", "n_experts": "--experts", "top_k": "--top-k"}
SCHEDULE_FIELDS = ("lr", "min_lr", "warmup", "steps")  # saved, so that a resume with another schedule is told
OPTIMIZER_STATES = {"adamw": ("master", "step", "exp_avg", "exp_avg_sq"), "sgd": ("master", "momentum_buffer")}
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DATA_FILE = re.compile(r"__(\d+)_\d+\.distcp")  # the names DCP's FileSystemWriter gives the tensor files: rank
JSON_MAX_BYTES = 1 << 20
STEP_FOLDER = re.compile(r"step_[0-9]{1,12}")  # ASCII digits: str.isdigit() also takes '³', which int() refuses


class BadCheckpoint(ValueError):
    """A checkpoint that fails a check; the message is one line naming the file and what is wrong."""


class CannotVerify(BadCheckpoint):
    """This process ran out of memory while it verified a checkpoint: nothing is known to be wrong with it, so no
    fallback skips it; the run stops in one line."""

    def __init__(self, path, what):
        super().__init__(f"checkpoint {path}: this process ran out of memory reading {what} (ulimit -v, or the "
                         "machine's memory): the checkpoint is not known to be damaged; give the job more memory")


def checkpoint_dirs(out_dir):
    """Complete checkpoints in out_dir, oldest first (a .tmp folder is one being written, or abandoned)."""
    if not out_dir or not os.path.isdir(out_dir):
        return []
    names = [n for n in os.listdir(out_dir) if STEP_FOLDER.fullmatch(n) and any(
        os.path.lexists(os.path.join(out_dir, n, f)) for f in (MANIFEST, "train_state.json"))]
    return [os.path.join(out_dir, n) for n in sorted(names, key=lambda n: int(n[5:]))]


def _int(lo=None, hi=None):
    what = "an integer" + (f" between {lo} and {hi}" if hi is not None else f" >= {lo}" if lo is not None else "")
    return (lambda v: type(v) is int and (lo is None or v >= lo) and (hi is None or v <= hi)), what


def _real(lo=0.0, above=False, none=False):
    what = f"a finite number {'>' if above else '>='} {lo}" + (" or null" if none else "")
    ok = lambda v: (none and v is None) or (type(v) in (int, float) and math.isfinite(v) and (v > lo if above
                                                                                               else v >= lo))
    return ok, what


def _one_of(choices):
    return (lambda v: isinstance(v, str) and v in choices), f"one of {sorted(choices)}"


_OBJECT = (lambda v: isinstance(v, dict)), "an object"
TRAIN_STATE_FIELDS = {  # key: (check, what it must be); `format` and `step` are checked first, by name
    "format": ((lambda v: v == CHECKPOINT_FORMAT), repr(CHECKPOINT_FORMAT)), "step": _int(1),
    "config": _OBJECT, "world_size": _int(1, 1 << 20), "layout": _OBJECT, "optimizer": _one_of(OPTIMIZER_STATES),
    "data": ((lambda v: isinstance(v, str)), "a string"), "text": ((lambda v: isinstance(v, bool)), "true or false"),
    "schedule": _OBJECT, "optimizer_state": _OBJECT}
CONFIG_FIELDS = {  # bounds far past any model trained today, so that nothing read can overflow what is built from it
    **{k: _int(1, 1 << 24) for k in ("vocab_size", "seq_len", "n_embd")},
    **{k: _int(1, 1 << 16) for k in ("n_layer", "n_head", "n_experts", "top_k")},
    "moe_every": _int(0, 1 << 16), "seed": _int(0, 2 ** 31 - 1), "aux_loss_coeff": _real(), "z_loss_coeff": _real()}
LAYOUT_FIELDS = {**{k: _int(1, 1 << 20) for k in ("tp", "pp", "cp", "ep")}, "zero": _int(0, 3),
                 "dtype": _one_of(("float32", "bfloat16", "float16", "fp8", "nvfp4", "float64"))}
SCHEDULE_CHECKS = {"lr": _real(above=True), "min_lr": _real(none=True), "warmup": _int(0), "steps": _int(1)}
OPTIMIZER_STATE_FIELDS = {"param_groups": ((lambda v: isinstance(v, list) and len(v) <= 16 and
                                            all(isinstance(g, dict) for g in v)), "a list of objects"),
                          "loss_scaler": ((lambda v: v is None or isinstance(v, dict)), "an object or null")}


def _check_fields(obj, checks, where, prefix=""):
    """Every key of `checks` present and passing its check, and no other key (this program writes exactly these)."""
    for key, (ok, what) in checks.items():
        if key not in obj:
            raise BadCheckpoint(f"{where}: '{prefix}{key}' is missing: it was not written by this program")
        if not ok(obj[key]):
            shown = repr(obj[key])
            raise BadCheckpoint(f"{where}: '{prefix}{key}' is {shown[:60] + '...' * (len(shown) > 60)}; it must be "
                                f"{what}")
    for key in obj:
        if key not in checks:
            raise BadCheckpoint(f"{where}: unknown key '{prefix}{key}': it was not written by this program")


def _manifest_error(path, why):
    return BadCheckpoint(f"checkpoint {path}: {MANIFEST} {why}")


def read_manifest(path):
    """{file name: (size, CRC32)} of every file of the checkpoint but MANIFEST itself, from MANIFEST, whose first
    line holds the CRC32 of the lines below it: checked before any of them is read. Raises BadCheckpoint."""
    where = os.path.join(path, MANIFEST)
    if not os.path.lexists(where):
        raise BadCheckpoint(f"checkpoint {path} has no {MANIFEST}: it was written by an earlier train_gpt.py (resume "
                            "or sample it with that version) or is damaged; or pass another --out-dir")
    data = _verified_bytes(path, MANIFEST, None, MANIFEST_MAX_BYTES)
    header, _, body = data.partition(b"\n")
    sealed = MANIFEST_HEADER.fullmatch(header)
    if not sealed:
        raise _manifest_error(path, "does not begin as this program writes it")
    if int(sealed[1], 16) != zlib.crc32(body):
        raise _manifest_error(path, "does not match its own CRC32 (damaged after it was written)")
    files = {}
    for line in body.splitlines():
        entry = MANIFEST_LINE.fullmatch(line)
        if not entry or entry[1].decode() in files:
            raise _manifest_error(path, f"holds {line[:60]!r}, not a file this program writes with its size and CRC32")
        files[entry[1].decode()] = (int(entry[3]), int(entry[4], 16))
    for name in (".metadata", "train_state.json"):
        if name not in files:
            raise _manifest_error(path, f"does not list {name}")
    return files


def _verified_bytes(path, name, manifest, max_bytes):
    """The bytes of path/name, a regular file of at most max_bytes (a FIFO would block, a huge file exhaust memory)
    whose size and CRC32 are the manifest's (with `manifest`): nothing is parsed before it passes."""
    where = os.path.join(path, name)
    st = input_file(f"checkpoint {path}", where, BadCheckpoint)
    expected = manifest[name] if manifest is not None else (None, None)
    if expected[0] is not None and st.st_size != expected[0]:
        raise BadCheckpoint(f"checkpoint {path}: {name} holds {st.st_size} bytes, {expected[0]} were written "
                            "(truncated or damaged)")
    if st.st_size > max_bytes:
        raise BadCheckpoint(f"checkpoint {path}: {name} holds {st.st_size} bytes, far more than this program writes")
    try:
        with open(where, "rb") as f:
            data = f.read(st.st_size + 1)  # what it holds (one byte more shows growth): no bound reserved up front
    except OSError as e:
        raise BadCheckpoint(f"checkpoint {path}: {name} cannot be read ({e.strerror})") from None
    except MemoryError:
        raise CannotVerify(path, f"{name} ({st.st_size:,} bytes)") from None
    if expected[1] is not None and zlib.crc32(data) != expected[1]:
        raise BadCheckpoint(f"checkpoint {path}: {name} does not match its recorded CRC32 (damaged after it was "
                            "written)")
    return data


def json_depth(data):
    """How deep brackets nest in JSON text, outside its strings: one pass, before json.loads would recurse that deep."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in data:
        if in_string:
            escaped, in_string = (False, True) if escaped else (byte == 92, byte != 34)  # backslash, quote
        elif byte == 34:
            in_string = True
        elif byte in (91, 123):  # [ {
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (93, 125):
            depth -= 1
    return deepest


def _read_json(path, name, manifest):
    """A JSON object from path/name, its bytes verified (_verified_bytes) and its nesting bounded before parsing."""
    where = os.path.join(path, name)
    data = _verified_bytes(path, name, manifest, JSON_MAX_BYTES)
    if json_depth(data) > JSON_MAX_DEPTH:
        raise BadCheckpoint(f"{where}: nested {json_depth(data)} deep, where this program writes at most "
                            f"{JSON_MAX_DEPTH}")
    try:
        state = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise BadCheckpoint(f"{where}: not valid JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(state, dict):
        raise BadCheckpoint(f"{where}: not a JSON object")
    return state


def parameter_count(cfg):
    """The model's parameters in closed form (model_geometry's sum, with no model built): embeddings, final norm,
    per block 4h^2 + 8h for attention and norms, and 8h^2 + 5h for a dense MLP or 8Eh^2 + Eh for E experts."""
    h, experts = cfg.n_embd, cfg.n_experts
    moe_blocks = sum(cfg.is_moe(layer) for layer in range(cfg.n_layer)) if cfg.moe_every else 0
    return ((cfg.vocab_size + cfg.seq_len) * h + 2 * h + cfg.n_layer * (4 * h * h + 8 * h)
            + (cfg.n_layer - moe_blocks) * (8 * h * h + 5 * h) + moe_blocks * (8 * experts * h * h + experts * h))


def _check_plausible(state, manifest, where):
    """What train_state.json says against what the folder holds: the ranks that wrote tensor files are the saved
    world, and they hold at least 2 bytes per parameter of the model (every weight is saved, in 16 bits or more).
    A model too large for its files is refused here, before a model of that shape is built."""
    writers = {int(DATA_FILE.fullmatch(name)[1]) for name in manifest if DATA_FILE.fullmatch(name)}
    if writers != set(range(state["world_size"])):
        raise BadCheckpoint(f"{where}: 'world_size' is {state['world_size']}, but {len(writers)} ranks wrote its "
                            "tensor files")
    tensor_bytes = sum(size for name, (size, _) in manifest.items() if DATA_FILE.fullmatch(name))
    params = parameter_count(GPTConfig(**state["config"]))
    if 2 * params > tensor_bytes:
        raise BadCheckpoint(f"{where}: 'config' describes a model of {params:,} parameters, more than its "
                            f"{tensor_bytes:,} bytes of tensor files can hold")


def read_train_state(path, cfg=None, manifest=None):
    """The JSON part of a checkpoint, verified against MANIFEST and checked field by field (the keys it must have,
    types, ranges, the model a possible one, as large as its files) before anything uses it; with `cfg`, refuses a
    checkpoint of another model shape. Raises BadCheckpoint, one line naming the file."""
    where = os.path.join(path, "train_state.json")
    manifest = manifest or read_manifest(path)
    state = _read_json(path, "train_state.json", manifest)
    _check_fields(state, TRAIN_STATE_FIELDS, where)
    folder_step = os.path.basename(os.path.normpath(path))[5:]
    if not STEP_FOLDER.fullmatch(os.path.basename(os.path.normpath(path))) or int(folder_step) != state["step"]:
        raise BadCheckpoint(f"{where}: 'step' is {state['step']}, but the folder is {os.path.basename(path)}")
    for key, checks in (("config", CONFIG_FIELDS), ("layout", LAYOUT_FIELDS), ("schedule", SCHEDULE_CHECKS),
                        ("optimizer_state", OPTIMIZER_STATE_FIELDS)):
        _check_fields(state[key], checks, where, prefix=key + ".")
    try:
        validate(GPTConfig(**state["config"]), JobConfig(), 1)
        scaler = state["optimizer_state"]["loss_scaler"]
        if scaler is not None:
            mixed_precision.DynamicLossScaler().load_state_dict(scaler)  # its own checks, on a throwaway
    except KeyError as e:  # only the loss scaler's state is read by key here
        raise BadCheckpoint(f"{where}: 'optimizer_state.loss_scaler' has no {e}: it was not written by this program "
                            "(or was edited)") from None
    except (ValueError, TypeError) as e:
        raise BadCheckpoint(f"{where}: {str(e).splitlines()[0]}") from None
    _check_plausible(state, manifest, where)
    saved = GPTConfig(**state["config"])
    for field, flag in SHAPE_FLAGS.items() if cfg is not None else ():
        if field in ("n_experts", "top_k") and not (saved.moe_every or cfg.moe_every):
            continue  # a dense model has no experts, whatever --experts says
        if getattr(saved, field) != getattr(cfg, field):
            raise ValueError(f"checkpoint {path} holds a model with {flag} {getattr(saved, field)}, this run has "
                             f"{flag} {getattr(cfg, field)}: pass the checkpoint's {flag}, or another --out-dir")
    return state


def _global_name(stage, name):
    """A stage's parameter name -> the model's: blocks.j of stage i is layer i * L/p + j."""
    if name.startswith("blocks."):
        j, rest = name[len("blocks."):].split(".", 1)
        return f"h.{stage.blocks[int(j)].layer}.{rest}"
    return name


def _slice_geometry(p, parallel_state):
    """Where this rank's p lies in the whole parameter: (its shape, its offsets, the whole's shape), in the
    coordinates where it is one box (QKV, split over TP block by block, is viewed as (3, h, ...))."""
    shape, dim, rank, parts = list(p.shape), None, 0, 1
    if p.tp_dim is not None:
        dim, rank, parts = p.tp_dim, parallel_state.tp_rank, parallel_state.sizes["tp"]
        if p.tp_parts > 1:
            shape, dim = [p.tp_parts, shape[0] // p.tp_parts, *shape[1:]], dim + 1
    elif p.expert:  # split over EP along dim 0
        dim, rank, parts = 0, parallel_state.ep_rank, parallel_state.sizes["ep"]
    offsets, whole = [0] * len(shape), list(shape)
    if dim is not None:
        offsets[dim], whole[dim] = rank * shape[dim], parts * shape[dim]
    return shape, offsets, whole


def flat_range_boxes(shape, a, b):
    """The elements [a, b) of a C-contiguous tensor of `shape` as boxes (offsets, sizes), each one run of memory:
    the end of a partial first row, the whole rows, the start of a partial last row (recursively inside rows),
    at most 2 ndim - 1 boxes. A ZeRO-1 piece is a flat range of its parameter: it is saved as these boxes."""
    if a >= b:
        return []
    if len(shape) == 1:
        return [((a,), (b - a,))]
    row = math.prod(shape[1:])

    def in_row(r, lo, hi):
        return [((r, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], lo - r * row, hi - r * row)]

    i, j = -(-a // row), b // row  # the whole rows are [i, j)
    if i > j:  # [a, b) lies inside row j
        return in_row(j, a, b)
    boxes = in_row(i - 1, a, i * row) if a < i * row else []
    if j > i:
        boxes.append(((i,) + (0,) * (len(shape) - 1), (j - i, *shape[1:])))
    return boxes + (in_row(j, j * row, b) if b > j * row else [])


class Boxes(torch.Tensor):
    """Parts of one whole tensor (`shape`, in box coordinates) as this rank holds them, each part a view of a live
    tensor at its offsets in the whole. It implements DCP's checkpointable protocol (as DTensor does:
    __create_write_items__, __create_chunk_list__, __get_tensor_shard__), so DCP itself writes a part that several
    ranks hold once, and on load reads into each of our parts whatever saved parts overlap it, straight into the
    live tensor, whatever layout saved them. It is a description, not data: no operation runs on it."""

    @staticmethod
    def __new__(cls, shape, parts, dtype, device):
        boxes = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device=device)
        boxes.parts = [(torch.Size(offsets), t) for offsets, t in parts]
        return boxes

    def __create_write_items__(self, fqn, obj):
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        properties = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.shape))
                for (offsets, _), chunk in zip(self.parts, self.__create_chunk_list__())]

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        return [ChunkStorageMetadata(offsets, t.shape) for offsets, t in self.parts]

    def __get_tensor_shard__(self, index):
        return next(t for offsets, t in self.parts if offsets == index.offset)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"Boxes describe where tensors lie for DCP; {func} does not apply to them")


def _parts(t, a, b, shape, offsets):
    """[(offsets in the whole, view of t)]: t holds the elements [a, b) of this rank's slice (of `shape`, at
    `offsets` in the whole parameter), one part per box of that flat range (flat_range_boxes)."""
    flat, strides = t.reshape(-1), [math.prod(shape[k + 1:]) for k in range(len(shape))]
    return [(tuple(o + off for o, off in zip(box, offsets)),
             flat[sum(o * s for o, s in zip(box, strides)) - a:][:math.prod(sizes)].view(sizes))
            for box, sizes in flat_range_boxes(shape, a, b)]


def _saved_params(stage):
    """(global name, parameter, whether it is the last stage's tied copy of the embedding). The copy is named
    "wte.weight" too: its weights are identical to the first stage's, bit for bit (DCP writes them once), and so
    is its optimizer state, which only the first stage writes."""
    return [(_global_name(stage, n.replace("lm_head.", "wte.")), p, n.startswith("lm_head."))
            for n, p in stage.named_parameters()]


def checkpoint_tensors(stage, opt=None, like=None):
    """{key: Boxes, or a 0-dim tensor} that this rank saves, or loads into, every part a view of a live tensor:
    nothing gathered or copied (the ZeRO shards are handed to DCP where they lie). "model/NAME" is the whole
    parameter NAME, "optim/NAME/STATE" its master weight or an optimizer state (0-dim ones, Adam's step, as tensors).
    Loading passes `like`, {NAME: {STATE: (ndim, dtype)}} of the checkpoint: it creates the optimizer states not
    made yet (before the first step), and reads a weight kept in the master dtype from the saved master (a weight
    in the master dtype is its own master: the saved master is exact where saved weights may be rounded, as a run
    saved in bfloat16 and resumed in float32 has them)."""
    parallel_state, out = stage.plan.parallel_state, {}
    for name, p, tied_copy in _saved_params(stage):
        shape, offsets, whole = _slice_geometry(p, parallel_state)
        (a, b), values = opt.owned_param(p) if opt is not None else ((0, p.numel()), p.detach())
        boxes = lambda t: Boxes(whole, _parts(t, a, b, shape, offsets), t.dtype, t.device)
        own_master = like is not None and opt is not None and p.dtype == opt.master_dtype and \
            "master" in like.get(name, {})
        out[f"optim/{name}/master" if own_master else f"model/{name}"] = boxes(values)
        if opt is None or (tied_copy and like is None):  # the copy's state is saved by the first stage
            continue
        (a, b), owned = opt.owned_state(p, (like or {}).get(name))
        for key, t in owned.items():
            if not (own_master and key == "master"):
                out[f"optim/{name}/{key}"] = t if t.dim() == 0 else boxes(t)
    return out


def save_checkpoint(out_dir, step, stage, opt, cfg, train_cfg, text=False):
    """Writes out_dir/step_NNNNNN atomically (the comment above); `text`: the data were bytes of text, which
    tells --sample to decode what it draws. With --async-save the tensors are copied to host memory now and written
    by a background thread (`AsyncSave`) while training goes on. Returns what to say: the checkpoint's path."""
    plan = stage.plan
    ASYNC_SAVE.wait()  # a save in flight ends before the next begins (its failure stops the run here)
    if not weights_are_finite(stage, opt):  # agreed over the world: no rank writes, none waits
        raise Diverged(f"after step {step} the weights hold non-finite values: no checkpoint is written (lower --lr, "
                       "or keep --grad-clip on)")
    device = next(stage.parameters()).device
    if not _on_every_rank(plan.parallel_state.rank != 0 or still_holds_out_dir(out_dir), device):
        raise CannotSave(f"before saving step {step}: {os.path.join(out_dir, '.lock')} is no longer the file this run "
                         f"locked (deleted or replaced), so another run may be writing into --out-dir {out_dir}: "
                         "stopping without writing")
    state = checkpoint_tensors(stage, opt)
    state[f"rng/{plan.parallel_state.rank}"] = torch.get_rng_state()  # restored when the world size is the same
    final = os.path.join(out_dir, f"step_{step:06d}")
    tmp = final + ".tmp"
    try:
        made = plan.parallel_state.rank != 0 or _make_empty_folder(tmp)
    except OSError as e:
        made = e
    if not _on_every_rank(made is True, device):
        raise CannotSave(_save_error(tmp, made))
    train_state = {"format": CHECKPOINT_FORMAT, "step": step, "config": asdict(cfg),
                   "world_size": plan.parallel_state.world_size,
                   "layout": {k: getattr(train_cfg, k) for k in ("tp", "pp", "cp", "ep", "zero", "dtype")},
                   "optimizer": train_cfg.optimizer, "data": train_cfg.data, "text": text,
                   "schedule": _schedule(train_cfg), "optimizer_state": opt.scalar_state()}
    if train_cfg.async_save:
        ASYNC_SAVE.start(state, tmp, final, train_state, train_cfg, device)
        return f"{final} to host memory; writing it in the background"
    write_checkpoint(state, tmp, final, train_state, train_cfg, device)
    return final


def write_checkpoint(state, tmp, final, train_state, train_cfg, device, group=None):
    """Every rank: DCP writes its parts into tmp, each rank checksums the files it wrote, rank 0 seals (train_state,
    MANIFEST, the rename) and, with --keep-last, deletes old ones. `group`: the collectives' process group (the
    background save's own)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    rank = dist.get_rank()
    try:  # a box saved by several ranks is written once
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), process_group=group)
    except CheckpointException as e:  # a BaseException, raised on every rank alike (DCP gathers the failures)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # what was written of it: the space it took is freed
        raise CannotSave(_save_error(tmp, next(iter(e.failures.values()), (e,))[0])) from None
    dist.barrier(group=group)  # every rank's files are written (and rank 0's metadata)
    # each rank checksums the files it wrote (DCP names them __RANK_N.distcp; rank 0 also writes .metadata)
    mine = checksums(tmp, [n for n in os.listdir(tmp)
                           if n.startswith(f"__{rank}_") or (rank == 0 and n == ".metadata")])
    every = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, every, dst=0, group=group)
    written = True
    if rank == 0:
        try:
            _seal_checkpoint(tmp, final, every, train_state)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            written = e
    if not _on_every_rank(written is True, device, group):
        raise CannotSave(_save_error(tmp, written))
    if rank == 0:
        mark_passing(final)
        if train_cfg.keep_last:
            drop_old_checkpoints(os.path.dirname(final), train_cfg.keep_last)


class AsyncSave:
    """--async-save (Megatron-LM's --async-save, torchtitan's async_with_pinned_mem): `start` copies this rank's parts
    into host buffers (pinned on CUDA, allocated at the first save and reused) and hands them to a background thread
    that runs write_checkpoint on a gloo group of its own, so the step waits only for the copy. Every guarantee of
    the synchronous save holds (tmp, MANIFEST last, the rename, one writer: the lock is released only after `wait`).
    `wait` ends the save in flight: before the next one, and at the run's end (release_out_dir); its failure is
    CannotSave there. A rank killed mid-write leaves step_N.tmp, which the next start removes, saying so."""

    def __init__(self):
        self.thread, self.error, self.group, self.buffers, self.done = None, None, None, {}, None

    def stage(self, state, device):
        """{key: a host copy of state[key]}, Boxes kept Boxes (over the copies)."""
        def copy(key, t):
            buf = self.buffers.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = self.buffers[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=device.type == "cuda")
            return buf.copy_(t.detach(), non_blocking=True)
        staged = {key: Boxes(v.shape, [(o, copy((key, i), t)) for i, (o, t) in enumerate(v.parts)], v.dtype, "cpu")
                  if isinstance(v, Boxes) else copy(key, v) for key, v in state.items()}
        if device.type == "cuda":
            torch.cuda.synchronize()  # the copies are complete before the step changes the weights
        return staged

    def start(self, state, tmp, final, train_state, train_cfg, device):
        import threading
        from datetime import timedelta
        if self.group is None:  # every rank saves at the same step: made in the same order everywhere
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=train_cfg.timeout_s))
        staged, t0 = self.stage(state, device), time.perf_counter()

        def write():
            try:
                write_checkpoint(staged, tmp, final, train_state, train_cfg, torch.device("cpu"), self.group)
                if train_cfg.log and dist.get_rank() == 0:
                    print(f"wrote {final} in the background ({time.perf_counter() - t0:.1f} s)", flush=True)
            except BaseException as e:  # said by wait(), in the main thread
                self.error = e
        self.error, self.done = None, final
        self.thread = threading.Thread(target=write, name=f"async_save {os.path.basename(final)}", daemon=True)
        self.thread.start()

    def wait(self, quiet=False):
        """Block until the save in flight (if any) is written; raise its failure as CannotSave unless `quiet` (a run
        already stopping for another reason: then said in one line)."""
        if self.thread is None:
            return
        self.thread.join()
        self.thread, error = None, self.error
        if error is None:
            return
        if not isinstance(error, CannotSave):
            why = str(error).splitlines()[0] if str(error) else type(error).__name__
            error = CannotSave(f"the background save of {self.done} failed ({why}): stopping; the checkpoints "
                               "written before are intact")
        if quiet:
            _warn(str(error))
        else:
            raise error


ASYNC_SAVE = AsyncSave()


# --keep-last deletes only what this process knows to be a checkpoint that passes every check: one it wrote (verified
# as written), loaded, or verified itself (once, remembered for as long as its MANIFEST is the same file)
_PASSING = {}  # realpath of a checkpoint -> its MANIFEST's (inode, mtime, size) when it passed
_FAILING = {}  # realpath of a checkpoint -> (its MANIFEST's signature, why it fails)
_FALLBACK_SOURCES = set()  # realpath of a checkpoint that --resume fell back to (a newer one failed): never deleted
_SAID = set()  # what --keep-last has said once


def _manifest_signature(path):
    st = os.stat(os.path.join(path, MANIFEST), follow_symlinks=False)
    return st.st_ino, st.st_mtime_ns, st.st_size


def mark_passing(path):
    with contextlib.suppress(OSError):
        _PASSING[os.path.realpath(path)] = _manifest_signature(path)


def passes_checks(path):
    """None if the checkpoint passes every check, its tensor files' CRC32s included, on this process alone (rank 0
    deletes alone: no collective); else why not, in one line. Either is remembered while MANIFEST stays the same
    file: a damaged checkpoint is read once, not at every save."""
    key = os.path.realpath(path)
    try:
        signature = _manifest_signature(path)
    except OSError:
        signature = None
    if signature is not None and _PASSING.get(key) == signature:
        return None
    if signature is not None and _FAILING.get(key, (None,))[0] == signature:
        return _FAILING[key][1]
    try:
        _, _, files = check_checkpoint(path)
        why = next((f"checkpoint {path}: {name} does not match its recorded CRC32" for name in sorted(files)
                    if DATA_FILE.fullmatch(name) and file_crc32(os.path.join(path, name)) != files[name][1]), None)
    except (BadCheckpoint, OSError) as e:
        why = str(e) if isinstance(e, BadCheckpoint) else f"checkpoint {path} cannot be read ({e.strerror})"
    if why is None:
        mark_passing(path)
    elif signature is not None:
        _FAILING[key] = (signature, why)
    return why


def _say_once(key, message):
    if key not in _SAID:
        _SAID.add(key)
        _warn(message)


def drop_old_checkpoints(out_dir, keep):
    """--keep-last: delete all but the newest `keep` checkpoints that pass their checks (the one just written, and
    verified as written, among them). Never deleted, nor counted: a folder that fails its checks (damaged, or not a
    checkpoint at all), a symbolic link; never deleted: the checkpoint a fallback resumed from, and one that a
    --sample or an export is reading (it holds the folder's shared lock: deleted at a later save). Each said once.
    A checkpoint is renamed to step_N.tmp before it is removed, so a crash in between leaves no partial one."""
    import fcntl
    counted, failing, links = [], [], []
    for path in checkpoint_dirs(out_dir):
        why = "a symbolic link" if os.path.islink(path) else passes_checks(path)
        (counted if why is None else links if os.path.islink(path) else failing).append((path, why))
    if failing:
        _say_once(("failing", len(failing)), f"--keep-last {keep}: {len(failing):,} folder(s) of --out-dir {out_dir} "
                  f"fail their checks and are neither counted nor deleted (the newest: {failing[-1][1]})")
    if links:
        _say_once(("links", len(links)), f"--keep-last {keep}: {', '.join(p for p, _ in links[:3])}"
                  f"{' ...' if len(links) > 3 else ''}: symbolic link(s), neither counted nor deleted")
    for path, _ in counted[:-keep]:
        if os.path.realpath(path) in _FALLBACK_SOURCES:
            _say_once(("fallback", path), f"--keep-last {keep}: {path} is kept: this run resumed from it when a newer "
                      "checkpoint failed its checks")
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue  # gone already
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a reader holds it shared: not now
            except BlockingIOError:
                raise
            except OSError as e:  # a filesystem without locks on folders (NFS emulates flock with fcntl locks)
                _say_once("no folder locks", f"--keep-last {keep}: this filesystem refuses locks on checkpoint "
                          f"folders ({e.strerror}): a --sample or an export reading one is not protected from it")
            gone = path + ".tmp"
            shutil.rmtree(gone, ignore_errors=True)
            os.rename(path, gone)
            shutil.rmtree(gone)
        except BlockingIOError:
            _say_once(("reading", path), f"--keep-last {keep}: {path} is kept for now: a --sample or an export is "
                      "reading it (deleted at a later save)")
        except OSError as e:
            _say_once(("error", path), f"--keep-last {keep}: {path} could not be deleted ({e.strerror})")
        finally:
            os.close(fd)


_READING = {}  # a checkpoint this process (--sample, an export) reads -> the folder's descriptor, locked shared


def lock_for_reading(path):
    """Hold a checkpoint folder's shared lock (flock on the folder itself: no file is made) until `done_reading`, so
    that --keep-last does not delete it under this reader; BadCheckpoint if it is gone once the lock is held."""
    import fcntl
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise BadCheckpoint(f"checkpoint {path} cannot be opened ({e.strerror})") from None
    with contextlib.suppress(OSError):  # where folders take no locks (NFS), read unprotected (drop_old_checkpoints)
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a deletion runs
    try:
        still = os.stat(path).st_ino == os.fstat(fd).st_ino
    except OSError:
        still = False
    if not still:
        os.close(fd)
        raise BadCheckpoint(f"checkpoint {path} was deleted while it was opened")
    _READING[path] = fd


def done_reading():
    while _READING:
        os.close(_READING.popitem()[1])


def verified_for_reading(path):
    """verified_checkpoint, under the folder's shared lock (kept when it passes, released when it does not)."""
    lock_for_reading(path)
    try:
        return verified_checkpoint(path)
    except BadCheckpoint:
        os.close(_READING.pop(path))
        raise


def _seal_checkpoint(tmp, final, every, train_state):
    """Rank 0: train_state.json, then MANIFEST (every file's size and CRC32), then the rename that makes it a
    checkpoint."""
    files = {name: entry for part in every for name, entry in part.items()}
    _write_synced(os.path.join(tmp, "train_state.json"), json.dumps(train_state).encode())
    write_manifest(tmp, {**files, **checksums(tmp, ["train_state.json"])})
    if os.path.exists(final):  # keep the old one until the new one is in place
        shutil.rmtree(final + ".old", ignore_errors=True)  # left by a crash between these renames
        os.rename(final, final + ".old")
    os.rename(tmp, final)  # atomic: the folder appears complete or not at all
    shutil.rmtree(final + ".old", ignore_errors=True)


def _make_empty_folder(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)  # a .tmp left by a crash
    os.makedirs(path)
    return True


def _save_error(tmp, error):
    """One line for a checkpoint that could not be written (rank 0's error where it had one)."""
    why = (f"{error.strerror or error}" if isinstance(error, OSError) else
           str(error).splitlines()[0] if isinstance(error, BaseException) and str(error) else "another rank failed")
    return f"checkpoint {tmp} could not be written ({why}): stopping; the checkpoints written before are intact"


def _on_every_rank(ok, device, group=None):
    """Whether `ok` holds on every rank (one MIN all-reduce of a flag), so that all stop or none does."""
    flag = torch.as_tensor(ok, device=device).to(torch.int32).view(1)  # a tensor stays on the device: no sync
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _write_synced(path, data):
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_manifest(folder, files):
    """MANIFEST: one line per file, "name size crc32", under a first line holding the CRC32 of those lines."""
    body = "".join(f"{name} {size} {crc:08x}\n" for name, (size, crc) in sorted(files.items())).encode()
    header = f"train_gpt.py checkpoint manifest; CRC32 of the lines below: {zlib.crc32(body):08x}\n"
    _write_synced(os.path.join(folder, MANIFEST), header.encode() + body)


def weights_are_finite(stage, opt=None):
    """Whether every weight of every rank is finite (one MIN all-reduce of a flag over the world); under ZeRO-3
    each rank looks at the parameter values it holds (opt.owned_param)."""
    values = [opt.owned_param(p)[1] if opt is not None else p for p in stage.parameters()]
    return _on_every_rank(torch.stack([torch.isfinite(v).all() for v in values]).all(), values[0].device)


_DCP_METADATA_NAMES = {  # everything DCP's metadata pickle refers to (torch 2.13), and nothing else
    **{("torch.distributed.checkpoint.metadata", n): True for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): True, ("pathlib", "PosixPath"): True,
    ("pathlib", "WindowsPath"): True, ("torch", "Size"): True, ("torch.serialization", "_get_layout"): True,
    ("collections", "OrderedDict"): True}


class _SafeUnpickler(pickle.Unpickler):
    """DCP stores its metadata (which slices are in which file) as a pickle: resolve only the names it uses,
    exactly (a dotted name would walk attributes to anything), and torch's dtypes."""

    def find_class(self, module, name):
        if (module, name) in _DCP_METADATA_NAMES:
            return super().find_class(module, name)
        if module == "torch" and "." not in name and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which a DCP checkpoint never "
                                     "holds: refusing to load it")


_MEMO_OPCODES = {"PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET"}


def _check_pickle(data):
    """One pass over the pickle's opcodes before it is unpickled: every one known and whole, and no memo index
    past the pickle's own length (a flipped bit that makes one say 1e9 has the unpickler allocate gigabytes)."""
    import pickletools
    for opcode, arg, _ in pickletools.genops(data):
        if opcode.name in _MEMO_OPCODES and int(arg) > len(data):
            raise pickle.UnpicklingError(f"{opcode.name} {arg} points past the pickle's {len(data)} bytes")


def _safe_reader(path, manifest=None):
    """DCP's file reader whose metadata is verified (size and CRC32 from `manifest`; without one the caller has
    verified it), scanned (_check_pickle) and unpickled with DCP's own classes only (_SafeUnpickler)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):  # the tensors themselves are read with weights_only=True
            data = _verified_bytes(str(self.path), ".metadata", manifest, METADATA_MAX_BYTES)
            _check_pickle(data)
            metadata = _SafeUnpickler(io.BytesIO(data)).load()
            metadata.storage_meta = metadata.storage_meta or StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


RNG_STATE_BYTES = torch.get_rng_state().numel()  # the CPU generator's state, saved per rank


def model_geometry(cfg):
    """{global name: the whole parameter's shape, in the coordinates of its boxes (QKV as (3, h, ...))} for every
    parameter of the model, whatever stage holds it: a one-process model built on the meta device (no memory, no
    process group)."""
    plan = make_plan(cfg, TrainConfig(), topology.parallel_state(0, 1))
    with torch.device("meta"):
        stage = GPTStage(cfg, plan)
    return {name: _slice_geometry(p, plan.parallel_state)[0] for name, p, _ in _saved_params(stage)}


def _check_entry(where, key, md, geometry, states, world_size):
    """One saved tensor entry: a name this program writes, the whole parameter's shape, a dtype it saves, stored as
    chunks that tile it (inside it, disjoint, filling it: so every part a rank asks for on load is there)."""
    def bad(why):
        return BadCheckpoint(f"{where}: entry {key!r} {why}: it was not written by this program")

    size, dtype = tuple(md.size), md.properties.dtype
    kind, *parts = key.split("/")
    if kind == "rng" and len(parts) == 1:
        if not (parts[0].isdigit() and int(parts[0]) < world_size):
            raise bad(f"is the RNG state of a rank outside the world of {world_size}")
        if size != (RNG_STATE_BYTES,) or dtype != torch.uint8:
            raise bad(f"is an RNG state of shape {size} and {dtype}")
    elif kind in ("model", "optim") and len(parts) == (1 if kind == "model" else 2) and parts[0] in geometry:
        state = parts[1] if kind == "optim" else None
        if state is not None and state not in states:
            raise bad(f"holds an optimizer state {state!r} (expected one of {states})")
        if state == "step":
            if size != () or dtype not in (torch.float32, torch.float64):
                raise bad(f"is a step counter of shape {size} and {dtype}")
        elif size != tuple(geometry[parts[0]]):
            raise bad(f"has the shape {size}, where the parameter's is {tuple(geometry[parts[0]])}")
        elif dtype not in (FLOAT_DTYPES if kind == "model" else (torch.float32, torch.float64)):
            raise bad(f"is {dtype}")
    else:
        raise bad("names nothing that this model has")
    most = world_size * max(1, 2 * len(size) - 1)  # each rank's parts: a ZeRO flat range is <= 2 ndim - 1 boxes
    if len(md.chunks) > most:
        raise bad(f"is stored as {len(md.chunks)} chunks, where a world of {world_size} writes at most {most}")
    boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
    if not chunks_tile(boxes, size):
        raise bad("is not stored as chunks that tile it")


def chunks_tile(boxes, size):
    """Whether the boxes [(offsets, sizes)] lie inside a tensor of `size`, are disjoint, and fill it. Disjointness
    by a sweep along the dimension where the boxes overlap least: sorted by their start along it, each box is
    compared (all at once) with the boxes that start before it ends; the whole check is O(n log n) numpy calls."""
    if any(len(o) != len(size) or len(s) != len(size) for o, s in boxes):
        return False
    if sum(math.prod(s) for _, s in boxes) != math.prod(size):
        return False
    if not size:
        return len(boxes) == 1
    start = np.array([o for o, _ in boxes], dtype=np.int64).reshape(len(boxes), len(size))
    end = start + np.array([s for _, s in boxes], dtype=np.int64).reshape(start.shape)
    if (start < 0).any() or (end < start).any() or (end > np.array(size, dtype=np.int64)).any():
        return False

    def overlaps_along(dim):  # pairs whose extents along dim overlap: (boxes starting before my end) - (ended) - me
        starts, ends = np.sort(start[:, dim]), np.sort(end[:, dim])
        return int((np.searchsorted(starts, end[:, dim]) - np.searchsorted(ends, start[:, dim], "right") - 1).sum())

    dim = min(range(len(size)), key=overlaps_along)
    order = np.argsort(start[:, dim], kind="stable")
    starts = start[order, dim]
    for k, i in enumerate(order):
        later = order[k + 1:np.searchsorted(starts, end[i, dim])]  # sorted after i, starting before i ends
        if len(later) and ((start[later] < end[i]) & (start[i] < end[later])).all(axis=1).any():
            return False
    return True


def check_checkpoint(path, cfg=None):
    """Everything about a checkpoint that can be checked without reading its tensors, before DCP reads a byte of
    them: train_state.json (read_train_state), every file it lists present with its recorded size, and DCP's
    metadata unpickled safely with every entry checked: only tensors (DCP's default planner unpickles a bytes
    entry's bytes as an unrestricted pickle, which can run any code; _tensors_only_planner refuses them too),
    under the names this program writes, inside their parameters, of the dtypes it saves, each stored piece
    inside a listed file and untransformed. MANIFEST comes first: no file is parsed before its size and CRC32
    pass (the tensor files' CRC32s are verified by the ranks together, verify_checksums). Returns (train_state,
    metadata, manifest); raises BadCheckpoint (one line) or, for a checkpoint of another model shape than `cfg`,
    ValueError."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
    files = read_manifest(path)
    train_state = read_train_state(path, cfg, files)
    for name, (size, _) in files.items():
        st = input_file(f"checkpoint {path}", os.path.join(path, name), BadCheckpoint)
        if st.st_size != size:
            raise BadCheckpoint(f"checkpoint {path}: {name} holds {st.st_size} bytes, {size} were written (truncated "
                                "or damaged)")
    where = os.path.join(path, ".metadata")
    try:
        metadata = _safe_reader(path, files).read_metadata()
    except BadCheckpoint:
        raise
    except MemoryError:
        raise CannotVerify(path, f".metadata ({files['.metadata'][0]:,} bytes)") from None
    except Exception as e:  # untrusted bytes: any failure to parse them is a damaged file (nothing was run)
        raise BadCheckpoint(f"{where} cannot be read: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                            ) from None
    if type(metadata) is not Metadata or not isinstance(metadata.state_dict_metadata, dict) or not isinstance(
            metadata.storage_data, dict):
        raise BadCheckpoint(f"{where}: not the DCP metadata this program writes")
    geometry = model_geometry(GPTConfig(**train_state["config"]))
    states = OPTIMIZER_STATES[train_state["optimizer"]]
    for key, md in metadata.state_dict_metadata.items():
        if type(md) is not TensorStorageMetadata:
            raise BadCheckpoint(f"{where}: entry {key!r} is a {type(md).__name__}, which this program never writes "
                                "(DCP's default planner would unpickle it unrestricted, which can run code)")
        _check_entry(where, key, md, geometry, states, train_state["world_size"])
        for chunk in md.chunks:
            if MetadataIndex(key, torch.Size(chunk.offsets)) not in metadata.storage_data:
                raise BadCheckpoint(f"{where}: entry {key!r} has a chunk stored nowhere")
    for index, info in metadata.storage_data.items():
        if type(info) is not _StorageInfo or type(index) is not MetadataIndex or (
                index.fqn not in metadata.state_dict_metadata):
            raise BadCheckpoint(f"{where}: a stored piece of {getattr(index, 'fqn', index)!r} is not described "
                                "as this program writes it")
        if info.relative_path == ".metadata" or info.relative_path not in files:
            raise BadCheckpoint(f"{where}: {index.fqn!r} is stored in {info.relative_path!r}, which {MANIFEST} "
                                "does not list")
        if not (_int(0)[0](info.offset) and _int(0)[0](info.length)) or (
                info.offset + info.length > files[info.relative_path][0]):
            raise BadCheckpoint(f"{where}: {index.fqn!r} is stored outside {info.relative_path}")
        if info.transform_descriptors:
            raise BadCheckpoint(f"{where}: {index.fqn!r} is stored through transforms "
                                f"{info.transform_descriptors!r}, which this program never writes")
    return train_state, metadata, files


def file_crc32(path, chunk=1 << 24):
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def checksums(folder, names):
    """{name: [size, CRC32]} of files in folder. CRC32 catches accidental damage (flipped bits, torn or truncated
    writes, a copy gone wrong); it is no protection against a deliberate edit, whose author recomputes it."""
    return {n: [os.path.getsize(os.path.join(folder, n)), file_crc32(os.path.join(folder, n))] for n in names}


def verified_checkpoint(path):
    """check_checkpoint, then every tensor file's CRC32 on this one process: what a one-process reader (--sample,
    the exports) verifies before it loads. Returns the train_state."""
    train_state, _, manifest = check_checkpoint(path)
    verify_checksums(path, manifest)
    return train_state


def verify_checksums(path, files):
    """Check the recorded CRC32 of every listed file, each rank its share (every world-th file), so the job reads
    the checkpoint once; every rank learns of a damaged one (an all-gather of the ranks' findings). Raises
    BadCheckpoint naming the first damaged file."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    found = None
    for name in sorted(n for n in files if DATA_FILE.fullmatch(n))[rank::world]:  # the rest: verified when read
        if file_crc32(os.path.join(path, name)) != files[name][1]:
            found = f"checkpoint {path}: {name} does not match its recorded CRC32 (damaged after it was written)"
            break
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, found)
        found = next((f for f in every if f), None)
    if found:
        raise BadCheckpoint(found)


def newest_passing(out_dir, attempt, say=None):
    """(path, attempt(path)) for the newest checkpoint in out_dir for which `attempt` raises no BadCheckpoint, or
    (None, None) if out_dir holds none; each newer one refused is told in one line through `say`. BadCheckpoint when
    every one is refused, naming the newest's fault."""
    refused = []
    for path in reversed(checkpoint_dirs(out_dir)):
        try:
            result = attempt(path)
        except CannotVerify:
            raise  # not a fault of the checkpoint: no fallback
        except BadCheckpoint as e:  # raised on every rank alike: the checks and the checksums are agreed
            refused.append((path, str(e)))
            continue
        if say and len(refused) > 3:  # a folder of junk: one line, not one per folder
            say(f"skipping the {len(refused):,} newest folders of --out-dir {out_dir}, which fail their checks "
                f"(the newest, {refused[0][0]}: {refused[0][1]}; the oldest of them, {refused[-1][0]}: "
                f"{refused[-1][1]})")
        for bad, why in refused if say and len(refused) <= 3 else ():
            say(f"skipping checkpoint {bad}: {why}")
        return path, result
    if refused:
        raise BadCheckpoint(f"--out-dir {out_dir}: none of its {len(refused)} checkpoints passes its checks; the "
                            f"newest: {refused[0][1]}")
    return None, None


def latest_checkpoint(out_dir, cfg=None, say=None):
    """The newest checkpoint that passes check_checkpoint, with its train_state (before any process group)."""
    return newest_passing(out_dir, lambda path: check_checkpoint(path, cfg)[0], say)


def _dcp_read(tensors, path, manifest=None):
    """Read the saved keys of `tensors` into them, on this rank alone (no_dist: the ranks read different parts)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    with warnings.catch_warnings():  # no_dist says it assumes one process: true of each rank's read
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(tensors, storage_reader=_safe_reader(path, manifest or read_manifest(path)),
                     planner=_tensors_only_planner(), no_dist=True)
        except CheckpointException as e:  # a BaseException wrapping this rank's error: raise the error itself, so
            raise next(iter(e.failures.values()))[0] from None  # that load_checkpoint's `except Exception` sees it


def _tensors_only_planner():
    """DCP's default load planner, except that a bytes entry is refused unread: the default unpickles its bytes
    unrestricted (code can run). check_checkpoint already refuses such entries; this holds even where it was not
    called, so no path through DCP unpickles a checkpoint's data."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class TensorsOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            raise BadCheckpoint(f"entry {read_item.dest_index.fqn!r} is stored as bytes, which this program never "
                                "writes and never unpickles")
    return TensorsOnlyPlanner()


def _all_agree(error, device):
    """Raise on every rank if any rank could not read its part: that rank alone raising would leave the others
    waiting in the first training collective."""
    failed = torch.tensor([error is not None], dtype=torch.int32, device=device)
    if dist.is_initialized():
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        raise error or BadCheckpoint("another rank could not read its part of the checkpoint (its error says why)")


def load_checkpoint(path, stage, opt=None):
    """Fill this rank's parameters (and, with `opt`, its optimizer state) from a checkpoint of any layout: each rank
    hands DCP the Boxes it holds (checkpoint_tensors), and DCP reads into them the saved parts that overlap them,
    in place. The checks come first (check_checkpoint, then the checksums, which the ranks verify together); then
    the ranks agree that every one of them could read its part. Returns the checkpoint's train_state."""
    parallel_state = stage.plan.parallel_state
    train_state, metadata, manifest = check_checkpoint(path, stage.cfg)  # before DCP reads a byte of it
    verify_checksums(path, manifest)
    saved = metadata.state_dict_metadata
    like = {}  # NAME -> {STATE: (ndim, dtype)}: the optimizer states the checkpoint holds
    for key, md in saved.items():
        if key.startswith("optim/"):
            _, name, state = key.split("/")
            like.setdefault(name, {})[state] = (len(md.size), md.properties.dtype)
    mine = checkpoint_tensors(stage, opt, like)
    rng = None
    if train_state["world_size"] == parallel_state.world_size and f"rng/{parallel_state.rank}" in saved:
        mine[f"rng/{parallel_state.rank}"] = rng = torch.empty_like(torch.get_rng_state())
    error = None
    try:
        with torch.no_grad():
            _dcp_read(mine, path, manifest)
    except MemoryError:
        error = CannotVerify(path, "its tensors")
    except Exception as e:  # an unreadable file: every rank must hear of it
        why = ("a tensor file holds an object that is not tensor data: refused unread" if "Weights only load failed"
               in str(e) else str(e))  # torch's own message advises weights_only=False, which would run it
        error = BadCheckpoint(f"checkpoint {path}: rank {parallel_state.rank} could not read its part "
                              f"({why})".splitlines()[0])
    _all_agree(error, next(stage.parameters()).device)
    if opt is not None:
        opt.copy_masters_to_params()  # ZeRO: the working weights from what was read
        scalars = train_state["optimizer_state"]  # the loss scale; hyperparameters come from the flags
        opt.load_scalar_state({**scalars, "param_groups": opt.scalar_state()["param_groups"]})
    if rng is not None:
        torch.set_rng_state(rng)
    return train_state


def what_runs(cfg, train_cfg, plan, stage, data):
    """The start-up banner, rank 0: the model (parameters in all and on this rank), the layout, the batch's make-up,
    the data and the precision."""
    sizes, world = plan.parallel_state.sizes, plan.parallel_state.world_size
    mine = sum(p.numel() for p in stage.parameters())
    moe = f", MoE every {cfg.moe_every} ({cfg.n_experts} experts, top-{cfg.top_k})" if cfg.moe_every else ""
    tokens = "" if data.train is None else f", {len(data.train):,} train / {len(data.val):,} validation tokens"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return "\n".join([
        f"model: {parameter_count(cfg):,} parameters ({mine:,} on rank 0): {cfg.n_layer} layers, h {cfg.n_embd}, "
        f"{cfg.n_head} heads, seq {cfg.seq_len}, vocab {cfg.vocab_size}{moe}",
        f"layout: {world} ranks = TP {sizes['tp']} x CP {sizes['cp']} x DP {sizes['dp']} x PP {sizes['pp']}, EP "
        f"{sizes['ep']} over DP x CP; TP groups {'inside' if sizes['tp'] <= local else 'ACROSS'} a node of {local}; "
        f"{train_cfg.pp_schedule}" + (f", {train_cfg.virtual_stages} virtual stages" if train_cfg.virtual_stages > 1
                                      else ""),
        f"batch: {train_cfg.batch} sequences a step = {plan.micro_batch_count} micro-batches of "
        f"{train_cfg.micro_batch} x DP {sizes['dp']}; data: {data.source}{tokens}",
        f"precision: {train_cfg.dtype}" + (f" ({train_cfg.fp8_recipe})" if train_cfg.dtype == "fp8" else "")
        + (f" ({cfg.n_layer - nvfp4_bf16_last(cfg, train_cfg)} of {cfg.n_layer} blocks; the rest, the LM head and "
           "the experts BF16)" if train_cfg.dtype == "nvfp4" else "")
        + f", masters and main grads {str(train_cfg.master_dtype)[6:]}; ZeRO {train_cfg.zero}; recompute "
        f"{train_cfg.recompute}; "
        f"{train_cfg.steps} steps of {train_cfg.optimizer}, lr {train_cfg.lr:g}"])


def resume_step(train_cfg, stage, opt):
    """The step a run starts at: 0, or with --resume (and a checkpoint in out_dir) the step of the newest one that
    passes its checks, whose weights and optimizer states are then loaded; what changed since is said once."""
    resumed = None
    if train_cfg.resume and checkpoint_dirs(train_cfg.out_dir):
        resumed = resume(train_cfg.out_dir, stage, opt)
    if train_cfg.init_from_hf and not resumed:  # a checkpoint to resume comes first: a restarted job goes on
        load_hf_weights(train_cfg.init_from_hf, stage, opt)
    start = resumed["step"] if resumed else 0
    rank = stage.plan.parallel_state.rank
    if resumed:
        saved, ranks = resumed["layout"], resumed["world_size"]
        say_on_rank_0(train_cfg, rank, f"resumed from {resumed['path']} (step {start}; saved by {ranks} "
                      f"rank{'s' * (ranks > 1)} at TP {saved['tp']} x CP {saved['cp']} x PP {saved['pp']}, EP "
                      f"{saved['ep']}, ZeRO {saved['zero']}, {saved['dtype']})")
        if rank == 0:
            warn_what_changed(resumed, train_cfg)
    if start >= train_cfg.steps:
        say_on_rank_0(train_cfg, rank, f"{resumed['path']} already holds step {start} of "
                      f"--steps {train_cfg.steps}: nothing to train")
    return start


def resume(out_dir, stage, opt=None):
    """Load the newest checkpoint of out_dir that passes every check (check_checkpoint, then the checksums, which
    the ranks verify together), telling on rank 0 in one line each one skipped; returns its train_state, with
    its "path"."""
    path, state = newest_passing(out_dir, lambda path: load_checkpoint(path, stage, opt), _warn_on_rank_0)
    mark_passing(path)
    if path != checkpoint_dirs(out_dir)[-1]:  # a newer one failed its checks: --keep-last keeps this one
        _FALLBACK_SOURCES.add(os.path.realpath(path))
    return {**state, "path": path}


_OUT_DIR_LOCKS = {}  # absolute --out-dir -> the open lock file this process holds


def hold_out_dir(out_dir):
    """One writer per --out-dir: an exclusive advisory lock (flock) on OUT/.lock, taken by rank 0 before anything
    is written and held while the process lives (released by the kernel when it exits, however it exits, so a
    crashed run leaves no lock behind: the file then only names its last holder). A second run is refused in
    one line naming the holder. The lock file is never followed if it is a symbolic link (whose target would be
    overwritten), and before each checkpoint the run checks that OUT/.lock is still the file it locked (a deleted
    or replaced lock file would let a second run in: the first then stops, still_holds_out_dir). Across nodes this
    needs a filesystem that carries flock to its server (NFSv4, Lustre mounted with -o flock, GPFS); where locks
    are refused, the run warns and goes on unprotected."""
    import fcntl
    key = os.path.abspath(out_dir)
    if key in _OUT_DIR_LOCKS:
        return
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, ".lock")
    try:  # O_NONBLOCK: a FIFO in its place would block the open
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        why = "a symbolic link, which the lock never follows" if e.errno == errno.ELOOP else e.strerror
        raise ValueError(f"--out-dir {out_dir}: its lock file {path} cannot be opened ({why}): remove it, or pass "
                         "another --out-dir") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ValueError(f"--out-dir {out_dir}: its lock file {path} is {_kind(mode)}: remove it, or pass another "
                         "--out-dir")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 512).decode(errors="replace").strip() or "a holder that has not written its name yet"
        os.close(fd)
        raise ValueError(f"--out-dir {out_dir} is in use by another run ({holder}; lock file {path}): wait for it "
                         "to end, or pass another --out-dir") from None
    except OSError as e:
        os.close(fd)
        _warn(f"--out-dir {out_dir}: this filesystem refuses file locks ({e.strerror}): nothing stops a second run "
              "from writing checkpoints into the same folder")
        return
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
    _OUT_DIR_LOCKS[key] = fd


def still_holds_out_dir(out_dir):
    """Whether OUT/.lock is still the file this process locked (True where this process holds no lock)."""
    fd = _OUT_DIR_LOCKS.get(os.path.abspath(out_dir))
    if fd is None:
        return True
    try:
        now, held = os.stat(os.path.join(out_dir, ".lock"), follow_symlinks=False), os.fstat(fd)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def release_out_dir(out_dir):
    """The run's end: the background save in flight is written first (its failure raised unless the run is already
    stopping on another error), then the lock is released."""
    try:
        ASYNC_SAVE.wait(quiet=sys.exc_info()[0] is not None)
    finally:
        _release_lock(out_dir)


def _release_lock(out_dir):
    fd = _OUT_DIR_LOCKS.pop(os.path.abspath(out_dir), None) if out_dir else None
    if fd is not None:
        os.close(fd)  # closing the file releases the lock


# ---- Input checks: every flag, file and checkpoint, before any process group exists ------------------------

DTYPES = ("float32", "bfloat16", "float16", "fp8", "nvfp4", "float64")
TIMEOUT_RANGE_S = (1, 7 * 24 * 3600)  # --timeout-s: below a second every collective of a busy rank would fail
RECOMPUTE = ("none", "full", "sqrt", "selective", "offload", "selective+offload")  # checkpointing.py's


def validate(cfg, train_cfg, world):
    """Every value and shape the run needs, checked on every rank before any process group is created: a
    ValueError that names the flag and a valid choice."""
    positive = {"--tp": train_cfg.tp, "--pp": train_cfg.pp, "--cp": train_cfg.cp, "--ep": train_cfg.ep,
                "--layers": cfg.n_layer,
                "--heads": cfg.n_head, "--hidden": cfg.n_embd, "--seq": cfg.seq_len, "--vocab": cfg.vocab_size,
                "--batch": train_cfg.batch, "--micro-batch": train_cfg.micro_batch, "--steps": train_cfg.steps,
                "--experts": cfg.n_experts, "--top-k": cfg.top_k, "--eval-batches": train_cfg.eval_batches,
                "--virtual-stages": train_cfg.virtual_stages, "--cp-ulysses": train_cfg.cp_ulysses}
    for flag, value in positive.items():
        if value < 1:
            raise ValueError(f"{flag} {value} must be a positive integer")
    for flag, value in {"--moe-every": cfg.moe_every, "--warmup": train_cfg.warmup,
                        "--eval-every": train_cfg.eval_every, "--save-every": train_cfg.save_every}.items():
        if value < 0:
            raise ValueError(f"{flag} {value} must be 0 or more")
    if not (math.isfinite(train_cfg.lr) and train_cfg.lr > 0):
        raise ValueError(f"--lr {train_cfg.lr} must be a positive finite number (e.g. --lr 3e-3)")
    if not TIMEOUT_RANGE_S[0] <= train_cfg.timeout_s <= TIMEOUT_RANGE_S[1]:  # NaN fails it too
        raise ValueError(f"--timeout-s {train_cfg.timeout_s} must be between {TIMEOUT_RANGE_S[0]} and "
                         f"{TIMEOUT_RANGE_S[1]} seconds (a stopped rank ends the job after about this long)")
    for flag, value in {"--min-lr": train_cfg.min_lr, "--weight-decay": train_cfg.weight_decay,
                        "--grad-clip": train_cfg.grad_clip}.items():
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{flag} {value} must be a finite number >= 0")
    if train_cfg.min_lr is not None and train_cfg.min_lr > train_cfg.lr:
        raise ValueError(f"--min-lr {train_cfg.min_lr} exceeds --lr {train_cfg.lr}: the schedule decays from --lr to "
                         "--min-lr")
    if train_cfg.peak_tflops is not None and not (math.isfinite(train_cfg.peak_tflops) and train_cfg.peak_tflops > 0):
        raise ValueError(f"--peak-tflops {train_cfg.peak_tflops} must be a positive number (per GPU, e.g. 989 for "
                         "H100)")
    if not 0 <= cfg.seed < 2 ** 31:
        raise ValueError(f"--seed {cfg.seed} must be between 0 and 2**31 - 1")
    tp, pp, cp, ep = train_cfg.tp, train_cfg.pp, train_cfg.cp, train_cfg.ep
    topology.validate_layout(world, tp, pp, cp, ep)
    layout = layout_of(cfg, train_cfg, world)
    dp, s_cp = layout.dp, layout.seq_cp
    zigzag = cp > 1 and train_cfg.cp_impl in ("ring", "allgather", "hybrid")
    u = train_cfg.cp_ulysses
    token_split = layout.sequence_parallel or (layout.moe_token_split and cfg.moe_every > 0)
    checks = [
        (train_cfg.cp_impl not in ALL_CP_IMPLS,
         f"--cp-impl {train_cfg.cp_impl!r} is unknown; choose one of {sorted(ALL_CP_IMPLS)}"),
        (train_cfg.recompute not in RECOMPUTE,
         f"--recompute {train_cfg.recompute!r} is unknown; choose one of {RECOMPUTE}"),
        (train_cfg.dtype not in DTYPES, f"--dtype {train_cfg.dtype!r} is unknown; choose one of {DTYPES}"),
        (train_cfg.optimizer not in ("adamw", "sgd"),
         f"--optimizer {train_cfg.optimizer!r} is unknown; choose adamw or sgd"),
        (ep > 1 and cfg.moe_every == 0, f"--ep {ep} needs MoE layers: set --moe-every > 0"),
        (train_cfg.moe_grouped_gemm and cfg.moe_every == 0, "--moe-grouped-gemm runs MoE layers' experts: set "
                                                            "--moe-every > 0"),
        (cfg.moe_every > cfg.n_layer, f"--moe-every {cfg.moe_every} exceeds --layers {cfg.n_layer}: no layer "
                                      "would be MoE; choose --moe-every <= --layers, or 0 for a dense model"),
        (cfg.moe_every and cfg.n_experts % ep, f"--experts {cfg.n_experts} must be divisible by --ep {ep}"),
        (cfg.moe_every and cfg.top_k > cfg.n_experts,
         f"--top-k {cfg.top_k} must be between 1 and --experts {cfg.n_experts}"),
        (cfg.n_layer % pp, f"--layers {cfg.n_layer} must be divisible by --pp {pp}; choose --pp among "
                           f"{[d for d in range(1, cfg.n_layer + 1) if cfg.n_layer % d == 0]}"),
        (cfg.n_layer % (pp * train_cfg.virtual_stages),
         f"--layers {cfg.n_layer} must be divisible by --pp x --virtual-stages = {pp}x{train_cfg.virtual_stages} (each "
         f"model chunk holds L / (pp v) layers)"),
        (cfg.n_embd % cfg.n_head, f"--hidden {cfg.n_embd} must be divisible by --heads {cfg.n_head}; e.g. "
                                  f"--hidden {cfg.n_head * max(1, round(cfg.n_embd / cfg.n_head))}"),
        (cfg.n_head % tp, f"--heads {cfg.n_head} must be divisible by --tp {tp}"),
        (cp > 1 and train_cfg.cp_impl == "ulysses" and (cfg.n_head // tp) % cp,
         f"--cp-impl ulysses splits each TP rank's {cfg.n_head // tp} heads over --cp {cp}: choose --cp "
         f"dividing --heads/--tp, or --cp-impl ring"),
        (cfg.vocab_size % tp and not train_cfg.init_from_hf,
         f"--vocab {cfg.vocab_size} must be divisible by --tp {tp}; pad the vocabulary to "
         f"{-(-cfg.vocab_size // tp) * tp}"),
        (cfg.vocab_size % tp and train_cfg.init_from_hf,
         f"--tp {tp} must divide the vocabulary of --init-from-hf {train_cfg.init_from_hf}, {cfg.vocab_size} (its "
         f"config.json: the rows are split over TP): choose --tp among "
         f"{[d for d in range(1, cfg.n_head + 1) if cfg.n_head % d == 0 and cfg.vocab_size % d == 0]} (dividing "
         "--heads too)"),
        (zigzag and cfg.seq_len % (2 * cp),
         f"--seq {cfg.seq_len} must be divisible by 2*cp = {2 * cp} (zigzag shards of --cp-impl {train_cfg.cp_impl})"),
        (cp > 1 and cfg.seq_len % cp, f"--seq {cfg.seq_len} must be divisible by --cp {cp}"),
        (u > 1 and train_cfg.cp_impl != "hybrid",
         f"--cp-ulysses {u} needs --cp-impl hybrid (Ulysses inside, ring across)"),
        (cp % u, f"--cp-ulysses {u} must divide --cp {cp} (CP = u x the ring's size)"),
        (train_cfg.cp_impl == "hybrid" and (cfg.n_head // tp) % u,
         f"--cp-impl hybrid splits each TP rank's {cfg.n_head // tp} heads over --cp-ulysses {u}: choose --cp-ulysses "
         f"dividing --heads/--tp"),
        (token_split and s_cp % tp,
         f"--seq/--cp = {s_cp} must be divisible by --tp {tp}: sequence parallelism (and MoE layers under TP) "
         f"split each rank's tokens over TP"),
        (train_cfg.batch % (dp * train_cfg.micro_batch),
         f"--batch {train_cfg.batch} must be divisible by dp*micro_batch = {dp}*{train_cfg.micro_batch} (dp = world / "
         f"(tp*cp*pp) = {dp})"),
        ((train_cfg.resume or train_cfg.save_every) and not train_cfg.out_dir,
         "--resume and --save-every need --out-dir"),
        (train_cfg.async_save and not train_cfg.out_dir, "--async-save writes checkpoints: it needs --out-dir"),
        (train_cfg.fp8_recipe not in mixed_precision.FP8_RECIPES,
         f"--fp8-recipe {train_cfg.fp8_recipe!r} is unknown; choose one of {mixed_precision.FP8_RECIPES}"),
        (train_cfg.fp8_backward not in mixed_precision.FP8_BACKWARDS,
         f"--fp8-backward {train_cfg.fp8_backward!r} is unknown; choose bf16 (16-bit backward GEMMs) or fp8 (E5M2 "
         "gradients)"),
        (train_cfg.fp8_backward == "fp8" and train_cfg.dtype != "fp8",
         "--fp8-backward fp8 runs the backward GEMMs of the FP8 layers in FP8: it needs --dtype fp8"),
        (train_cfg.dtype == "fp8" and train_cfg.fp8_recipe == "delayed" and train_cfg.recompute in ("full", "sqrt"),
         f"--fp8-recipe delayed records each GEMM's amax as it runs, and --recompute {train_cfg.recompute} runs the "
         "blocks' GEMMs again in the backward, which would record it again: use --recompute none, selective or "
         "offload (they recompute no GEMM), or another --fp8-recipe"),
        *nvfp4_checks(cfg, train_cfg),
        (train_cfg.zero not in (0, 1, 2, 3),
         f"--zero {train_cfg.zero} is unknown; choose 0 (replicated), 1 (optimizer states sharded), 2 (and gradients) "
         "or 3 (and parameters)"),
        (train_cfg.zero_shard_size is not None and train_cfg.zero == 0,
         "--zero-shard-size shards the ZeRO states over groups of DP x CP ranks: it needs --zero 1, 2 or 3"),
        (train_cfg.zero_shard_size is not None
         and not (train_cfg.zero_shard_size >= 1 and (cp * dp) % train_cfg.zero_shard_size == 0),
         f"--zero-shard-size {train_cfg.zero_shard_size} must divide dp*cp = {dp * cp} (hybrid sharding: shard over "
         f"groups of that many ranks, replicate across them)"),
        (train_cfg.fp8_param_gather and not (train_cfg.zero >= 1 and train_cfg.dtype in ("bfloat16", "fp8")),
         "--fp8-param-gather all-gathers the ZeRO shards of 16-bit weights: it needs --zero 1, 2 or 3 and --dtype "
         "bfloat16 or fp8"),
    ]
    for failed, message in checks:
        if failed:
            raise ValueError(message)
    error = schedule_error(train_cfg.pp_schedule, pp, layout.micro_batch_count, train_cfg.virtual_stages)
    if error:
        raise ValueError(error)


def nvfp4_checks(cfg, train_cfg):
    """--dtype nvfp4's (failed, message) pairs: K blocks in BF16 among the model's, 16-blocks whole on each TP rank."""
    k, tp, nvfp4 = train_cfg.nvfp4_bf16_last, train_cfg.tp, train_cfg.dtype == "nvfp4"
    return [
        (k is not None and not nvfp4, f"--nvfp4-bf16-last {k} keeps blocks of an NVFP4 run in BF16: it needs "
                                      "--dtype nvfp4"),
        (nvfp4 and k is not None and not 0 <= k <= cfg.n_layer,
         f"--nvfp4-bf16-last {k} must be between 0 and --layers {cfg.n_layer} (the last K blocks stay BF16)"),
        (nvfp4 and tp > 1 and nvfp4_bf16_last(cfg, train_cfg) < cfg.n_layer and (cfg.n_embd // tp) % 16,
         f"--dtype nvfp4 scales 16 consecutive elements together, and --tp {tp} cuts --hidden {cfg.n_embd} into "
         f"{cfg.n_embd / tp:g} per rank: choose --hidden and --tp with --hidden/--tp a multiple of 16"),
    ]


def schedule_error(kind, p, m, v):
    """What makes a pipeline schedule impossible (the message names the flag), or None."""
    if kind not in ALL_SCHEDULES:
        return f"--pp-schedule {kind!r} is unknown; choose one of {tuple(ALL_SCHEDULES)}"
    if kind == "interleaved" and v == 1:
        return "--pp-schedule interleaved needs --virtual-stages >= 2 (model chunks per pipeline rank)"
    if kind in V_SCHEDULES and v != 2:
        return f"--pp-schedule {kind} places two model chunks per rank in a V: pass --virtual-stages 2"
    if v > 1 and kind == "1f1b":
        return f"--virtual-stages {v} needs --pp-schedule interleaved or zb-h1 (1f1b runs one chunk per rank)"
    if v > 1 and p == 1:
        return f"--virtual-stages {v} needs --pp >= 2: the chunks interleave across the pipeline ranks"
    if kind == "dualpipev" and m < 2 * p:
        return (f"--pp-schedule dualpipev needs the micro-batches m = batch / (dp micro_batch) = {m} to be at least "
                f"2 --pp = {2 * p} (the two directions meet in the middle): choose --batch or --micro-batch so")
    if v > 1 and m % p and kind not in V_SCHEDULES:
        return (f"--virtual-stages {v} needs the micro-batches m = batch / (dp micro_batch) = {m} to be a multiple of "
                f"--pp {p} (they advance in groups of p): choose --batch or --micro-batch so")
    return None


def check_inputs(cfg, train_cfg, world):
    """validate(), the --out-dir lock (rank 0), then the data (present, long enough, ids below --vocab), the metrics
    file and the checkpoint to resume (the newest that passes its checks, of the same model shape): everything that
    can fail, before any process group exists. Returns the data."""
    try:
        return _check_inputs(cfg, train_cfg, world)
    except ValueError:
        release_out_dir(train_cfg.out_dir)
        raise


def _check_inputs(cfg, train_cfg, world):
    validate(cfg, train_cfg, world)
    check_fits_in_memory(cfg, train_cfg)
    if train_cfg.out_dir:
        _check_folder_can_exist("--out-dir", train_cfg.out_dir)
        if _global_rank() == 0:  # before anything is written, and before the folder is looked at
            hold_out_dir(train_cfg.out_dir)
    check_outputs_apart_from_inputs(train_cfg)
    if train_cfg.metrics:  # every rank checks (every rank must stop on a bad one); rank 0 alone writes
        _check_metrics_file(train_cfg.metrics, train_cfg.out_dir)
    if train_cfg.out_dir and _global_rank() == 0 and os.path.isdir(train_cfg.out_dir):
        clear_stale_writes(train_cfg.out_dir)
    data = load_data(train_cfg.data, cfg.seq_len, cfg.vocab_size)
    if data.vocab > cfg.vocab_size:
        raise ValueError(f"--vocab {cfg.vocab_size} is smaller than the data's vocabulary ({data.source} uses ids "
                         f"up to {data.vocab - 1}): pass --vocab {-(-data.vocab // train_cfg.tp) * train_cfg.tp} or "
                         "more")
    if not train_cfg.resume and checkpoint_dirs(train_cfg.out_dir):
        raise ValueError(f"--out-dir {train_cfg.out_dir} holds checkpoints of an earlier run (latest "
                         f"{os.path.basename(checkpoint_dirs(train_cfg.out_dir)[-1])}): pass --resume to continue "
                         "it, or another --out-dir (a fresh run would mix its checkpoints with the old ones)")
    latest, state = latest_checkpoint(train_cfg.out_dir, cfg) if train_cfg.resume else (None, None)
    if latest:
        if state["optimizer"] != train_cfg.optimizer:
            raise ValueError(f"checkpoint {latest} holds {state['optimizer']} state, this "
                             f"run has --optimizer {train_cfg.optimizer}: pass --optimizer {state['optimizer']}")
        if state["config"]["seed"] != cfg.seed:  # the seed draws the batches: another one is another run
            raise ValueError(f"checkpoint {latest} was trained with --seed "
                             f"{state['config']['seed']}, this run has --seed {cfg.seed}: pass --seed "
                             f"{state['config']['seed']} to continue its sequence of batches")
    return data


def warn_what_changed(state, train_cfg):
    """Moved data is fine, and a longer run is a new schedule: said once the checkpoint is loaded (the checks before
    the process group may pass one that its checksums then skip)."""
    if state["data"] != train_cfg.data:
        _warn(f"resuming a run trained on --data {state['data']} with --data {train_cfg.data}")
    if state["schedule"] != _schedule(train_cfg):
        _warn(_schedule_change(state["schedule"], train_cfg, state["step"]))


def _inside(path, folder):
    return os.path.commonpath([path, folder]) == folder


def _inside_checkpoint(path):
    """Whether path or a folder above it is a checkpoint (holds a MANIFEST, a train_state.json or DCP's .metadata)."""
    path, above = os.path.realpath(path), None
    while path != above:
        if any(os.path.lexists(os.path.join(path, name)) for name in (MANIFEST, "train_state.json", ".metadata")):
            return True
        path, above = os.path.dirname(path), path
    return False


def check_outputs_apart_from_inputs(train_cfg):
    """No output can overwrite an input or be read back as one: --metrics is not the --data file, nor inside the
    --data folder, a checkpoint or its lock; --out-dir is not inside the --data folder (whose text files are all
    read: the run would train on its own checkpoints)."""
    data = os.path.realpath(train_cfg.data) if train_cfg.data not in ("embedded", "synthetic") and \
        os.path.exists(train_cfg.data) else None
    data_folder = data if data and os.path.isdir(data) else None
    if train_cfg.out_dir and data_folder and _inside(os.path.realpath(train_cfg.out_dir), data_folder):
        raise ValueError(f"--out-dir {train_cfg.out_dir} is inside the --data folder {train_cfg.data}, whose files "
                         "are read as data: pass an --out-dir outside it")
    if not train_cfg.metrics:
        return
    metrics = os.path.realpath(train_cfg.metrics)
    if data and (metrics == data or (data_folder and _inside(metrics, data_folder))):
        raise ValueError(f"--metrics {train_cfg.metrics} would overwrite the --data {train_cfg.data}: pass a path "
                         "outside it")
    if train_cfg.init_from_hf and _inside(metrics, os.path.realpath(train_cfg.init_from_hf)):
        raise ValueError(f"--metrics {train_cfg.metrics} lies inside the --init-from-hf folder "
                         f"{train_cfg.init_from_hf}, whose files are read as the initial weights: pass a path outside "
                         "it")
    out = os.path.realpath(train_cfg.out_dir) if train_cfg.out_dir else None
    if _inside_checkpoint(os.path.dirname(metrics)) or (out and metrics != out and _inside(metrics, out) and (
            os.path.basename(metrics) == ".lock" or STEP_FOLDER.match(os.path.relpath(metrics, out)))):
        raise ValueError(f"--metrics {train_cfg.metrics} lies inside a checkpoint (or is the --out-dir lock): pass a "
                         "path outside the checkpoint folders")


def clear_stale_writes(out_dir):
    """Rank 0, holding the --out-dir lock: a step_N.tmp folder is what a crashed save left (no other run can be
    writing it): removed now, not when a save meets it. Anything else under that name is not ours to remove:
    refused in one line, before training."""
    for name in os.listdir(out_dir):
        if not re.fullmatch(r"step_[0-9]{1,12}\.tmp", name):
            continue
        path = os.path.join(out_dir, name)
        if not os.path.isdir(path) or os.path.islink(path):
            raise ValueError(f"--out-dir {out_dir} holds {name}, which is not a folder left by a save (a file or a "
                             "link): remove it, or pass another --out-dir")
        if os.path.abspath(out_dir) in _OUT_DIR_LOCKS:
            _warn(f"removing {path}: a checkpoint that a run stopped writing (it never was one: the earlier "
                  "checkpoints are intact)")
            shutil.rmtree(path)


def check_fits_in_memory(cfg, train_cfg):
    """Refuse, before anything is allocated, a model whose weights, gradients and master weights alone (4 bytes of
    each per parameter at least, the parameters split over TP x PP x EP at best) exceed this rank's share of the
    machine's memory (the GPU's, or the host's over its local ranks): an allocator's traceback otherwise."""
    per_rank = 3 * 4 * parameter_count(cfg) / (train_cfg.tp * train_cfg.pp * train_cfg.ep)
    if torch.cuda.is_available():
        available = torch.cuda.get_device_properties(0).total_memory
    elif hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // int(os.environ.get("LOCAL_WORLD_SIZE",
                                                                                                      1))
    else:
        return
    if per_rank > available:
        raise ValueError(f"the model has {parameter_count(cfg):,} parameters: at least {per_rank / 2 ** 30:,.1f} GiB "
                         f"per rank for its weights, gradients and master weights, where a rank has "
                         f"{available / 2 ** 30:,.1f} GiB: pass a smaller --hidden or --layers, or more --tp or --pp")


def _check_metrics_file(path, out_dir=None):
    """--metrics names a regular file (or none yet) in a folder this process can write (or in --out-dir, which
    rank 0 creates: checked as --out-dir)."""
    if os.path.isdir(path):
        raise ValueError(f"--metrics {path} is a folder: pass a file path, e.g. {path}/metrics.jsonl")
    check_output_name("--metrics", path)  # a link, a device, a FIFO: refused
    if os.path.exists(path):
        # every rank checks, rank 0 alone writes: a file rank 0 has just set aside or replaced is not refused
        if not os.access(path, os.R_OK | os.W_OK) and os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK):
            raise ValueError(f"--metrics {path} is not readable and writable (its permissions): pass another path")
        if os.path.basename(path) == ".lock" or _locked_by_another(path):
            raise ValueError(f"--metrics {path} is the lock file of a run (a metrics file would move it aside and let "
                             "a second run into its folder): pass another path")
    folder = os.path.dirname(os.path.abspath(path))
    if out_dir and folder == os.path.abspath(out_dir) and not os.path.exists(folder):
        return  # the --out-dir that rank 0 makes (its ancestors checked by _check_folder_can_exist)
    if not os.path.isdir(folder):
        what = ("is a file; pass another path" if os.path.exists(folder)
                else "does not exist; create it or pass another path")
        raise ValueError(f"--metrics {path}: the folder {folder} {what}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"--metrics {path}: the folder {folder} is not writable; pass another path")
    if _global_rank() == 0:  # the one writer tries: some folders (/proc, a full disk) refuse what access() allows
        existed = os.path.exists(path)
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644))
            if not existed:
                os.unlink(path)  # a check leaves nothing behind
        except OSError as e:
            raise ValueError(f"--metrics {path} cannot be written ({e.strerror}); pass another path") from None


def _locked_by_another(path):
    """Whether another open file holds an exclusive flock on path (a live run's OUT/.lock)."""
    import fcntl
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def _check_folder_can_exist(flag, path):
    """A folder that exists, or whose nearest existing ancestor is a writable folder (it is created later)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a file: pass a folder (it is created if missing)")
    ancestor = os.path.abspath(path)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ValueError(f"{flag} {path}: {ancestor} is a file, so the folder cannot be created; pass another path")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {ancestor} is not writable; pass another path")


def _schedule(train_cfg):
    return {k: getattr(train_cfg, k) for k in SCHEDULE_FIELDS}


def _schedule_change(saved, train_cfg, step):
    """Megatron-LM refuses a resumed run whose learning-rate schedule differs from its checkpoint's (unless told
    to override); a longer --steps is a common wish, so here it is a warning that says what the learning rate
    does at the step where the run continues: the cosine now ends at the new last step."""
    before = replace(train_cfg, **saved)
    changed = ", ".join(f"--{k.replace('_', '-')} {saved[k]} -> {getattr(train_cfg, k)}" for k in SCHEDULE_FIELDS
                        if saved[k] != getattr(train_cfg, k))
    return (f"resuming with another learning-rate schedule ({changed}): at step {step} the learning rate is "
            f"{lr_at(step, train_cfg):.3g}, where the checkpoint's schedule gives {lr_at(step, before):.3g}")


def _warn(message):
    print(f"train_gpt.py: warning: {message}", file=sys.stderr, flush=True)


def _global_rank():
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def _warn_on_rank_0(message):
    if _global_rank() == 0:
        _warn(message)


def _world_size():
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


# ---- Weights out and in: Hugging Face GPT-2 and nanoGPT ----------------------------------------------------
# An export reads the newest checkpoint that passes every check (or --step N) into a one-process model, as --sample
# does, and writes its weights only; an import (--init-from-hf) fills each rank's slice of every parameter, and its
# FP32 master, from a GPT-2 folder. Our model is GPT-2's computation (pre-LN blocks, LayerNorm eps 1e-5, scale
# 1/sqrt(head_dim), biases everywhere, LM head tied to wte, no dropout) with the exact GELU (erf): the config says
# "activation_function": "gelu", not GPT-2's tanh approximation "gelu_new". The names, whole tensors (h = --hidden):
#
#     ours (model_geometry)   HF GPT2LMHeadModel (Conv1D: (in, out))      nanoGPT (nn.Linear: (out, in))
#     wte.weight (V, h)       transformer.wte.weight; lm_head: tied        transformer.wte.weight, lm_head.weight
#     wpe (seq, h)            transformer.wpe.weight (n_positions = seq)   transformer.wpe.weight (block_size)
#     h.N.ln1, h.N.ln2        transformer.h.N.ln_1, ln_2 (.weight, .bias)  the same
#     h.N.qkv (3h, h): Q;K;V  h.N.attn.c_attn (h, 3h): ours transposed     h.N.attn.c_attn (3h, h): ours
#     h.N.proj (h, h)         h.N.attn.c_proj: transposed                  h.N.attn.c_proj
#     h.N.fc (4h, h)          h.N.mlp.c_fc (h, 4h): transposed             h.N.mlp.c_fc
#     h.N.out (h, 4h)         h.N.mlp.c_proj (4h, h): transposed           h.N.mlp.c_proj
#     ln_f                    transformer.ln_f                             transformer.ln_f
#
# Our QKV weight at TP 1 is Q's rows, then K's, then V's, each (h, h) with the heads in order (ColumnParallelLinear
# with parts=3 splits each block over TP on its own: _slice_geometry sees it as (3, h, h)); GPT-2 splits c_attn's
# output the same way. The vocabulary is kept whole, the rows a TP padding added included (a text model padded to
# 258 exports 258 ids, two that no text uses); so an import takes the folder's vocabulary, which --tp must divide.
# The safetensors file is written and read here (an 8-byte little-endian header length, a JSON header {name: {dtype,
# shape, data_offsets}}, the raw bytes): no dependency, and nothing is unpickled; every value of the header and of
# config.json is checked before use. MoE models have no GPT-2 (or nanoGPT) form: their export is refused.

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
SAFETENSORS_MAX_HEADER = 1 << 27
HF_CONFIG_MAX_BYTES = 1 << 20
HF_SHAPE = {"n_layer": "n_layer", "n_head": "n_head", "n_embd": "n_embd", "n_positions": "seq_len",
            "vocab_size": "vocab_size"}  # config.json's key: GPTConfig's field
HF_ACTIVATIONS = {"gelu": "", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}  # HF name: its approximation
HF_DEFAULTS = {"n_inner": None, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True, "scale_attn_weights": True,
               "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False,
               "activation_function": "gelu_new"}  # GPT2Config's, where config.json omits the key
HF_COMPUTED = {"n_inner": (None,), "layer_norm_epsilon": (1e-5,), "tie_word_embeddings": (True,),  # n_inner: or 4h
               "scale_attn_weights": (True,), "scale_attn_by_inverse_layer_idx": (False,),
               "add_cross_attention": (False,), "activation_function": tuple(HF_ACTIVATIONS)}
HF_BUFFERS = re.compile(r"h\.[0-9]+\.attn\.(bias|masked_bias)")  # causal masks older GPT-2 files hold: not weights


def gpt2_names(cfg):
    """[(HF name without "transformer.", our name, transposed)] for every weight: the table above."""
    names = [("wte.weight", "wte.weight", False), ("wpe.weight", "wpe", False)]
    for i in range(cfg.n_layer):
        for theirs, ours, conv in (("ln_1", "ln1", False), ("attn.c_attn", "qkv", True),
                                   ("attn.c_proj", "proj", True), ("ln_2", "ln2", False),
                                   ("mlp.c_fc", "fc", True), ("mlp.c_proj", "out", True)):
            names += [(f"h.{i}.{theirs}.weight", f"h.{i}.{ours}.weight", conv),
                      (f"h.{i}.{theirs}.bias", f"h.{i}.{ours}.bias", False)]
    return names + [("ln_f.weight", "ln_f.weight", False), ("ln_f.bias", "ln_f.bias", False)]


def gpt2_shapes(cfg):
    """{HF name: shape} of a GPT-2 of cfg's shape (Conv1D weights (in, out)): ours (model_geometry; QKV's (3, ...)
    as (3h, ...)), transposed where GPT-2 has a Conv1D."""
    geometry = model_geometry(cfg)
    ours = {name: [s[0] * s[1], *s[2:]] if ".qkv." in name else list(s) for name, s in geometry.items()}
    return {theirs: ours[name][::-1] if conv else ours[name] for theirs, name, conv in gpt2_names(cfg)}


def _whole_weights(stage):
    """{our name: the whole parameter} of a one-process stage (the tied head is wte itself)."""
    return {name: p.detach().float().cpu() for name, p, tied_copy in _saved_params(stage) if not tied_copy}


def hf_config(cfg):
    """GPT2LMHeadModel's config.json for our model: the shape, the exact GELU, eps 1e-5, no dropout, tied head."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
            "n_positions": cfg.seq_len, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
            "n_inner": None, "activation_function": "gelu", "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0,
            "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.02, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False, "tie_word_embeddings": True,
            "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32"}


def safetensors_chunks(tensors, metadata=None):
    """The safetensors file of {name: tensor}, as chunks to write one after another (so that no copy of the whole
    model is made): the header's length (8 bytes, little-endian), the JSON header (padded with spaces to a multiple
    of 8, so every tensor starts aligned), then each tensor's bytes in header order (a contiguous CPU copy of one
    tensor at a time; none where it is one already)."""
    dtype_names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
    header, offset = {"__metadata__": dict(metadata or {})}, 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": dtype_names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    yield len(text).to_bytes(8, "little") + text
    for t in tensors.values():
        yield t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()


def _write_file(path, write, flag):
    """Write a whole file or leave the old one: write(f) fills a temporary beside it (created exclusively, never
    through a link; streaming: no copy of the whole file in memory), synced, renamed over it. A failure (a full
    disk, /proc) removes the temporary and is OutputRefused, one line."""
    check_output_name(flag, path)  # checked before the checkpoint was read, and again now
    tmp, made = path + ".tmp", False
    try:
        fd = create_exclusive(tmp)
        made = True
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as a RuntimeError
        if isinstance(e, RuntimeError) and not made:
            raise
        if made:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        raise OutputRefused(f"{flag} {path} could not be written ({why}): nothing was written in its place") from None


def read_safetensors_header(path, shapes):
    """The checked header of a safetensors file: {HF name without "transformer.": (dtype, shape, begin, end) in the
    file}, for exactly the tensors `shapes` names ({name: shape}), each of a known float dtype, of that shape, its
    bytes inside the file and as many as its shape needs. Names with the prefix "transformer." or without (older
    GPT-2 files), the causal-mask buffers of older files and a tied lm_head.weight are allowed. Raises
    BadCheckpoint, one line naming the file."""
    st = input_file("--init-from-hf", path, BadCheckpoint)

    def bad(why):
        return BadCheckpoint(f"--init-from-hf: {path}: {why}")
    with open(path, "rb") as f:
        prefix = f.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else None
        if length is None or not 2 <= length <= min(st.st_size - 8, SAFETENSORS_MAX_HEADER):
            raise bad(f"its header length {length} does not fit its {st.st_size} bytes: not a safetensors file")
        text = f.read(length)
    if json_depth(text) > 3:
        raise bad(f"its header nests {json_depth(text)} deep, where safetensors nests 3")

    def no_name_twice(pairs):  # json.loads would keep the last of two entries of one name without a word
        names = [k for k, _ in pairs]
        if len(set(names)) != len(names):
            twice = next(k for k in names if names.count(k) > 1)
            raise bad(f"its header names {twice!r} twice")
        return dict(pairs)
    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=no_name_twice)
    except (UnicodeDecodeError, ValueError) as e:
        if isinstance(e, BadCheckpoint):
            raise
        raise bad(f"its header is not valid JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise bad("its __metadata__ is not an object of strings")
    data_bytes, entries = st.st_size - 8 - length, {}
    prefix = "transformer." if "transformer.wte.weight" in header else ""
    for key, entry in header.items():
        name = key[len(prefix):] if key.startswith(prefix) else key
        if not (isinstance(entry, dict) and set(entry) == {"dtype", "shape", "data_offsets"}):
            raise bad(f"tensor {key!r} is not described by exactly dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in SAFETENSORS_DTYPES:
            raise bad(f"tensor {key!r} is {dtype!r}; the weights can be one of {sorted(SAFETENSORS_DTYPES)}")
        if not (isinstance(shape, list) and len(shape) <= 8 and all(_int(0, 1 << 40)[0](n) for n in shape)):
            raise bad(f"tensor {key!r} has the shape {shape!r}, not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_int(0)[0](o) for o in offsets)
                and offsets[0] <= offsets[1] <= data_bytes):
            raise bad(f"tensor {key!r} lies at {offsets!r}, outside the file's {data_bytes} bytes of data")
        size = math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != size:
            raise bad(f"tensor {key!r} of shape {shape} and {dtype} takes {size} bytes, its offsets span "
                      f"{offsets[1] - offsets[0]}")
        if name in shapes and shape != list(shapes[name]):
            raise bad(f"tensor {key!r} has the shape {shape}, where config.json's model has {list(shapes[name])}")
        if name not in shapes and not (HF_BUFFERS.fullmatch(name) or (name == "lm_head.weight" and
                                                                      shape == list(shapes["wte.weight"]))):
            raise bad(f"tensor {key!r} is no weight of a GPT-2 of config.json's shape")
        entries[name] = (SAFETENSORS_DTYPES[dtype], shape, 8 + length + offsets[0], 8 + length + offsets[1], key)
    missing = [name for name in shapes if name not in entries]
    if missing:
        raise bad(f"tensor {prefix + missing[0]!r} is missing ({len(missing)} of the model's are)")
    at = 8 + length  # as the safetensors format has it: the tensors' bytes follow one another, from the header's end
    for _, _, begin, end, key in sorted(entries.values(), key=lambda e: e[2:4]):  # to the file's end, exactly
        if begin != at:
            raise bad(f"tensor {key!r} begins at byte {begin - 8 - length:,} of the data, where the tensor "
                      f"before it ends at {at - 8 - length:,}: " + ("tensors overlap" if begin < at else
                                                                    "bytes that no tensor indexes"))
        at = end
    if at != st.st_size:
        raise bad(f"its last {st.st_size - at:,} bytes are indexed by no tensor")
    return entries


def _blocks_in_header(path):
    """How many blocks (h.N.) a safetensors header names, from its raw text (a cheap look before the header is checked
    against a model: None if it cannot be read; read_safetensors_header then says why)."""
    try:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 2 <= length <= min(os.fstat(f.fileno()).st_size - 8, SAFETENSORS_MAX_HEADER):
                return None
            layers = {int(n) for n in re.findall(rb'"(?:transformer\.)?h\.([0-9]{1,9})\.', f.read(length))}
    except OSError:
        return None
    return max(layers) + 1 if layers else 0


def _read_tensor(path, entry):
    dtype, shape, begin, end = entry[:4]
    with open(path, "rb") as f:
        f.seek(begin)
        data = bytearray(f.read(end - begin))
    if len(data) != end - begin:
        raise BadCheckpoint(f"--init-from-hf: {path} was cut short while it was read")
    return torch.frombuffer(data, dtype=dtype).view(shape) if data else torch.empty(shape, dtype=dtype)


def read_hf_config(folder, say=None):
    """The model shape of a GPT-2 folder's config.json as GPTConfig fields, every value checked: the shape keys
    integers in range, and nothing our model cannot compute (an untied head, another LayerNorm eps, another
    attention scale, an MLP other than 4h). GPT-2's own tanh GELU is accepted with a warning: this run computes
    the exact one (as nanoGPT does with GPT-2's weights), told through `say`. Raises ValueError, one line."""
    path = os.path.join(folder, "config.json")
    input_file("--init-from-hf", path)
    if os.path.getsize(path) > HF_CONFIG_MAX_BYTES:
        raise ValueError(f"--init-from-hf: {path} is larger than any GPT-2 config ({HF_CONFIG_MAX_BYTES} bytes)")
    data = _read_bytes("--init-from-hf", path)
    if json_depth(data) > JSON_MAX_DEPTH:
        raise ValueError(f"--init-from-hf: {path} nests {json_depth(data)} deep")
    try:
        config = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"--init-from-hf: {path} is not valid JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(config, dict) or config.get("model_type") != "gpt2":
        raise ValueError(f"--init-from-hf: {path} is not a GPT-2 config (\"model_type\": \"gpt2\")")
    shape = {}
    for key, field in HF_SHAPE.items():
        if not _int(1, 1 << 24)[0](config.get(key)):
            raise ValueError(f"--init-from-hf: {path}: {key!r} is {config.get(key)!r}, not an integer from 1 to "
                             f"{1 << 24}")
        shape[field] = config[key]
    for key, allowed in HF_COMPUTED.items():
        value = config.get(key, HF_DEFAULTS[key])
        if not any(type(value) is type(ok) and value == ok for ok in allowed + ((4 * shape["n_embd"],) if key ==
                                                                              "n_inner" else ())):
            raise ValueError(f"--init-from-hf: {path}: {key!r} is {value!r}, which this model does not compute (a 4h "
                             "MLP, LayerNorm eps 1e-5, attention scale 1/sqrt(head_dim), a tied head, the GELU)")
    activation = config.get("activation_function", HF_DEFAULTS["activation_function"])
    if say and HF_ACTIVATIONS[activation]:
        say(f"--init-from-hf: {path} was trained with the tanh GELU ({activation}); this run computes the exact one")
    return shape


def config_from_hf(folder, cfg, given):
    """cfg with the shape of the GPT-2 folder: config.json, then the safetensors header checked against it (and a
    lm_head.weight, if the file holds one, equal to wte: tied). A shape flag in `given` ({GPTConfig field: the value
    passed}) that disagrees is refused in one line. Before any process group."""
    shape = {**read_hf_config(folder, say=_warn_on_rank_0), "moe_every": 0}
    for field, value in given.items():
        if field in shape and value != shape[field]:
            flag = SHAPE_FLAGS[field]
            raise ValueError(f"--init-from-hf {folder} holds a GPT-2 with {flag} {shape[field]}, and this run has "
                             f"{flag} {value}: omit {flag} (the shape comes from config.json)")
    cfg = replace(cfg, **shape)
    hf_entries(folder, cfg)
    return cfg


def hf_entries(folder, cfg):
    """(the safetensors file, its entries) checked against cfg's GPT-2 shapes; a lm_head.weight, if the file holds
    one, must equal wte (this model ties them)."""
    path = os.path.join(folder, "model.safetensors")
    blocks = _blocks_in_header(path)  # before a model of config.json's shape is built (65536 layers take minutes)
    if blocks is not None and blocks != cfg.n_layer:
        raise BadCheckpoint(f"--init-from-hf: {os.path.join(folder, 'config.json')} says n_layer {cfg.n_layer}, "
                            f"and {path} holds the weights of {blocks} blocks")
    entries = read_safetensors_header(path, gpt2_shapes(cfg))
    if "lm_head.weight" in entries and not torch.equal(_read_tensor(path, entries["lm_head.weight"]),
                                                       _read_tensor(path, entries["wte.weight"])):
        raise BadCheckpoint(f"--init-from-hf: {path}: lm_head.weight differs from wte.weight; this model ties them")
    return path, entries


def load_hf_weights(folder, stage, opt=None):
    """Initialise this rank's stage (and the optimizer's masters) from a GPT-2 folder, at any layout: each
    parameter's whole tensor is read, turned into ours (Conv1D transposed, QKV viewed as (3, h, h)), and this rank's
    slice of it (_slice_geometry) is handed to the optimizer as the parameter's master (load_full_state: the working
    weight and the master, ZeRO shards included, written as a checkpoint load writes them), then published. Only the
    tensors of this stage are read. Call it before the first step, on every rank."""
    cfg, parallel_state = stage.cfg, stage.plan.parallel_state
    shape = read_hf_config(folder)  # checked again: train() may be called without main's checks
    if any(getattr(cfg, field) != value for field, value in shape.items()) or cfg.moe_every:
        raise ValueError(f"--init-from-hf {folder} holds a GPT-2 of shape {shape}; this model is another: build it "
                         "from config_from_hf")
    path, entries = hf_entries(folder, cfg)
    theirs = {ours: (name, conv) for name, ours, conv in gpt2_names(cfg)}
    error = None
    with torch.no_grad():
        for name, p, _ in _saved_params(stage):
            hf_name, conv = theirs[name]
            whole = _read_tensor(path, entries[hf_name])
            error = _weight_fault(path, entries[hf_name][4], whole)
            if error:
                break
            shape_now, offsets, whole_shape = _slice_geometry(p, parallel_state)
            whole = (whole.t() if conv else whole).reshape(whole_shape)
            local = whole[tuple(slice(o, o + n) for o, n in zip(offsets, shape_now))].reshape(p.shape)
            if opt is None:
                p.copy_(local)
            else:
                opt.load_full_state(p, {"master": local})
        agreed_error(error)  # each rank reads its stage's tensors: all stop, with the one that found it's line
        if opt is not None:
            opt.copy_masters_to_params()


HF_MAX_WEIGHT = 65504.0  # float16's largest value: every --dtype holds it; no trained GPT-2 comes near


def _weight_fault(path, name, t):
    """Why a weight read from a GPT-2 file cannot start a run (a NaN, an infinity, a value past HF_MAX_WEIGHT, which
    overflows the first LayerNorm's square or FP16 at once), or None."""
    bad = ~torch.isfinite(t)
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        return (f"--init-from-hf: {path}: tensor {name!r} holds {int(bad.sum()):,} non-finite value(s) (the first, "
                f"{t.flatten()[i].item()}, at element {i}): a model to start from holds finite weights")
    big = t.abs() > HF_MAX_WEIGHT
    if big.any():
        i = int(big.flatten().nonzero()[0])
        return (f"--init-from-hf: {path}: tensor {name!r} holds {int(big.sum()):,} value(s) beyond +-{HF_MAX_WEIGHT:g} "
                f"(the first, {t.flatten()[i].item():g}, at element {i}), the largest every --dtype holds: not a "
                "trained model's weights")
    return None


def agreed_error(error):
    """Raise BadCheckpoint on every rank if any rank found an error (a string), with the lowest such rank's line."""
    every = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, error)
    first = next((e for e in every if e), None)
    if first:
        raise BadCheckpoint(first)


def export_source(out_dir, step, world, hf_dir=None, nanogpt_file=None):
    """The checkpoint an export reads, and its train_state: --step N's, or the newest that passes every check
    (its checksums included; each newer one skipped is told in one line, as --resume and --sample do). The outputs
    are checked first: a folder for --export-hf, a file for --export-nanogpt, neither inside a checkpoint."""
    flag = "--export-hf" if hf_dir else "--export-nanogpt"
    if nanogpt_file and (os.path.isdir(nanogpt_file) or nanogpt_file.endswith(os.sep)):
        raise ValueError(f"--export-nanogpt {nanogpt_file} is a folder: pass a file name")
    outputs = [("--export-hf", hf_dir, os.path.join(hf_dir, name)) for name in ("model.safetensors", "config.json")
               if hf_dir] + ([("--export-nanogpt", nanogpt_file, nanogpt_file)] if nanogpt_file else [])
    for what, given, path in outputs:
        folder = os.path.dirname(path) or "."
        _check_folder_can_exist(what, folder)  # a folder, or one that can be made: before anything is read
        if _inside_checkpoint(folder):
            raise ValueError(f"{what} {given} lies inside a checkpoint: pass a path outside the checkpoint folders")
        check_output_name(what, path)
        _try_writing(what, given, folder)
    if step is None:
        path, state = sample_checkpoint(out_dir, world, flag)
    else:
        _one_process_reader(out_dir, world, flag)
        paths = [p for p in checkpoint_dirs(out_dir) if int(os.path.basename(p)[5:]) == step]
        if not paths:
            raise ValueError(f"{flag}: --out-dir {out_dir} holds no checkpoint of --step {step}")
        path, state = paths[0], verified_for_reading(paths[0])
    data = state["data"] if state["data"] not in ("embedded", "synthetic") and os.path.exists(state["data"]) else None
    if data:  # what the checkpoint was trained on (its path as the run gave it) is an input, never an output
        data = os.path.realpath(data)
        data_folder = data if os.path.isdir(data) else os.path.dirname(data) if data.endswith(".bin") else None
        for what, given, out in outputs:
            out = os.path.realpath(out)
            if out == data or (data_folder and _inside(out, data_folder)):
                raise ValueError(f"{what} {given} would write into the --data {state['data']} that checkpoint {path} "
                                 "was trained on (a resumed run would read it): pass a path outside it")
    if state["config"]["moe_every"]:
        raise ValueError(f"{flag}: checkpoint {path} holds a mixture-of-experts model (--moe-every "
                         f"{state['config']['moe_every']}), which has no {'GPT-2' if hf_dir else 'nanoGPT'} form: "
                         "only dense models export")
    return path, state


def _try_writing(flag, given, folder):
    """A file can be created in `folder` (or in its nearest existing ancestor, where it is to be made): /proc, /sys,
    a read-only mount refuse what access() allows. The probe file is removed at once."""
    while not os.path.isdir(folder):
        folder = os.path.dirname(os.path.abspath(folder))
    probe = os.path.join(folder, f".train_gpt_probe_{os.getpid()}")
    try:
        os.close(create_exclusive(probe))
        os.unlink(probe)
    except OSError as e:
        raise OutputRefused(f"{flag} {given}: nothing can be written in {folder} ({e.strerror}): pass another "
                            "path") from None


def export_weights(path, state, hf_dir=None, nanogpt_file=None):
    """Write the checkpoint's weights as a Hugging Face GPT-2 folder (config.json, model.safetensors, FP32) and/or
    nanoGPT's ckpt.pt; returns what was written, one line each."""
    cfg = GPTConfig(**state["config"])
    _, stage, _, _ = build(cfg, TrainConfig(batch=1, micro_batch=1, log=False), optimizer=False)
    load_checkpoint(path, stage)
    done_reading()  # loaded: --keep-last may delete it now
    ours, done = _whole_weights(stage), []
    if hf_dir:
        tensors = {}
        for theirs, name, conv in gpt2_names(cfg):
            tensors["transformer." + theirs] = ours[name].t() if conv else ours[name]  # made contiguous one by one
        _make_folder("--export-hf", hf_dir)
        _write_file(os.path.join(hf_dir, "model.safetensors"),
                    lambda f: f.writelines(safetensors_chunks(tensors, {"format": "pt"})), "--export-hf")
        config = (json.dumps(hf_config(cfg), indent=2) + "\n").encode()
        _write_file(os.path.join(hf_dir, "config.json"), lambda f: f.write(config), "--export-hf")
        done.append(f"wrote {hf_dir}: config.json, model.safetensors ({len(tensors)} tensors, "
                    f"{parameter_count(cfg):,} parameters) from {path}")
    if nanogpt_file:
        model = {"transformer." + theirs: ours[name].clone() for theirs, name, _ in gpt2_names(cfg)}
        model["lm_head.weight"] = model["transformer.wte.weight"]  # tied: one tensor under both names, as nanoGPT
        model_args = dict(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, block_size=cfg.seq_len,
                          bias=True, vocab_size=cfg.vocab_size, dropout=0.0)
        if os.path.dirname(nanogpt_file):
            _make_folder("--export-nanogpt", os.path.dirname(nanogpt_file))
        checkpoint = {"model_args": model_args, "model": model, "iter_num": state["step"], "best_val_loss": None,
                      "config": {}}
        _write_file(nanogpt_file, lambda f: torch.save(checkpoint, f), "--export-nanogpt")
        done.append(f"wrote {nanogpt_file}: nanoGPT's model_args and model ({len(model)} entries) from {path}")
    return done


def _make_folder(flag, folder):
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise OutputRefused(f"{flag}: the folder {folder} cannot be made ({e.strerror}): pass another path") from None


# ---- Sampling ----------------------------------------------------------------------------------------------

def _one_process_reader(out_dir, world, flag):
    if world != 1:
        raise ValueError(f"{flag} runs on one process: use python, not torchrun")
    if not out_dir:
        raise ValueError(f"{flag} needs --out-dir, the folder of the checkpoints to "
                         f"{'sample from' if flag == '--sample' else 'export'}")


def sample_checkpoint(out_dir, world, flag="--sample"):
    """The checkpoint --sample (or an export, `flag`) reads, and its train_state: the newest that passes every
    check, its tensor files' checksums included (the fallback of --resume: each newer one skipped is told in one
    line)."""
    _one_process_reader(out_dir, world, flag)
    path, state = newest_passing(out_dir, verified_for_reading, say=_warn)  # locked until loaded: --keep-last waits
    if path is None:
        raise ValueError(f"{flag} needs a checkpoint: --out-dir {out_dir} holds none")
    return path, state


def sampling_model(cfg, path):
    """A one-process model with the weights of a checkpoint of any layout (checked, and its checksums verified, first;
    then the folder's reading lock is released), and whether it was trained on bytes of text."""
    _, stage, _, _ = build(cfg, TrainConfig(batch=1, micro_batch=1, log=False), optimizer=False)
    state = load_checkpoint(path, stage)
    done_reading()
    return stage, state["text"]


@torch.no_grad()
def draw(stage, ids, n, temperature=1.0, top_k=None, text=False, seed=0):
    """Yield n tokens, each as soon as it is drawn, continuing `ids` (the model reads the last --seq of them): a model
    trained on bytes of text draws bytes only (a vocabulary padded for TP, e.g. 258, has ids no text uses)."""
    cfg, device = stage.cfg, next(stage.parameters()).device
    gen = torch.Generator().manual_seed(seed)  # draws on the CPU: the same random draws on every device
    ids = list(ids[-cfg.seq_len:])
    for _ in range(n):
        context = torch.tensor([ids[-cfg.seq_len:]], device=device)
        logits, _ = stage(context, torch.arange(context.shape[1], device=device))
        logits = logits[0, -1].float().cpu() / max(temperature, 1e-6)
        if text:
            logits[256:] = -float("inf")
        if top_k:
            logits[logits < logits.topk(min(top_k, logits.numel())).values[-1]] = -float("inf")
        ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)))
        del ids[:-cfg.seq_len]
        yield ids[-1]


def sample(cfg, path, n, temperature=1.0, top_k=None, prompt="\n", seed=0):
    """Generate n tokens on one process from a checkpoint of any layout: a text model's as text, any other model's
    as token ids, drawn after the prompt's ids (token 0 without one)."""
    stage, text = sampling_model(cfg, path)
    try:
        ids = prompt_ids(prompt, text, cfg.vocab_size)
    except ValueError:  # text given to a token model (the command line refuses it before): drawn after token 0
        ids = [0]
    generated = list(draw(stage, ids, n, temperature, top_k, text, seed))
    return bytes(generated).decode("utf-8", errors="replace") if text else generated


def prompt_ids(prompt, text, vocab):
    """The ids a sample continues: a text model's prompt as bytes (a str as the bytes it came from: os.fsencode), a
    token model's as ids separated by whitespace (token 0 when there is none). A ValueError names what is wrong."""
    data = prompt if isinstance(prompt, bytes) else os.fsencode(prompt)
    if text:
        return [i for i in data if i < vocab] or [0]
    words = data.split()
    bad = next((w for w in words if not re.fullmatch(rb"[0-9]{1,9}", w) or int(w) >= vocab), None)
    if bad is not None:
        shown = bad[:20].decode(errors="replace") + ("..." if len(bad) > 20 else "")
        raise ValueError(f"--prompt: {shown!r} is not a token id: this checkpoint's model reads token ids, not text: "
                         f"pass ids between 0 and {vocab - 1} separated by spaces")
    return [int(w) for w in words] or [0]


def _last_words(path, n, block=1 << 16):
    """The last n whitespace-separated words of a file, and whether it holds more: read from its end a block at a time,
    keeping whole words only (never the whole file); a word longer than any token id stops the reading."""
    with open(path, "rb") as f:
        end, data = f.seek(0, os.SEEK_END), b""
        while end and len(data.split()) <= n and not any(len(w) > 20 for w in data.split()[:1]):
            start = max(0, end - block)
            f.seek(start)
            data = f.read(end - start) + data
            end = start
            if data[:1].isspace():  # the block began between words: keep the words, not the spaces
                data = b" " + b" ".join(data.split()[-(n + 1):])
    words = data.split()
    return words[-n:], len(words) > n or (end > 0 and bool(words))


def prompt_bytes(flags, cfg, text):
    """What a sample continues, as bytes: --prompt as given, or of --prompt-file only what the model reads (its last
    --seq bytes for a text model, its last --seq ids otherwise), read from the file's end (a huge file is never read
    whole; the rest is said in one line)."""
    if flags.prompt_file is None:
        return None if flags.prompt is None else os.fsencode(flags.prompt)
    path, n = flags.prompt_file, cfg.seq_len
    try:
        size = input_file("--prompt-file", path).st_size
        if text:
            with open(path, "rb") as f:
                f.seek(max(0, size - n))
                data, more = f.read(n), size > n
        else:
            words, more = _last_words(path, n)
            data = b" ".join(words)
    except OSError as e:
        raise ValueError(f"--prompt-file {path} cannot be read ({e.strerror})") from None
    if more:
        _warn(f"--prompt-file {path} ({size:,} bytes) holds more than the model reads: its last {n} "
              f"{'bytes' if text else 'ids'} (--seq {n}) are read and shown, not the rest")
    return data


def stream_sample(cfg, path, flags, text, prompt):
    """--sample: the prompt, then each token as it is drawn, written to stdout at once (a text model's as the bytes
    they are); returns the rest of the output (main prints it: a newline). A closed pipe ends the drawing quietly."""
    ids = prompt_ids(b"\n" if prompt is None else prompt, text, cfg.vocab_size)
    stage, _ = sampling_model(cfg, path)
    sys.stdout.flush()
    out = sys.stdout.buffer
    try:
        if text and prompt:
            out.write(prompt)
        for i, token in enumerate(draw(stage, ids, flags.sample, flags.temperature, flags.sample_top_k, text,
                                       flags.seed)):
            out.write(bytes([token]) if text else f"{' ' if i else ''}{token}".encode())
            out.flush()
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return ""


# ---- The command line, and how a job ends ------------------------------------------------------------------

class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help: every flag with its sentence and its default, the choices once."""


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line on rank 0, exit code 2 (see main), not a usage block per rank
        raise ValueError(message)


SHOW_SCHEDULE_MAX_ACTIONS = 4096
SAMPLE_MAX_TOKENS = 1_000_000  # --sample: a million tokens, about a quarter of an hour on a CPU


def job_without_training(train_cfg, flags, world):
    """--sample, --export-hf or --export-nanogpt: its checkpoint found and checked now, before any process group (one
    line if none passes), and the function that runs it and returns what to print; None for a training run."""
    if flags.sample:
        path, state = sample_checkpoint(train_cfg.out_dir, world)
        cfg = GPTConfig(**state["config"])
        prompt = prompt_bytes(flags, cfg, state["text"])
        prompt_ids(b"\n" if prompt is None else prompt, state["text"], cfg.vocab_size)  # a bad one: one line now
        return lambda: stream_sample(cfg, path, flags, state["text"], prompt)
    if flags.export_hf or flags.export_nanogpt:
        path, state = export_source(train_cfg.out_dir, flags.step, world, flags.export_hf, flags.export_nanogpt)
        return lambda: "\n".join(export_weights(path, state, flags.export_hf, flags.export_nanogpt))
    return None


JOB_FLAG_GROUPS = ("model", "parallelism (DP is the world over TP x CP x PP)", "pipeline schedule", "precision",
                   "memory", "data and optimisation", "checkpoints and weights", "sampling", "run")


def parse_job_args(argv=None):
    """The whole program's command line: the chapter's flags (`chapter_flags`), the at-scale forms' and the job's;
    returns (GPTConfig, JobConfig, the flags)."""
    ap = _ArgumentParser(description="Train a GPT with TP x CP x DP x PP (DP = world / (tp*cp*pp)) by torchrun; "
                         "sample from, export or show what it trains.", formatter_class=_HelpFormatter)
    choices = {"cp_impl": sorted(ALL_CP_IMPLS), "dtype": list(DTYPES), "fp8_recipe": mixed_precision.FP8_RECIPES,
               "zero": [0, 1, 2, 3], "recompute": list(RECOMPUTE)}
    group = chapter_flags(ap, JOB_FLAG_GROUPS, choices, more_help={
        "fp8_recipe": "; rowwise, blockwise: DeepSeek-V3's tiles, mxfp8",
        "zero": "; 2: and the gradients; 3: and the blocks' parameters (gathered for each use)",
        "recompute": "; offload: every block's saved activations wait in host memory (pinned, copied on a side "
                     "stream on CUDA), selective+offload: all but the attention core's, which is recomputed",
        "data": "; or a text file, a folder of text, or a folder with nanoGPT's train.bin and val.bin",
        "metrics": " (default: --out-dir/metrics.jsonl; without --out-dir, none is written)"})
    group["model"]("--init-from-hf", default=None, metavar="DIR", help="start from the weights of a GPT-2 folder, at "
                   "any layout; the model's shape comes from its config.json")
    group["model"]("--moe-grouped-gemm", action="store_true", help="run each MoE layer's local experts as one "
                   "grouped GEMM, torch._grouped_mm where it runs (Megatron-LM's flag; else the experts' loop)")
    group["parallelism (DP is the world over TP x CP x PP)"]("--cp-ulysses", type=int, default=1, help="--cp-impl "
                                                             "hybrid: the Ulysses ranks inside each CP group")
    schedule = group["pipeline schedule"]
    schedule("--pp-schedule", default="1f1b", choices=ALL_SCHEDULES, help="1f1b, interleaved (Megatron-LM), zb-h1 "
             "(zero bubble), or the V-shaped zbv (ZB-V) and dualpipev (DualPipeV), with --virtual-stages 2")
    schedule("--virtual-stages", type=int, default=1, help="model chunks per pipeline rank (interleaved, zb-h1; 2 "
             "for zbv and dualpipev)")
    schedule("--show-schedule", action="store_true", help="print the schedule's timeline for --pp, --micro-batches, "
             "--pp-schedule and --virtual-stages, with its bubble and in-flight peaks, and exit (no process group)")
    schedule("--micro-batches", type=int, default=None, help="with --show-schedule: m (a run's is batch / (dp "
             "micro_batch); default 8)")
    precision = group["precision"]
    precision("--fp8-backward", default="bf16", choices=mixed_precision.FP8_BACKWARDS, help="with --dtype fp8: the "
              "backward GEMMs in BF16, or in FP8 with E5M2 gradients at the recipe's granularity")
    precision("--fp8-param-gather", action="store_true", help="with --zero 1, 2 or 3: all-gather the weights in FP8 "
              "(MXFP8: E4M3 and one power-of-two scale per 32)")
    precision("--nvfp4-bf16-last", type=int, default=None, metavar="K", help="with --dtype nvfp4: the last K blocks "
              "stay BF16, as the LM head and the experts do (default: the last 15 %%, rounded)")
    group["memory"]("--zero-shard-size", type=int, default=None, help="hybrid sharding: shard over groups of this "
                    "many DP x CP ranks (one node, say), replicate across them (default: all of them)")
    group["memory"]("--memory-report", action="store_true", help="measure step 2's peak per rank and part from the "
                    "live tensors (on CUDA also max_memory_allocated) and print it beside topology.py's prediction")
    group["data and optimisation"]("--eval-every", type=int, default=0, help="steps between validation losses (0: "
                                   "none)")
    group["data and optimisation"]("--eval-batches", type=int, default=4, help="batches per validation loss")
    weights = group["checkpoints and weights"]
    weights("--out-dir", default=None, help="the folder of the checkpoints (and, by default, of the metrics)")
    weights("--save-every", type=int, default=0, help="steps between checkpoints (0: only at the end)")
    weights("--keep-last", type=int, default=0, help="keep only the newest N checkpoints (0: every one; the newest "
            "that passes its checks is never deleted)")
    weights("--resume", action="store_true", help="continue from the newest checkpoint in --out-dir that passes its "
            "checks")
    weights("--async-save", action="store_true", help="copy each checkpoint to host memory (pinned on CUDA) and "
            "write it in the background while training goes on (Megatron-LM's --async-save)")
    weights("--export-hf", default=None, metavar="DIR", help="write --out-dir's newest good checkpoint (or --step's) "
            "as a Hugging Face GPT-2 folder (config.json, model.safetensors) and exit; dense models")
    weights("--export-nanogpt", default=None, metavar="FILE", help="the same as nanoGPT's ckpt.pt")
    weights("--step", type=int, default=None, help="with --export-hf/--export-nanogpt: the checkpoint of this step "
            "(default: the newest good one)")
    sampling = group["sampling"]
    sampling("--sample", type=int, default=None, help="draw this many tokens (bytes for a text model) from "
             "--out-dir's newest checkpoint that passes its checks, print them and exit")
    sampling("--prompt", default=None, help="the text the sample continues (default: a newline)")
    sampling("--prompt-file", default=None, help="read the prompt from this file")
    sampling("--temperature", type=float, default=0.8, help="divides the logits before sampling")
    sampling("--sample-top-k", type=int, default=50, help="sample among the k likeliest tokens (0: all; 1: greedy)")
    flags = ap.parse_args(argv)
    if flags.micro_batches is not None and not flags.show_schedule:
        raise ValueError("--micro-batches goes with --show-schedule; a run has batch / (dp micro_batch) micro-batches")
    if flags.show_schedule:
        m = 8 if flags.micro_batches is None else flags.micro_batches
        for flag, value in (("--pp", flags.pp), ("--micro-batches", m), ("--virtual-stages", flags.virtual_stages)):
            if value < 1:
                raise ValueError(f"{flag} {value} must be a positive integer")
        if flags.pp * m * flags.virtual_stages > SHOW_SCHEDULE_MAX_ACTIONS:  # the picture has a column per time slot
            raise ValueError(f"--show-schedule draws --pp x --micro-batches x --virtual-stages = "
                             f"{flags.pp * m * flags.virtual_stages:,} forward actions, more than a screen can show "
                             f"({SHOW_SCHEDULE_MAX_ACTIONS:,}): pass smaller values")
        error = schedule_error(flags.pp_schedule, flags.pp, m, flags.virtual_stages)
        if error:
            raise ValueError(error.replace("m = batch / (dp micro_batch)", "--micro-batches"))
        flags.micro_batches = m
    for flag in ("--out-dir", "--data", "--metrics", "--init-from-hf", "--export-hf", "--export-nanogpt",
                 "--prompt-file"):  # an unset shell variable ($OUT) gives '': never taken for "none"
        if getattr(flags, flag[2:].replace("-", "_")) == "":
            raise ValueError(f"{flag} '' is an empty path (an unset shell variable?): pass a path, or omit {flag}")
    if flags.sample is not None and not 1 <= flags.sample <= SAMPLE_MAX_TOKENS:
        raise ValueError(f"--sample {flags.sample} must be between 1 and {SAMPLE_MAX_TOKENS:,}: the number of tokens "
                         "to draw (omit it to train)")
    if flags.sample and (flags.export_hf or flags.export_nanogpt):
        raise ValueError("--sample draws from a checkpoint and --export-hf/--export-nanogpt write one out: pass one "
                         "of them per run")
    if not (math.isfinite(flags.temperature) and flags.temperature > 0) or flags.sample_top_k < 0:
        raise ValueError("--sample-top-k must be >= 0 and --temperature finite and > 0 (e.g. --sample 300 "
                         "--temperature 0.8 --sample-top-k 50; --sample-top-k 0 samples from every token)")
    if flags.metrics is None and flags.out_dir:  # beside the checkpoints it describes; no --out-dir: none
        flags.metrics = os.path.join(flags.out_dir, "metrics.jsonl")
    if flags.keep_last < 0:
        raise ValueError(f"--keep-last {flags.keep_last} must be >= 0 (0 keeps every checkpoint)")
    if flags.prompt is not None and flags.prompt_file is not None:
        raise ValueError("--prompt and --prompt-file both give the prompt: pass one")
    if (flags.prompt is not None or flags.prompt_file is not None) and not flags.sample:
        raise ValueError("--prompt and --prompt-file go with --sample N")
    if flags.prompt_file is not None:  # checked now; the sample reads what its model reads (its last --seq tokens)
        input_file("--prompt-file", flags.prompt_file)
    if flags.step is not None and not (flags.export_hf or flags.export_nanogpt):
        raise ValueError("--step goes with --export-hf or --export-nanogpt (training runs --steps)")
    flags.shape_given = {}  # --init-from-hf: the shape flags passed, each to agree with config.json
    if flags.init_from_hf:
        ap.set_defaults(**{flag[2:].replace("-", "_"): None for flag in SHAPE_FLAGS.values()})
        given = vars(ap.parse_args(argv))
        flags.shape_given = {field: given[flag[2:].replace("-", "_")] for field, flag in SHAPE_FLAGS.items()
                             if given[flag[2:].replace("-", "_")] is not None}
    cfg, job_cfg = configs_of(flags, JobConfig)
    return (*_without_a_gone_hf_folder(flags, cfg, job_cfg), flags)


def _without_a_gone_hf_folder(flags, cfg, job_cfg):
    """A restarted --init-from-hf job (--resume) whose checkpoint holds the weights needs no Hugging Face folder: if
    that folder is gone, the run goes on from the checkpoint (its shape, where no flag gives one), said once."""
    if not (flags.init_from_hf and flags.resume and flags.out_dir) or os.path.lexists(flags.init_from_hf):
        return cfg, job_cfg
    latest, state = latest_checkpoint(flags.out_dir)
    if latest is None:
        return cfg, job_cfg  # the import then says the folder is missing
    _warn_on_rank_0(f"--init-from-hf {flags.init_from_hf} is gone; --resume continues from {latest}, which holds the "
                    "weights, so the folder is not needed")
    flags.init_from_hf = None
    return (replace(cfg, **{field: state["config"][field] for field in HF_SHAPE.values()
                            if field not in flags.shape_given}), replace(job_cfg, init_from_hf=None))


@contextlib.contextmanager
def ends_in_one_line(rank, torchrun, starting=False):
    """How a job ends: one line and an exit code. While `starting` (the flags, the inputs), a ValueError is a bad
    input: exit 2. Then a bad checkpoint exits 2 (every rank found it: checksums are agreed); a divergence or a save
    that cannot be written 1 (every rank holds the same loss and norm, or agreed not to save); a stall 1 on each rank
    that waited (only they know: each says so, then the job ends now)."""
    try:
        yield
    except ValueError as e:
        if not (starting or isinstance(e, (BadCheckpoint, OutputRefused))):
            raise
        _fail(rank, 2, e)
    except (Diverged, CannotSave) as e:
        _fail(rank, 1, e)
    except Stalled as e:
        if torchrun:
            stop_local_peers()
        _fail(rank, 1, e, everyone=True)


def _fail(rank, code, message, everyone=False):
    """One line on stderr (on rank 0 alone unless `everyone`: what only this rank knows), then exit `code`."""
    if rank == 0 or everyone:
        print(f"train_gpt.py: error: {message}", file=sys.stderr, flush=True)
    else:  # torchrun stops the job at the first exit: let rank 0 say why first
        time.sleep(0.25)
    sys.exit(code)


def watch_launcher(interval_s=0.5):
    """Under torchrun, stop this worker within about interval_s once its launcher is gone (its parent changes: the
    kernel hands an orphan to init or a subreaper): a killed agent must not leave workers training and writing
    checkpoints beside a restarted job. Exiting mid-save leaves only a .tmp folder, never a checkpoint."""
    import threading
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(interval_s)
        print(f"train_gpt.py: error: rank {os.environ.get('RANK')}: the torchrun agent (pid {parent}) is gone: "
              "stopping", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="watch_launcher").start()


def stop_local_peers():
    """SIGKILL the other workers of this torchrun agent on this node (same parent, same command line). After a
    collective timed out the job is over; torchrun would SIGTERM the workers and wait 30 s before killing one that
    cannot act on it (a SIGSTOPped or hung rank), so the job would outlive --timeout-s by that much."""
    if not os.path.isdir("/proc"):
        return
    me, parent = os.getpid(), os.getppid()
    with open(f"/proc/{me}/cmdline", "rb") as f:
        command = f.read()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                same = f.read() == command
            if ppid == parent and same:
                os.kill(int(entry), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass  # gone already, or not ours


if __name__ == "__main__":
    main_job()
