"""Train a nanoGPT-style GPT with tensor, pipeline, data and context parallelism, by torchrun.

    torchrun --nproc_per_node=8 train_gpt.py --tp 2 --pp 2 --cp 1 --steps 20      # DP = 8 / (2*2*1) = 2
    torchrun --nproc_per_node=4 train_gpt.py --pp 2 --moe-every 2 --ep 2           # MoE, experts over 2 ranks

This file is the scaffolding the technique files plug into: topology.py lays out the ranks and builds the
process groups, long_seq.py's ring attention runs the context-parallel attention, grad_accum.py syncs the
gradients once per step in flat buckets and normalises by the global token count, mixed_precision.py steps
FP32 master weights of BF16 parameters (`--dtype bfloat16`), checkpointing recomputes whole blocks
(`--recompute full`), and moe_ep.py's expert-parallel MoE replaces the MLP of every n-th block
(`--moe-every n --experts E --top-k k --ep P`; EP groups folded over DP x CP by topology.py, expert
gradients reduced over their EDP replicas only). The tensor- and pipeline-parallel parts live here, as in
Megatron-LM, in three sections:

Tensor parallelism (Shoeybi et al. 2019). An MLP's first weight is split by output columns and its second
by input rows, so the pair needs one all-reduce in forward (after the row-parallel GEMM) and one in backward
(before the column-parallel one): `copy_to_tp` is identity forward / all-reduce backward, `reduce_from_tp`
the reverse. Attention splits the heads the same way (QKV column-parallel, output row-parallel). The
embedding is split over the vocabulary: each rank looks up its rows and an all-reduce assembles the result;
the tied output layer produces vocabulary-sharded logits, and the cross-entropy is computed on them with
three small all-reduces (max, sum of exponentials, target logit) instead of gathering V logits per token.
Per layer: 2 all-reduces of b s h forward, 2 backward (no sequence parallelism here).

Pipeline parallelism with the 1F1B schedule (Narayanan et al. 2021). Stage i holds L/p consecutive
layers; the first stage the embeddings, the last the final LayerNorm and the (tied) output layer, whose
gradient is all-reduced with the first stage's over the `embedding` group. With m micro-batches a stage
runs p - 1 - i warm-up forwards, then alternates one forward and one backward, then drains: at most p
micro-batches of activations are alive on stage 0 (GPipe keeps m) and the bubble is (p-1)/(m+p-1).
Sends and receives that must meet are posted together (`batch_isend_irecv`), so no stage waits on a
partner that is itself waiting.

Data and context parallelism. DP ranks take different sequences of the global batch; CP ranks take the
zigzag shards of the same sequences (long_seq.py), including the position ids and the targets. Dense
gradients are summed over DP x CP once per step, then every gradient is divided by the number of tokens in
the global batch: the loss is the mean over all tokens whatever the layout. Under one seed every layout
holds the same global weights (each parameter is drawn whole from a generator seeded by its global name,
and each rank keeps its slice), so the loss curve is the same for every layout; tests/test_train_gpt.py
checks that to 1e-12 in float64 (MoE with its router losses off: they are computed per micro-batch on each
rank's tokens, so their value depends on the split, as in Megatron-LM).

Metrics: one JSON object per step in `--metrics` (step, loss, tokens/s, MFU against `--peak-tflops` with
the PaLM / nanoGPT FLOPs per token 6N + 12 L h s).
"""
import argparse
import json
import math
import os
import time
import zlib
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch.utils.checkpoint import checkpoint

import grad_accum
import long_seq
import mixed_precision
import moe_ep
import topology


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


def _size(group):
    return 1 if group is None else dist.get_world_size(group)


def _rank(group):
    return 0 if group is None else dist.get_rank(group)


# ----------------------------------------------------------------------------------------------------
# Layout-independent initialisation: every parameter drawn whole from a generator named after it
# ----------------------------------------------------------------------------------------------------

def full_init(name, shape, std, seed, dtype):
    """N(0, std^2) weights of the WHOLE parameter `name`, from a generator seeded by that name."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * std).to(dtype)


# ----------------------------------------------------------------------------------------------------
# Tensor parallelism
# ----------------------------------------------------------------------------------------------------

class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)  # never modify an incoming gradient
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone(memory_format=torch.contiguous_format)  # the input stays the partial sum it was
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x, group):
    return x if _size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    return x if _size(group) == 1 else _ReduceFromTP.apply(x, group)


class ColumnParallelLinear(nn.Module):
    """y_local = x W_local^T + b_local, W split by output rows. `parts` > 1 splits each of `parts` equal
    blocks of the output (Q, K and V) separately, so every rank gets whole heads of each."""

    def __init__(self, name, d_in, d_out, tp_group, cfg, dtype, parts=1, std=0.02):
        super().__init__()
        t, r = _size(tp_group), _rank(tp_group)
        self.tp_group = tp_group
        w = full_init(name + ".weight", (d_out, d_in), std, cfg.seed, dtype)
        w = rearrange(w, "(parts t o) i -> parts t o i", parts=parts, t=t)[:, r]
        self.weight = nn.Parameter(rearrange(w, "parts o i -> (parts o) i").contiguous())
        self.bias = nn.Parameter(torch.zeros(d_out // t, dtype=dtype))

    def forward(self, x):
        return F.linear(copy_to_tp(x, self.tp_group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local W_local^T) + b, W split by input columns; the bias is added once."""

    def __init__(self, name, d_in, d_out, tp_group, cfg, dtype, std=0.02):
        super().__init__()
        t, r = _size(tp_group), _rank(tp_group)
        self.tp_group = tp_group
        w = full_init(name + ".weight", (d_out, d_in), std, cfg.seed, dtype)
        self.weight = nn.Parameter(w.chunk(t, dim=1)[r].contiguous())
        self.bias = nn.Parameter(torch.zeros(d_out, dtype=dtype))

    def forward(self, x):
        return reduce_from_tp(F.linear(x, self.weight), self.tp_group) + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [r V/t, (r+1) V/t) of the token embedding; ids outside the shard look up zeros."""

    def __init__(self, name, vocab, dim, tp_group, cfg, dtype):
        super().__init__()
        t, r = _size(tp_group), _rank(tp_group)
        if vocab % t:
            raise ValueError(f"vocab_size={vocab} must be divisible by tp={t}; pad the vocabulary")
        self.tp_group, self.start, self.end = tp_group, r * vocab // t, (r + 1) * vocab // t
        self.weight = nn.Parameter(full_init(name, (vocab, dim), 0.02, cfg.seed, dtype)[self.start:self.end].clone())

    def forward(self, ids):
        outside = (ids < self.start) | (ids >= self.end)
        x = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
        return reduce_from_tp(x.masked_fill(outside[..., None], 0.0), self.tp_group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from vocabulary-sharded logits: log(sum exp) - logit[target], assembled with
    all-reduces of (N,) tensors. The gradient, softmax - onehot, is computed on the local shard."""

    @staticmethod
    def forward(ctx, logits, targets, start, group):
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        local_max = logits.max(dim=-1).values
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max[:, None]
        inside = (targets >= start) & (targets < start + logits.shape[-1])
        idx = (targets - start).masked_fill(~inside, 0)
        target_logit = shifted.gather(1, idx[:, None]).squeeze(1).masked_fill(~inside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(-1)
        dist.all_reduce(target_logit, group=group)
        dist.all_reduce(sum_exp, group=group)
        softmax = exp / sum_exp[:, None]
        ctx.save_for_backward(softmax, idx, inside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, idx, inside = ctx.saved_tensors
        g = softmax.clone()
        g[torch.arange(g.shape[0], device=g.device), idx] -= inside.to(g.dtype)
        return g * grad[:, None], None, None, None


def vocab_parallel_cross_entropy(logits, targets, start, group):
    if _size(group) == 1:
        return F.cross_entropy(logits.float() if logits.dtype != torch.float64 else logits, targets,
                               reduction="none")
    return _VocabParallelCrossEntropy.apply(logits, targets, start, group)


# ----------------------------------------------------------------------------------------------------
# The model: one pipeline stage of a GPT
# ----------------------------------------------------------------------------------------------------

class LayerNorm(nn.Module):
    def __init__(self, dim, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype))

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias)


class Block(nn.Module):
    def __init__(self, i, cfg, ps, dtype):
        super().__init__()
        h, tp = cfg.n_embd, ps.groups["tp"]
        if cfg.n_head % ps.sizes["tp"]:
            raise ValueError(f"n_head={cfg.n_head} must be divisible by tp={ps.sizes['tp']}")
        self.heads = cfg.n_head // ps.sizes["tp"]
        self.cp_group = ps.groups["cp"] if ps.sizes["cp"] > 1 else None
        std_out = 0.02 / math.sqrt(2 * cfg.n_layer)  # GPT-2: scale the residual projections
        self.ln1 = LayerNorm(h, dtype)
        self.qkv = ColumnParallelLinear(f"h.{i}.attn.qkv", h, 3 * h, tp, cfg, dtype, parts=3)
        self.proj = RowParallelLinear(f"h.{i}.attn.proj", h, h, tp, cfg, dtype, std=std_out)
        self.ln2 = LayerNorm(h, dtype)
        self.moe = None
        if cfg.is_moe(i):
            # experts are not split by TP here (expert-TP = 1): every TP rank of an EP group runs the same
            # experts on the same (replicated) tokens. moe_ep.MoE draws all its weights from the default RNG,
            # so seeding it by the layer's name makes them the same in every layout.
            torch.manual_seed(cfg.seed * 1_000_003 + zlib.crc32(f"h.{i}.moe".encode()))
            ep = ps.groups["ep"] if ps.sizes["ep"] > 1 else None
            self.moe = moe_ep.MoE(h, 4 * h, cfg.n_experts, cfg.top_k, ep_group=ep,
                                  aux_loss_coeff=cfg.aux_loss_coeff, z_loss_coeff=cfg.z_loss_coeff).to(dtype)
        else:
            self.fc = ColumnParallelLinear(f"h.{i}.mlp.fc", h, 4 * h, tp, cfg, dtype)
            self.out = RowParallelLinear(f"h.{i}.mlp.proj", 4 * h, h, tp, cfg, dtype, std=std_out)

    def attention(self, x):
        q, k, v = rearrange(self.qkv(self.ln1(x)), "b s (three a d) -> three b a s d", three=3, a=self.heads)
        if self.cp_group is not None:  # this rank holds the zigzag shard of the sequence
            y = long_seq.ring_attention(q, k, v, self.cp_group, causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(rearrange(y, "b a s d -> b s (a d)"))

    def forward(self, x):
        """Returns the block's output and its auxiliary (router) loss, zero for a dense block."""
        x = x + self.attention(x)
        if self.moe is None:
            return x + self.out(F.gelu(self.fc(self.ln2(x)))), x.new_zeros((), dtype=torch.float64)
        y, aux = self.moe(self.ln2(x))
        return x + y, aux.double()


def stage_layers(n_layer, pp, stage):
    if n_layer % pp:
        raise ValueError(f"n_layer={n_layer} must be divisible by pp={pp}; choose pp among "
                         f"{[d for d in range(1, n_layer + 1) if n_layer % d == 0]}")
    per = n_layer // pp
    return range(stage * per, (stage + 1) * per)


class GPTStage(nn.Module):
    """The layers of one pipeline stage; the first stage embeds, the last one normalises and projects to
    the (vocabulary-sharded) logits with a copy of the token embedding (tied weights)."""

    def __init__(self, cfg, ps, dtype=torch.float32, recompute="none"):
        super().__init__()
        self.cfg, self.ps, self.recompute = cfg, ps, recompute
        tp = ps.groups["tp"]
        self.first, self.last = ps.is_first_stage, ps.is_last_stage
        self.blocks = nn.ModuleList(Block(i, cfg, ps, dtype)
                                    for i in stage_layers(cfg.n_layer, ps.sizes["pp"], ps.pp_rank))
        if self.first:
            self.wte = VocabParallelEmbedding("wte", cfg.vocab_size, cfg.n_embd, tp, cfg, dtype)
            self.wpe = nn.Parameter(full_init("wpe", (cfg.seq_len, cfg.n_embd), 0.02, cfg.seed, dtype))
        if self.last:
            self.ln_f = LayerNorm(cfg.n_embd, dtype)
            if self.first:
                self.lm_head = self.wte  # one stage: literally the same parameter
            else:  # a copy of the same initial weights; its gradient is summed with wte's every step
                self.lm_head = VocabParallelEmbedding("wte", cfg.vocab_size, cfg.n_embd, tp, cfg, dtype)

    def forward(self, x, positions=None):
        """First stage: x are token ids (b, s_local), positions their global positions; otherwise x is the
        previous stage's hidden state. Last stage returns vocabulary-sharded logits. Also returns the sum
        of the stage's auxiliary (MoE router) losses."""
        if self.first:
            x = self.wte(x) + self.wpe[positions]
        aux = torch.zeros((), dtype=torch.float64, device=x.device)
        for block in self.blocks:
            x, a = checkpoint(block, x, use_reentrant=False) if self.recompute == "full" else block(x)
            aux = aux + a
        if self.last:
            x = F.linear(copy_to_tp(self.ln_f(x), self.ps.groups["tp"]), self.lm_head.weight)
        return x, aux

    def expert_params(self):
        return [p for b in self.blocks if b.moe is not None for p in b.moe.expert_params()]

    def loss_sum(self, logits, targets):
        per_token = vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), self.lm_head.start,
                                                 self.ps.groups["tp"] if self.ps.sizes["tp"] > 1 else None)
        return per_token.sum()


# ----------------------------------------------------------------------------------------------------
# Pipeline parallelism: point-to-point transfers and the 1F1B schedule
# ----------------------------------------------------------------------------------------------------

def _p2p(sends=(), recvs=(), group=None):
    """Post every send (tensor, peer) and receive (buffer, peer) together, then wait for all of them."""
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer, group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, buf, peer, group) for buf, peer in recvs]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


class Pipeline:
    """The transfers of one stage. Shapes are fixed by the layout, so receives preallocate."""

    def __init__(self, ps, shape, dtype, device):
        self.ps, self.shape, self.dtype, self.device = ps, shape, dtype, device
        self.group = ps.groups["pp"]

    def _buf(self):
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def recv_forward(self):
        if self.ps.is_first_stage:
            return None
        buf = self._buf()
        _p2p(recvs=[(buf, self.ps.pp_prev)], group=self.group)
        return buf.requires_grad_(True)

    def send_forward(self, y):
        if not self.ps.is_last_stage:
            _p2p(sends=[(y.detach(), self.ps.pp_next)], group=self.group)

    def send_forward_recv_backward(self, y):
        if self.ps.is_last_stage:
            return None
        grad = self._buf()
        _p2p(sends=[(y.detach(), self.ps.pp_next)], recvs=[(grad, self.ps.pp_next)], group=self.group)
        return grad

    def recv_backward(self):
        if self.ps.is_last_stage:
            return None
        grad = self._buf()
        _p2p(recvs=[(grad, self.ps.pp_next)], group=self.group)
        return grad

    def send_backward(self, grad):
        if not self.ps.is_first_stage:
            _p2p(sends=[(grad, self.ps.pp_prev)], group=self.group)

    def send_backward_recv_forward(self, grad):
        if self.ps.is_first_stage:
            return None
        buf = self._buf()
        _p2p(sends=[(grad, self.ps.pp_prev)], recvs=[(buf, self.ps.pp_prev)], group=self.group)
        return buf.requires_grad_(True)


def one_f_one_b(stage, pipe, micro_batches):
    """Run forward and backward of every micro-batch with the 1F1B schedule; returns this stage's summed
    loss (last stage) and the peak number of micro-batches whose activations were alive at once."""
    ps = stage.ps
    m = len(micro_batches)
    warmup = min(ps.sizes["pp"] - ps.pp_rank - 1, m)
    in_flight, peak = [], 0
    loss_total = torch.zeros((), dtype=torch.float64, device=next(stage.parameters()).device)

    def forward(i, x):
        ids, positions, targets = micro_batches[i]
        out, aux = stage(ids if stage.first else x, positions)
        if stage.last:
            out = stage.loss_sum(out, targets)
        # the loss is a sum over tokens, divided by the global token count after the step: weighting each
        # micro-batch's mean router loss by its token count makes it a token-weighted mean as well
        in_flight.append((x, out, aux * targets.numel()))
        return out

    def backward(grad_out):
        x, out, aux = in_flight.pop(0)
        if stage.last:
            (out + aux).backward()
        elif aux.requires_grad:  # an MoE stage: its router loss starts its own backward here
            torch.autograd.backward([out, aux], [grad_out, torch.ones_like(aux)])
        else:
            torch.autograd.backward(out, grad_out)
        return None if x is None else x.grad

    for i in range(warmup):
        out = forward(i, pipe.recv_forward())
        pipe.send_forward(out)
        peak = max(peak, len(in_flight))
    x = pipe.recv_forward() if m > warmup else None
    for j in range(m - warmup):
        out = forward(warmup + j, x)
        peak = max(peak, len(in_flight))
        if stage.last:
            loss_total += out.detach().double()
        grad = pipe.send_forward_recv_backward(out)
        grad_in = backward(grad)
        if j == m - warmup - 1:
            pipe.send_backward(grad_in)
        else:
            x = pipe.send_backward_recv_forward(grad_in)
    for _ in range(warmup):
        pipe.send_backward(backward(pipe.recv_backward()))
    return loss_total, peak


# ----------------------------------------------------------------------------------------------------
# Data: a synthetic language with structure (so the loss falls), sharded by DP, micro-batch and CP
# ----------------------------------------------------------------------------------------------------

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


def local_micro_batches(tokens, ps, micro_batch, device):
    """This rank's micro-batches: its DP slice of the sequences, cut in micro-batches, and its CP shard
    (zigzag: the causal work is balanced) of the inputs, the targets and the global positions."""
    dp, cp = ps.sizes["dp"], ps.sizes["cp"]
    B = tokens.shape[0]
    if B % (dp * micro_batch):
        raise ValueError(f"global batch {B} must be divisible by dp*micro_batch = {dp}*{micro_batch}")
    mine = tokens.chunk(dp)[ps.dp_rank]
    seq = tokens.shape[1] - 1
    positions = torch.arange(seq)
    out = []
    for mb in mine.split(micro_batch):
        ids, targets = mb[:, :-1], mb[:, 1:]
        if cp > 1:
            ids, targets = (long_seq.zigzag_shard(t, 1, ps.cp_rank, cp) for t in (ids, targets))
            pos = long_seq.zigzag_shard(positions, 0, ps.cp_rank, cp)
        else:
            pos = positions
        out.append((ids.to(device), pos.to(device), targets.to(device)))
    return out


# ----------------------------------------------------------------------------------------------------
# One training step
# ----------------------------------------------------------------------------------------------------

def train_step(stage, pipe, optimizer, tokens, micro_batch):
    ps = stage.ps
    device = next(stage.parameters()).device
    micro = local_micro_batches(tokens, ps, micro_batch, device)
    loss_sum, peak = one_f_one_b(stage, pipe, micro)
    params = [p for p in stage.parameters() if p.requires_grad]
    # tied embeddings: the first stage's wte and the last stage's copy receive the sum of both gradients
    if ps.sizes["pp"] > 1 and (ps.is_first_stage or ps.is_last_stage):
        tied = stage.wte.weight if ps.is_first_stage else stage.lm_head.weight
        dist.all_reduce(tied.grad, group=ps.groups["embedding"])
    global_tokens = tokens.shape[0] * (tokens.shape[1] - 1)
    dp_cp = ps.sizes["dp"] * ps.sizes["cp"]
    if isinstance(optimizer, mixed_precision.MixedPrecisionOptimizer):
        # 16-bit parameters: the optimizer converts to FP32, averages over DP x CP, then we scale
        optimizer.step(grad_scale=dp_cp / global_tokens)
    else:
        # one sync per step over the ranks holding other tokens of the same weights (grad_accum.py): dense
        # weights over DP x CP, experts over their expert-data-parallel replicas only (moe_ep.py: an
        # expert's gradient already holds the tokens of its whole EP group); then the per-token
        # normalisation by the global batch's token count
        experts = {id(p) for p in stage.expert_params()}
        if dp_cp > 1:  # (group=None would mean the whole world to torch.distributed)
            grad_accum.sync_gradients([p for p in params if id(p) not in experts], ps.groups["dp_cp"])
        if experts and ps.sizes["edp"] > 1:
            grad_accum.sync_gradients(stage.expert_params(), ps.groups["edp"])
        for p in params:
            if p.grad is not None:
                p.grad.div_(global_tokens)
        optimizer.step()
    optimizer.zero_grad()
    # the loss for the log: last stage, one TP rank, summed over DP x CP
    report = loss_sum if (ps.is_last_stage and ps.tp_rank == 0) else torch.zeros((), dtype=torch.float64)
    report = report.to(device)
    dist.all_reduce(report)
    return report.item() / global_tokens, peak


def model_flops_per_token(cfg):
    """PaLM appendix B as nanoGPT: 6 N + 12 L h s, N the non-embedding parameters a token passes through
    (an MoE layer counts its top_k experts' MLPs and its router instead of one MLP)."""
    h = cfg.n_embd
    n = 12 * cfg.n_layer * h ** 2 + 13 * cfg.n_layer * h
    for layer in range(cfg.n_layer):
        if cfg.is_moe(layer):
            n += (cfg.top_k - 1) * 8 * h ** 2 + cfg.n_experts * h
    return 6 * n + 12 * cfg.n_layer * h * cfg.seq_len


def validate(cfg, world, tp, pp, cp, batch=None, micro_batch=1, ep=1, dtype=torch.float32):
    """Every shape the layout must divide, checked on every rank before any process group is created."""
    topology.validate_layout(world, tp, pp, cp, ep)
    dp = world // (tp * pp * cp)
    checks = [
        (ep > 1 and cfg.moe_every == 0, f"ep={ep} needs MoE layers: set moe_every > 0 (--moe-every)"),
        (cfg.moe_every and cfg.n_experts % ep, f"n_experts={cfg.n_experts} must be divisible by ep={ep}"),
        (cfg.moe_every and not 1 <= cfg.top_k <= cfg.n_experts,
         f"top_k={cfg.top_k} must be between 1 and n_experts={cfg.n_experts}"),
        (ep > 1 and dtype in (torch.bfloat16, torch.float16),
         "16-bit training reduces every gradient over DP x CP in mixed_precision.py; expert gradients need "
         "their EDP group: use --ep 1 with --dtype bfloat16 for now"),
        (cfg.n_layer % pp, f"n_layer={cfg.n_layer} must be divisible by pp={pp}; choose pp among "
                           f"{[d for d in range(1, cfg.n_layer + 1) if cfg.n_layer % d == 0]}"),
        (cfg.n_head % tp, f"n_head={cfg.n_head} must be divisible by tp={tp}"),
        (cfg.vocab_size % tp, f"vocab_size={cfg.vocab_size} must be divisible by tp={tp}; pad the vocabulary"),
        (cfg.seq_len % (2 * cp), f"seq_len={cfg.seq_len} must be divisible by 2*cp = {2 * cp} (zigzag shards)"),
        (batch is not None and batch % (dp * micro_batch),
         f"global batch={batch} must be divisible by dp*micro_batch = {dp}*{micro_batch}"),
    ]
    for failed, message in checks:
        if failed:
            raise ValueError(message)


def build(cfg, tp=1, pp=1, cp=1, dtype=torch.float32, recompute="none", optimizer="adamw", lr=3e-3,
          micro_batch=1, batch=None, ep=1):
    _, world = topology.init_distributed()
    validate(cfg, world, tp, pp, cp, batch, micro_batch, ep, dtype)
    ps = topology.init_parallel(tp=tp, pp=pp, cp=cp, ep=ep, with_mesh=False)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    stage = GPTStage(cfg, ps, dtype, recompute).to(device)
    opt_class = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optimizer]
    if dtype in (torch.bfloat16, torch.float16):  # FP32 masters, gradients reduced in FP32 over DP x CP
        dp_cp = ps.groups["dp_cp"] if ps.sizes["dp"] * ps.sizes["cp"] > 1 else None
        opt = mixed_precision.MixedPrecisionOptimizer(stage.parameters(), opt_class, dp_group=dp_cp, lr=lr)
    else:
        opt = opt_class(stage.parameters(), lr=lr)
    pipe = Pipeline(ps, (micro_batch, cfg.seq_len // cp, cfg.n_embd), dtype, device)
    return ps, stage, opt, pipe


def train(cfg, steps, batch, micro_batch=1, tp=1, pp=1, cp=1, dtype=torch.float32, recompute="none",
          optimizer="adamw", lr=3e-3, metrics=None, peak_tflops=None, log=True, ep=1):
    ps, stage, opt, pipe = build(cfg, tp, pp, cp, dtype, recompute, optimizer, lr, micro_batch, batch, ep)
    losses = []
    flops_per_token = model_flops_per_token(cfg)
    out = open(metrics, "w") if metrics and ps.rank == 0 else None
    for step in range(steps):
        t0 = time.perf_counter()
        tokens = synthetic_batch(step, batch, cfg.seq_len, cfg.vocab_size, cfg.seed)
        loss, peak = train_step(stage, pipe, opt, tokens, micro_batch)
        dt = time.perf_counter() - t0
        tokens_per_s = batch * cfg.seq_len / dt
        record = {"step": step, "loss": loss, "tokens_per_s": tokens_per_s, "step_time_s": dt,
                  "in_flight_peak": peak, "tp": tp, "pp": pp, "dp": ps.sizes["dp"], "cp": cp, "ep": ep}
        if peak_tflops:
            record["mfu"] = flops_per_token * tokens_per_s / (peak_tflops * 1e12 * ps.world_size)
        losses.append(loss)
        if out:
            out.write(json.dumps(record) + "\n")
            out.flush()
        if log and ps.rank == 0:
            print(json.dumps(record))
    if out:
        out.close()
    return losses


def main():
    ap = argparse.ArgumentParser(description="Train a GPT with TP x CP x DP x PP (DP = world / (tp*cp*pp)).")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1, help="expert parallel size, folded over DP x CP")
    ap.add_argument("--moe-every", type=int, default=0, help="every n-th block is MoE (0: dense)")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16, help="global batch in sequences")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float64"], default="float32",
                    help="bfloat16: BF16 parameters and activations, FP32 master weights")
    ap.add_argument("--recompute", choices=["none", "full"], default="none")
    ap.add_argument("--metrics", default="metrics.jsonl")
    ap.add_argument("--peak-tflops", type=float, default=None, help="per GPU, for MFU (H100 BF16 dense: 989)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if os.environ.get("OMP_NUM_THREADS") is None and not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    cfg = GPTConfig(vocab_size=a.vocab, seq_len=a.seq, n_layer=a.layers, n_head=a.heads, n_embd=a.hidden,
                    seed=a.seed, moe_every=a.moe_every, n_experts=a.experts, top_k=a.top_k)
    losses = train(cfg, a.steps, a.batch, a.micro_batch, a.tp, a.pp, a.cp, getattr(torch, a.dtype), a.recompute,
                   a.optimizer, a.lr, a.metrics, a.peak_tflops, ep=a.ep)
    if dist.get_rank() == 0:
        print(f"config {asdict(cfg)}: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {a.steps} steps; "
              f"metrics in {a.metrics}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
