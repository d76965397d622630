"""Mixture of Experts with expert parallelism: top-k router, balancing losses, capacity, all-to-all dispatch/combine.

An MoE layer replaces one MLP by E expert MLPs and a router. Each token goes to its top-k experts and their
outputs are summed with the router's weights: parameters grow E times, FLOPs per token only k times.

Routing. For T tokens x (T x d): logits = x W_r (T x E), p_t = softmax(logits_t) over ALL E experts, and the k
largest p_ti pick token t's experts. Their weights are renormalised, w_ti = p_ti / sum_{j in top-k} p_tj (as
Mixtral), and y_t = sum_{i in top-k} w_ti expert_i(x_t). Not at top-1: one weight renormalised is always exactly
1, a constant that passes the router no gradient from the task loss, so top-1 gates with p_ti itself (Switch).

Load-balancing loss (Switch Transformer, GShard). Left alone, the router collapses onto a few experts, so

    L_bal = coeff * E * sum_i f_i P_i      f_i = (assignments to expert i) / (T k)     P_i = (1/T) sum_t p_ti

f is counted, not differentiable: the gradient flows through P and pushes probability away from overloaded
experts. Perfect balance, f_i = P_i = 1/E, gives coeff * E * (E / E^2) = coeff. Collapse, every token certain
of one expert (f = 1/k, P = 1 there, 0 elsewhere), gives coeff * E / k: coeff * E at top-1.

Router z-loss (ST-MoE). L_z = coeff_z * (1/T) sum_t (logsumexp_i logits_ti)^2 keeps the logits small, so the
softmax stays stable in low precision. Both losses are computed in float32 (float64 for float64 logits). When
one micro-batch's tokens are split over ranks (CP, and TP under SP: `stats_group`, Megatron-LM's tp_cp), both
are the whole micro-batch's: their statistics are summed over the group in one small all-reduce per layer.

Capacity. With a capacity factor cf each expert takes at most C = ceil(cf * T * k / E) of the T k assignments
of a rank's T tokens (exact arithmetic, decided before dispatch); an overloaded expert keeps its C highest-weight
ones, the others contribute zero (dropped). cf = None is dropless: every assignment runs, uneven splits and all.

Expert parallelism. With an EP group of P ranks each rank holds E/P experts (expert e on rank e // (E/P)) and
its own T tokens. One forward is four steps:
  1. dispatch: sort the T k token copies by expert (= by destination rank, then local expert), exchange the
     counts per expert (a small all-to-all), and send every copy to its expert's rank: one uneven
     all_to_all_single of d-wide token rows;
  2. experts: regroup the received rows expert-major and run each local expert on its slice (a loop);
  3. combine: the reverse all-to-all returns every result to the rank of its token;
  4. put every result back at its copy's place and sum the k copies of each token with the weights w_ti.
The backward is the same two all-to-alls in reverse. Each rank computes T k token-expert MLPs on average (as
without EP) but stores E/P experts. Bytes one rank sends per token all-to-all, rows of e bytes per element, under
uniform routing (a copy stays on its own rank with probability 1/P):

    bytes per all-to-all = T * k * d * e * (P - 1) / P      (dispatch and combine, forward and backward: 4 a layer)

The chapter ties this volume to the number of experts; it depends on k and P only: more experts change where the
copies go, not how many leave.

One host synchronisation per layer. all_to_all_single takes its splits as Python lists, so the host must read
the counts. ONE transfer after the counts all-to-all brings the send splits and the received (rank x local
expert) counts together, and the backward reuses those lists (P = 1: the loop's slice sizes, one transfer too).
Everything else is sized by shapes: tokens per expert by a scatter_add into fixed bins, and dropped copies
counted in an extra bin E that sorts last and never leaves the rank.

Gradients. EP groups are drawn from the data- and context-parallel ranks; the ranks holding the same experts
form the expert-data-parallel group EDP, with EP x EDP = DP x CP. The router is reduced over DP x CP like any
dense weight, the experts over EDP only: an expert's gradient already sums the tokens of its whole EP group
(`reduce_moe_gradients` SUMS; the caller normalises once, e.g. by the global token count).

The whole file adds, after its BEYOND THE CHAPTER line: DeepSeek-V3 bias balancing (BiasBalancedRouter), the
experts as one grouped GEMM (GroupedGEMMMoE), all-to-alls posted asynchronously so DualPipeV can overlap them
with another micro-batch's compute (OverlappedMoE), a counter of host synchronisations, and the demo:
`torchrun --nproc_per_node=4 moe_ep.py` (or `python moe_ep.py` for one rank).
"""
import math
import numbers
from collections import Counter
from fractions import Fraction

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

# collectives issued by this rank, "<kind>:count" and "<kind>:bytes" (bytes that left it, its own rows not
# counted): dispatch_fwd, combine_fwd, dispatch_bwd, combine_bwd (token rows; each backward sends along the
# other direction's routes), counts_a2a (forward only); router_stats_allreduce (count only)
comm_log = Counter()


def _group_info(group):
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def tokens_per_expert(expert_of_copy, num_experts):
    """Copies per expert, counted on the device: a scatter_add of ones into `num_experts` bins. Sync-free on
    CUDA because the output size is given; torch.bincount reads the largest index back first (a sync)."""
    flat = expert_of_copy.reshape(-1)
    bins = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return bins.scatter_add_(0, flat, torch.ones_like(flat))


def _router_precision(logits):
    return logits if logits.dtype == torch.float64 else logits.float()


# ----------------------------------------------------------------------------------------------------
# Router
# ----------------------------------------------------------------------------------------------------

class Router(nn.Module):
    """logits = x W_r, probabilities by a softmax over all experts (in float32 at least), the top-k chosen and
    their weights renormalised (`normalize`, except at top-1)."""

    def __init__(self, d_model, num_experts, top_k, normalize=True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        nn.init.normal_(self.weight, std=d_model ** -0.5)
        self.top_k, self.normalize = top_k, normalize

    def select(self, probs):
        """The k experts of every token: the k largest probabilities."""
        return probs.topk(self.top_k, dim=-1).indices

    def forward(self, x):
        """x (T, d) -> logits (T, E), weights (T, k), experts (T, k)."""
        logits = x @ self.weight.t()
        probs = torch.softmax(_router_precision(logits), dim=-1)
        experts = self.select(probs)  # BiasBalancedRouter adds its bias here, to the selection only
        weights = probs.gather(-1, experts)
        if self.normalize and self.top_k > 1:  # a single weight renormalised is 1: no gradient to the router
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights.to(x.dtype), experts


# ----------------------------------------------------------------------------------------------------
# Auxiliary losses
# ----------------------------------------------------------------------------------------------------

def _check_router_logits(router_logits, top_k=None):
    """Before any all-reduce, so every rank fails alike: the losses count tokens along dimension 0."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits has shape {tuple(router_logits.shape)}; pass (tokens, experts): "
                         "logits.reshape(-1, num_experts)")
    E = router_logits.shape[1]
    if top_k is not None and not (isinstance(top_k, numbers.Integral) and not isinstance(top_k, bool)
                                  and 1 <= top_k <= E):
        raise ValueError(f"top_k={top_k!r} must be an int between 1 and the {E} experts")


def _balancing_parts(router_logits, top_k, selected):
    """Tokens per expert (as the probabilities' dtype) and probability sums per expert: f and P times T k, T."""
    _check_router_logits(router_logits, top_k)
    T, E = router_logits.shape
    if selected is not None and selected.shape != (T, top_k):
        raise ValueError(f"selected has shape {tuple(selected.shape)}; pass the ({T}, top_k={top_k}) experts chosen")
    probs = torch.softmax(_router_precision(router_logits), -1)
    if selected is None:
        selected = probs.topk(top_k, dim=-1).indices
    return tokens_per_expert(selected, E).to(probs.dtype), probs.sum(0)


def load_balancing_loss(router_logits, top_k, coeff, group=None, selected=None):
    """Switch/GShard: coeff * E * sum_i f_i P_i over these tokens, or over the tokens of every rank of `group`.
    `selected` (T, k): the experts actually chosen (the MoE layer passes its router's choice); default the
    top-k of the logits."""
    counts, prob_sum = _balancing_parts(router_logits, top_k, selected)
    if _group_info(group)[1] > 1:
        summed = _summed_statistics(torch.cat([counts, prob_sum]), group)
        return _balancing_over_group(prob_sum, summed, top_k, coeff)
    T, E = router_logits.shape
    T = max(T, 1)  # no tokens: the sums are zero and so is the loss, a zero still in the graph (not 0/0)
    return coeff * E * ((counts / (T * top_k)) * prob_sum).sum() / T


def _z_parts(router_logits):
    """The sum over tokens of logsumexp(logits)^2, and the token count."""
    _check_router_logits(router_logits)
    lse = torch.logsumexp(_router_precision(router_logits), -1)
    return (lse ** 2).sum(), lse.shape[0]


def z_loss(router_logits, coeff, group=None):
    """ST-MoE router z-loss: coeff * mean over tokens of logsumexp(logits)^2 (tokens of every rank of `group`)."""
    lse_square_sum, tokens = _z_parts(router_logits)
    if _group_info(group)[1] > 1:
        return _z_over_group(lse_square_sum, _summed_statistics(_z_statistics(lse_square_sum, tokens), group), coeff)
    return coeff * lse_square_sum / max(tokens, 1)  # no tokens: a zero still in the graph (not 0/0)


def router_losses(router_logits, top_k, aux_coeff, z_coeff, group=None, selected=None):
    """load_balancing_loss(router_logits, top_k, aux_coeff, group, selected) + z_loss(router_logits, z_coeff,
    group), the same values and gradients, but both losses' statistics summed over `group` in ONE all-reduce
    (what MoE.forward uses: one small collective per layer per micro-batch instead of two)."""
    if _group_info(group)[1] == 1:
        return load_balancing_loss(router_logits, top_k, aux_coeff, selected=selected) + z_loss(router_logits, z_coeff)
    counts, local_prob_sum = _balancing_parts(router_logits, top_k, selected)
    local_sum, tokens = _z_parts(router_logits)
    E = counts.shape[0]
    summed = _summed_statistics(torch.cat([counts, local_prob_sum, _z_statistics(local_sum, tokens)]), group)
    return (_balancing_over_group(local_prob_sum, summed[:2 * E], top_k, aux_coeff)
            + _z_over_group(local_sum, summed[2 * E:], z_coeff))


# ---- The losses of a micro-batch split over ranks (`group`, the MoE's stats_group) ----
# Split, each rank holds some of the micro-batch's tokens, and the losses must be the whole micro-batch's, or their
# value and gradient change with the split. As Megatron-LM over tp_cp: the tokens per expert and the token count
# are summed over the group, so f is global; each rank keeps its local probability sums, and E sum_i f_i (local
# sum_t p_ti) / T_global is exactly its share of the global loss: the shares add up to it, and each share's
# gradient with respect to the rank's logits is the global loss's. The z-loss likewise (its local sum of lse^2
# over the global token count). Counts are summed, not assumed, so uneven splits are exact, down to a rank with no
# tokens (it still joins the all-reduce). Every rank's forward value is the global loss; its gradient flows through
# the local share only. With no tokens at all the losses are a zero that stays in the autograd graph, not 0/0.

def _summed_statistics(stats, group):
    """Detached sum over `group` of every rank's statistics: one all-reduce."""
    stats = stats.detach().clone()
    comm_log["router_stats_allreduce:count"] += 1
    dist.all_reduce(stats, group=group)
    return stats


def _global_value(local_share, global_value):
    """Forward value: the global loss; gradient: this rank's share only. Each rank's logits then receive
    exactly the gradient of the global loss with respect to them."""
    return local_share + (global_value - local_share.detach())


def _balancing_over_group(local_prob_sum, summed, top_k, coeff):
    """The group's balancing loss from `summed` (the group's tokens and probability sums per expert)."""
    E = local_prob_sum.shape[0]
    counts, prob_sum = summed[:E], summed[E:]
    assignments = counts.sum().clamp(min=1)  # T_global * k, counted; a group without any token gets 0, not 0/0
    tokens = assignments / top_k
    f = counts / assignments
    scale = coeff * E / tokens              # P_i = (sum of p_ti over the group's tokens) / T_global
    return _global_value(scale * (f * local_prob_sum).sum(), scale * (f * prob_sum).sum())


def _z_statistics(local_sum, tokens):
    # the token count joins the all-reduce as a device tensor filled with a Python int: no upload, no read
    return torch.stack([local_sum, local_sum.new_full((), tokens)])


def _z_over_group(local_sum, summed, coeff):
    """The group's z-loss from `summed` (the group's sum of lse^2 and its token count)."""
    tokens = summed[1].clamp(min=1)  # a group with no tokens at all: 0, not 0/0
    return _global_value(coeff * local_sum / tokens, coeff * summed[0] / tokens)


# ----------------------------------------------------------------------------------------------------
# Capacity
# ----------------------------------------------------------------------------------------------------

def expert_capacity(tokens, top_k, num_experts, capacity_factor):
    """ceil(tokens * top_k / num_experts * capacity_factor), in exact arithmetic: in floats a product that is
    an integer comes out a hair above it (100 * 2 / 4 * 1.1 = 55.00000000000001) and ceil adds a slot."""
    # Fraction(str(cf)), not Fraction(cf): the float 0.07 is exactly 0.0700000000000000066..., whose
    # product with 100 is still above 7; its repr is the shortest decimal that reads back as the same
    # float, i.e. the value the caller wrote, and that is the factor meant.
    return math.ceil(Fraction(tokens * top_k, num_experts) * Fraction(str(capacity_factor)))


def apply_capacity(experts, weights, num_experts, capacity):
    """Keep, for every expert, its `capacity` highest-weight assignments; returns a (T, k) keep mask.
    Computed on the device without a host read: the mask is used by torch.where, never as an index."""
    flat_e, flat_w = experts.reshape(-1), weights.reshape(-1).detach()
    by_weight = torch.argsort(flat_w, descending=True, stable=True)
    order = by_weight.index_select(0, torch.argsort(flat_e.index_select(0, by_weight), stable=True))
    counts = tokens_per_expert(flat_e, num_experts)  # expert-major above, heaviest first within an expert
    starts = torch.cumsum(counts, 0) - counts
    place_in_expert = torch.arange(order.numel(), device=order.device) - \
        starts.index_select(0, flat_e.index_select(0, order))
    slot = torch.empty_like(order).scatter_(0, order, place_in_expert)
    return (slot < capacity).view_as(experts)


# ----------------------------------------------------------------------------------------------------
# The all-to-alls
# ----------------------------------------------------------------------------------------------------

def _log(kind, rows, row_bytes, rank):
    comm_log[kind + ":count"] += 1
    comm_log[kind + ":bytes"] += sum(n for j, n in enumerate(rows) if j != rank) * row_bytes


class _AllToAllTokens(torch.autograd.Function):
    """Uneven all_to_all_single of token rows; the backward sends the gradients back along the same routes,
    with the forward's split lists (no new host read)."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group, kind):
        ctx.splits, ctx.group, ctx.kind = (send_splits, recv_splits), group, kind
        return _exchange(x, send_splits, recv_splits, group, kind + "_fwd")

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return _exchange(grad, recv_splits, send_splits, ctx.group, ctx.kind + "_bwd"), None, None, None, None


def _exchange(x, send_splits, recv_splits, group, kind):
    x = x.contiguous()
    out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
    _log(kind, send_splits, math.prod(x.shape[1:]) * x.element_size(), _group_info(group)[0])
    dist.all_to_all_single(out, x, recv_splits, send_splits, group=group)
    return out


def _exchange_counts(counts, group):
    """(P, E/P) tokens this rank sends to each local expert of each rank -> (P, E/P) tokens it receives."""
    out = torch.empty_like(counts)
    rank, world = _group_info(group)
    comm_log["counts_a2a:count"] += 1
    comm_log["counts_a2a:bytes"] += counts[0].numel() * counts.element_size() * (world - 1)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


def experts_loop(rows, w1, w2, sizes):
    """The experts: rows sorted expert-major, `sizes` (a Python list) rows per expert; one GEMM pair per
    expert on its slice."""
    return torch.cat([F.gelu(r @ w1[e]) @ w2[e] for e, r in enumerate(rows.split(sizes))])


def _inverse_permutation(perm):
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


# ----------------------------------------------------------------------------------------------------
# The MoE layer
# ----------------------------------------------------------------------------------------------------

class MoE(nn.Module):
    """Top-k MoE of GELU MLP experts, expert-parallel over `ep_group`. forward(x) -> (y, aux_loss), aux_loss =
    L_bal (coefficient `aux_loss_coeff`) + L_z (`z_loss_coeff`) of this rank's tokens, or of the micro-batch whose
    tokens `stats_group` splits (CP, TP under SP); `capacity_factor` None is dropless. ep_group=None (or of one
    rank): every expert is here and nothing is communicated.

    Layout-independent initialisation: the router and ALL experts' weights are drawn from the default RNG in
    the same order on every rank and each rank keeps its slice, so under one seed every layout holds the
    same global weights (simple and exact; a production model would seed a generator per expert instead)."""

    def __init__(self, d_model, d_hidden, num_experts, top_k, ep_group=None, capacity_factor=None,
                 aux_loss_coeff=1e-2, z_loss_coeff=1e-3, normalize_topk=True, stats_group=None):
        super().__init__()
        ep_rank, ep_size = _group_info(ep_group)
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by the EP group size {ep_size}; "
                             f"use an EP size dividing {num_experts}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
        if capacity_factor is not None and not (math.isfinite(capacity_factor) and capacity_factor > 0):
            raise ValueError(f"capacity_factor={capacity_factor} must be positive and finite, or None for dropless")
        self.d_model, self.d_hidden, self.num_experts, self.top_k = d_model, d_hidden, num_experts, top_k
        self.ep_group, self.ep_rank, self.ep_size, self.stats_group = ep_group, ep_rank, ep_size, stats_group
        self.local_experts = num_experts // ep_size
        self.capacity_factor = capacity_factor
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        self.router = Router(d_model, num_experts, top_k, normalize_topk)
        w1 = torch.randn(num_experts, d_model, d_hidden) * d_model ** -0.5
        w2 = torch.randn(num_experts, d_hidden, d_model) * d_hidden ** -0.5
        mine = slice(ep_rank * self.local_experts, (ep_rank + 1) * self.local_experts)
        self.w1 = nn.Parameter(w1[mine].clone())
        self.w2 = nn.Parameter(w2[mine].clone())
        self.last_load = None  # copies per expert of the last forward (this rank's tokens): the experts' load

    def expert_params(self):
        return [self.w1, self.w2]

    def dense_params(self):
        return list(self.router.parameters())

    def _route(self, x):
        logits, weights, experts = self.router(x)
        keep = None
        if self.capacity_factor is not None:
            cap = expert_capacity(x.shape[0], self.top_k, self.num_experts, self.capacity_factor)
            keep = apply_capacity(experts, weights, self.num_experts, cap)
        return logits, weights, experts, keep

    def router_loss(self, logits, experts):
        """L_bal + L_z over the stats_group's tokens, the balancing loss counting the experts the router chose."""
        return router_losses(logits, self.top_k, self.aux_loss_coeff, self.z_loss_coeff, self.stats_group,
                             selected=experts)

    def _run_local_experts(self, rows, counts, sizes):
        """rows sorted expert-major; `sizes` (host list) rows per local expert, which the loop slices by. `counts`
        holds the same numbers on the device, unread here: GroupedGEMMMoE's grouped GEMM takes them without a
        host read."""
        return experts_loop(rows, self.w1, self.w2, sizes)

    def forward(self, x):
        if x.shape[-1] != self.d_model:
            raise ValueError(f"input's last dim {x.shape[-1]} != d_model={self.d_model}")
        shape = x.shape
        x = x.reshape(-1, self.d_model)
        T, k, E = x.shape[0], self.top_k, self.num_experts
        logits, weights, experts, keep = self._route(x)
        aux = self.router_loss(logits, experts)

        # 1. the token copies (copy j of token t is number t*k + j), sorted by expert = by destination rank,
        #    then local expert; copies dropped by the capacity go to an extra bin E that sorts last
        expert_of_copy = experts.reshape(-1)
        if keep is not None:
            expert_of_copy = torch.where(keep.reshape(-1), expert_of_copy, E)
        order = torch.argsort(expert_of_copy, stable=True)
        counts = tokens_per_expert(expert_of_copy, E + 1)[:E]
        self.last_load = counts.detach()
        if self.ep_size == 1:
            y_sorted, kept = self._local(x, order, counts)
        else:
            y_sorted, kept = self._expert_parallel(x, order, counts)
        # 4. every result back to its copy's place (dropped copies stay zero), summed with the router weights
        y_copies = y_sorted.new_zeros(T * k, self.d_model).index_copy(0, order[:kept], y_sorted)
        y = torch.einsum("tkd,tk->td", rearrange(y_copies, "(t k) d -> t k d", k=k), weights)
        return y.reshape(shape), aux

    def _local(self, x, order, counts):
        """EP size 1: every expert is here. Returns (results in sorted order, number of kept copies)."""
        sizes = counts.tolist()  # THE host synchronisation of this layer: the loop's slice sizes
        kept = sum(sizes)
        rows = x.index_select(0, order[:kept] // self.top_k)
        return self._run_local_experts(rows, counts, sizes), kept

    def _expert_parallel(self, x, order, counts):
        """x (T, d) this rank's tokens, order (T k,) its copies sorted by expert, counts (E,) copies per expert.
        Returns (the results of its kept copies in that order (kept, d), kept). P ranks, E/P = local experts."""
        P, local = self.ep_size, self.local_experts
        send_counts = rearrange(counts, "(p e) -> p e", p=P)                 # (P, E/P): to rank p's expert e
        recv_counts = _exchange_counts(send_counts, self.ep_group)           # (P, E/P): from rank p for expert e
        # THE host synchronisation of this layer, one transfer: the send splits and the received
        # (source rank x local expert) counts, from which the receive splits and the loop's sizes follow
        host = torch.cat([send_counts.sum(1), recv_counts.reshape(-1)]).tolist()  # P + P E/P numbers
        send_splits, received_matrix = host[:P], [host[P + i * local:P + (i + 1) * local] for i in range(P)]
        recv_splits = [sum(row) for row in received_matrix]                  # P: rows from each rank
        sizes = [sum(column) for column in zip(*received_matrix)]            # E/P: rows per local expert
        kept = sum(send_splits)                                              # copies this rank sends out
        rows = x.index_select(0, order[:kept] // self.top_k)                 # (kept, d): copy j is token j // k
        # R = sum(recv_splits): the copies this rank's experts receive, from every rank (R != kept in general)
        received = _AllToAllTokens.apply(rows, send_splits, recv_splits, self.ep_group, "dispatch")  # (R, d)
        # 2. received rows are source-major (rank i, then local expert); regroup them expert-major
        cell_of_row = torch.repeat_interleave(recv_counts.reshape(-1), output_size=sum(recv_splits))  # (R,)
        regroup = torch.argsort(cell_of_row % local, stable=True)            # (R,): expert-major order
        out_rows = self._run_local_experts(received.index_select(0, regroup), recv_counts.sum(0), sizes)  # (R, d)
        back = out_rows.index_select(0, _inverse_permutation(regroup))       # (R, d): source-major again
        # 3. combine: send every result back to the rank of its token
        return _AllToAllTokens.apply(back, recv_splits, send_splits, self.ep_group, "combine"), kept  # (kept, d)


def reduce_moe_gradients(moe, dense_group, expert_group):
    """SUM router gradients over `dense_group` (DP x CP) and expert gradients over `expert_group` (EDP): an
    expert's gradient already holds every token of its EP group. The caller normalises (e.g. by the global
    token count). group=None: no communication."""
    for params, group in ((moe.dense_params(), dense_group), (moe.expert_params(), expert_group)):
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if _group_info(group)[1] > 1:
                dist.all_reduce(p.grad, group=group)


# BEYOND THE CHAPTER: DeepSeek-V3 bias balancing, grouped-GEMM experts, asynchronous all-to-alls, host syncs, the demo
import os
import tempfile
import threading

from torch.utils._python_dispatch import TorchDispatchMode

# ----------------------------------------------------------------------------------------------------
# Auxiliary-loss-free balancing (DeepSeek-V3)
# ----------------------------------------------------------------------------------------------------
# A per-expert bias is added to the probabilities for the SELECTION only (the weights stay the router's
# probabilities), and after each step bias_i += rate * sign(mean load - load_i): underloaded experts become
# more likely to be chosen, with no loss term pulling on the router's gradients.

def update_balancing_bias(bias, load, rate):
    """DeepSeek-V3 auxiliary-loss-free balancing: raise the bias of underloaded experts, lower the others.
    `load` (E,) token counts of the step (sum them over the data-parallel ranks first)."""
    if bias.dtype not in (torch.float32, torch.float64):  # steps of `rate` in 16 bits round away (bf16: stalls at 0.5)
        raise ValueError(f"bias is {bias.dtype}; keep the balancing bias in torch.float32 (as BiasBalancedRouter "
                         "keeps it)")
    with torch.no_grad():
        bias += rate * torch.sign(load.float().mean() - load.float()).to(bias.dtype)
    return bias


class BiasBalancedRouter(Router):
    """The chapter's router with DeepSeek-V3's selection-only balancing bias: a float32 buffer (E,), never trained
    by gradients, moved by update_balancing_bias."""

    def __init__(self, d_model, num_experts, top_k, normalize=True):
        super().__init__(d_model, num_experts, top_k, normalize)
        self.register_buffer("bias", torch.zeros(num_experts, dtype=torch.float32, device=self.weight.device))

    def _apply(self, fn, recurse=True):
        # .to(torch.bfloat16) or .half() would cast the bias buffer too, and the 16-bit bias would then round
        # away update_balancing_bias's small steps: it follows the module's device, never its dtype
        bias = self.bias
        out = super()._apply(fn, recurse)
        if self.bias.dtype != bias.dtype:
            self.bias = bias.to(self.bias.device)
        return out

    def select(self, probs):
        return super().select(probs + self.bias)  # the bias selects, never weights


# ----------------------------------------------------------------------------------------------------
# The experts as one grouped GEMM
# ----------------------------------------------------------------------------------------------------
# The local experts run as one `torch._grouped_mm` (a GEMM per group of rows, sizes given by a device tensor of
# offsets) where torch provides it for the device and dtype; in torch 2.13 on CPU: float32, bfloat16 and
# float16, not float64, with 16-byte aligned rows (d_model and d_hidden times the element size multiples of
# 16). Elsewhere the chapter's loop over experts runs (`expert_impl="loop"` forces it; the tests prove both
# agree). Taking the sizes as a device tensor, a dropless layer with EP size 1 on the grouped GEMM reads
# nothing back to the host at all; with EP the split sizes are still read, once.

_grouped_gemm_works = {}  # (device, dtype) -> does torch._grouped_mm run there


def grouped_gemm_supported(device, dtype):
    """Whether torch provides a grouped GEMM for this device and dtype, forward and backward, found by trying
    it once on a tiny aligned problem (the set differs by torch version and GPU generation; trying is the
    honest test). The try runs on a thread of its own: grad mode, saved-tensor hooks and dispatch modes are
    per thread, so it works under no_grad and stays invisible to the caller's activation checkpointing (whose
    recomputation would otherwise save fewer tensors than the first forward, which ran the try) and to its
    FLOP or memory counters."""
    key = (str(device), dtype)
    if key not in _grouped_gemm_works:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())

        def attempt():
            if device.type == "cuda":  # a new thread starts on GPU 0: stay off the other ranks' GPUs
                torch.cuda.set_device(device)
            try:
                a = torch.zeros(8, 8, dtype=dtype, device=device, requires_grad=True)
                w = torch.zeros(1, 8, 8, dtype=dtype, device=device, requires_grad=True)
                out = torch._grouped_mm(a, w, offs=torch.full((1,), 8, dtype=torch.int32, device=device))
                out.backward(torch.ones_like(out))  # a dense gradient, as the experts' backward receives
                _grouped_gemm_works[key] = True
            except (AttributeError, RuntimeError, NotImplementedError):
                _grouped_gemm_works[key] = False
        thread = threading.Thread(target=attempt)
        thread.start()
        thread.join()
    return _grouped_gemm_works.setdefault(key, False)  # an unexpected error (printed by the thread): unsupported


def experts_grouped(rows, w1, w2, counts):
    """experts_loop in two grouped GEMMs; `counts` (a device tensor) rows per expert, turned into the end
    offset of each expert's rows: nothing is read back to the host."""
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    return torch._grouped_mm(F.gelu(torch._grouped_mm(rows, w1, offs=offs)), w2, offs=offs)


# ----------------------------------------------------------------------------------------------------
# The MoE layer at scale: the grouped GEMM, the balancing bias
# ----------------------------------------------------------------------------------------------------

class GroupedGEMMMoE(MoE):
    """The chapter's MoE with its local experts as one grouped GEMM: `expert_impl` "auto" (the grouped GEMM where
    supported, else the chapter's loop), "grouped" (raises ValueError where unsupported) or "loop". Dropless
    at EP size 1 the grouped GEMM takes its sizes on the device, so the layer reads nothing back to the host."""

    def __init__(self, d_model, d_hidden, num_experts, top_k, ep_group=None, capacity_factor=None,
                 aux_loss_coeff=1e-2, z_loss_coeff=1e-3, normalize_topk=True, stats_group=None, expert_impl="auto"):
        if expert_impl not in ("auto", "grouped", "loop"):
            raise ValueError(f"expert_impl={expert_impl!r} must be 'auto', 'grouped' or 'loop'")
        super().__init__(d_model, d_hidden, num_experts, top_k, ep_group, capacity_factor, aux_loss_coeff,
                         z_loss_coeff, normalize_topk, stats_group)
        self.expert_impl = expert_impl

    def uses_grouped_gemm(self, x):
        """Whether forward(x) runs the experts as a grouped GEMM (decided from dtype, device and shapes)."""
        fits = (self.expert_impl != "loop" and x.dtype == self.w1.dtype and grouped_gemm_supported(x.device, x.dtype)
                and all(n * x.element_size() % 16 == 0 for n in (self.d_model, self.d_hidden)))
        if self.expert_impl == "grouped" and not fits:
            raise ValueError(f"expert_impl='grouped' but torch._grouped_mm does not run {x.dtype} on {x.device} "
                             f"with d_model={self.d_model}, d_hidden={self.d_hidden} (rows must be 16-byte "
                             "aligned); use expert_impl='auto' or 'loop'")
        return fits

    def forward(self, x):
        self.grouped = self.uses_grouped_gemm(x)  # decided (or refused) on every rank before any collective
        return super().forward(x)

    def _local(self, x, order, counts):
        if not (self.grouped and self.capacity_factor is None):
            return super()._local(x, order, counts)
        # dropless: every copy is kept, and the grouped GEMM takes the counts on the device: no host read
        rows = x.index_select(0, order // self.top_k)
        return experts_grouped(rows, self.w1, self.w2, counts), order.numel()

    def _run_local_experts(self, rows, counts, sizes):
        if self.grouped:
            return experts_grouped(rows, self.w1, self.w2, counts)
        return super()._run_local_experts(rows, counts, sizes)


class BiasBalancedMoE(MoE):
    """The chapter's MoE whose router is a BiasBalancedRouter (DeepSeek-V3): after each step, update its bias
    from the experts' load, update_balancing_bias(moe.router.bias, moe.last_load summed over DP, rate)."""

    def __init__(self, d_model, d_hidden, num_experts, top_k, *args, **kwargs):
        super().__init__(d_model, d_hidden, num_experts, top_k, *args, **kwargs)
        with torch.random.fork_rng(devices=[]):  # the chapter's router drew the weight; this draw leaves no trace
            router = BiasBalancedRouter(d_model, num_experts, top_k, self.router.normalize)
        with torch.no_grad():
            router.weight.copy_(self.router.weight)
        self.router = router


# ----------------------------------------------------------------------------------------------------
# The all-to-alls beside other work (DualPipe's overlapped forward and backward)
# ----------------------------------------------------------------------------------------------------
# The chapter's all-to-alls block until the rows have arrived. Posted with async_op=True instead, the time the rows
# travel is left to other work: OverlappedMoE hands each posted exchange (the counts, dispatch and combine, and in the
# backward their gradients') to `wait(work)`, which may run whatever else is due (the other half of a pipeline's
# forward-and-backward pair) before it waits for the rows; the default waits at once, as the chapter's layer does.
# The same rows travel, so the results are the chapter's bit for bit.

def _exchange_async(x, send_splits, recv_splits, group, kind, wait):
    """_exchange posted asynchronously: `wait(work)` runs before the output is read."""
    x = x.contiguous()
    out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
    _log(kind, send_splits, math.prod(x.shape[1:]) * x.element_size(), _group_info(group)[0])
    wait(dist.all_to_all_single(out, x, recv_splits, send_splits, group=group, async_op=True))
    return out


class _AllToAllTokensAsync(torch.autograd.Function):
    """_AllToAllTokens with both directions posted asynchronously, each handed to `wait`."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group, kind, wait):
        ctx.splits, ctx.group, ctx.kind, ctx.wait = (send_splits, recv_splits), group, kind, wait
        return _exchange_async(x, send_splits, recv_splits, group, kind + "_fwd", wait)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        grad = _exchange_async(grad, recv_splits, send_splits, ctx.group, ctx.kind + "_bwd", ctx.wait)
        return grad, None, None, None, None, None


def wait_now(work):
    work.wait()


class OverlappedMoE(MoE):
    """The chapter's MoE whose all-to-alls are posted asynchronously and handed to `self.wait` (wait_now unless the
    caller sets another): the chapter's steps of _expert_parallel, the counts' exchange through _exchange_async, the
    token rows' two through _AllToAllTokensAsync."""
    wait = staticmethod(wait_now)

    def _expert_parallel(self, x, order, counts):
        P, local = self.ep_size, self.local_experts
        send_counts = rearrange(counts, "(p e) -> p e", p=P)
        # the counts travel as a row per rank (logged as the chapter's _exchange_counts logs them), handed to `wait`
        recv_counts = _exchange_async(send_counts, [1] * P, [1] * P, self.ep_group, "counts_a2a", self.wait)
        host = torch.cat([send_counts.sum(1), recv_counts.reshape(-1)]).tolist()
        send_splits, received_matrix = host[:P], [host[P + i * local:P + (i + 1) * local] for i in range(P)]
        recv_splits = [sum(row) for row in received_matrix]
        sizes = [sum(column) for column in zip(*received_matrix)]
        kept = sum(send_splits)
        rows = x.index_select(0, order[:kept] // self.top_k)
        received = _AllToAllTokensAsync.apply(rows, send_splits, recv_splits, self.ep_group, "dispatch", self.wait)
        cell_of_row = torch.repeat_interleave(recv_counts.reshape(-1), output_size=sum(recv_splits))
        regroup = torch.argsort(cell_of_row % local, stable=True)
        out_rows = self._run_local_experts(received.index_select(0, regroup), recv_counts.sum(0), sizes)
        back = out_rows.index_select(0, _inverse_permutation(regroup))
        return _AllToAllTokensAsync.apply(back, recv_splits, send_splits, self.ep_group, "combine", self.wait), kept


class OverlappedGroupedGEMMMoE(OverlappedMoE, GroupedGEMMMoE):
    """OverlappedMoE with GroupedGEMMMoE's experts."""


# ----------------------------------------------------------------------------------------------------
# Measuring host synchronisations
# ----------------------------------------------------------------------------------------------------

_aten = torch.ops.aten
_INDEXING = (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default)


def _to_host(source, target):
    return torch.device(source).type != "cpu" and torch.device(target).type == "cpu"


class HostSyncCounter(TorchDispatchMode):
    """Counts, on any device, what makes the host wait for the device: values read back (.item() ->
    aten._local_scalar_dense, .tolist(), copies to the CPU from another device) and ops whose output size
    depends on the data (torch tags them dynamic_output_shape: nonzero, masked_select, bincount, unique,
    boolean indexing, repeat_interleave without output_size). On a CPU nothing waits, but the same calls are
    made, so the count is the one a GPU would see. Also counts tensors made from host data (torch.tensor),
    which are uploads, and every aten op seen (`ops`).

        with HostSyncCounter() as c: ...    c.syncs (Counter by kind), c.uploads, c.ops"""

    def __init__(self):
        super().__init__()
        self.syncs, self.ops, self.uploads, self._reading = Counter(), Counter(), 0, False

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        counter = self

        def tolist(t):  # never dispatched on the CPU: it reads memory directly, so it is wrapped here
            counter._sync("tolist")
            reading, counter._reading = counter._reading, True  # on a GPU it dispatches a copy: count once
            try:
                return counter._tolist(t)
            finally:
                counter._reading = reading

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def _sync(self, kind):
        if not self._reading:
            self.syncs[kind] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops[func.overloadpacket.__name__] += 1
        if func in _INDEXING:
            if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
                self._sync("boolean index")
        elif func is _aten.repeat_interleave.Tensor:
            if kwargs.get("output_size") is None:
                self._sync("repeat_interleave without output_size")
        elif torch.Tag.data_dependent_output in func.tags or torch.Tag.dynamic_output_shape in func.tags:
            self._sync(func.overloadpacket.__name__)
        elif func is _aten._to_copy.default:
            if _to_host(args[0].device, kwargs.get("device") or args[0].device):
                self._sync("copy to host")
        elif func is _aten.copy_.default:
            if _to_host(args[1].device, args[0].device):
                self._sync("copy to host")
        elif func is _aten.lift_fresh.default:
            self.uploads += 1
        return func(*args, **kwargs)


# ----------------------------------------------------------------------------------------------------
# The demo
# ----------------------------------------------------------------------------------------------------

def _init():
    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group("gloo")
        else:
            store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def _forward_backward_syncs(moe, x):
    """Host synchronisations of one forward + backward of `moe`, counted by HostSyncCounter."""
    with HostSyncCounter() as counter:
        y, aux = moe(x)
        (y.square().sum() + aux).backward()
    return y, aux, counter


def _say(text):
    """Print on rank 0 only: every rank measures, one speaks."""
    if dist.get_rank() == 0:
        print(text)


def show_dispatch_matrix(moe, x):
    """Who sent how many token copies to whom in `moe`'s last forward (of `x`), and every expert's load.
    Returns this rank's row: the copies it sent to each rank."""
    P, E = moe.ep_size, moe.num_experts
    send = rearrange(moe.last_load, "(p e) -> p e", p=P).sum(1).to(torch.float64)
    matrix = [torch.zeros(P, dtype=torch.float64) for _ in range(P)]
    dist.all_gather(matrix, send)
    loads = moe.last_load.clone()
    dist.all_reduce(loads)
    _say(f"== MoE: d={moe.d_model}, hidden={moe.d_hidden}, E={E} experts, top-{moe.top_k}, EP over {P} rank(s) "
         f"({E // P} experts each), T={x.shape[0]} tokens per rank, {str(x.dtype).replace('torch.', '')}")
    _say("   dispatch matrix (token copies rank i -> rank j):")
    for i, row in enumerate(matrix):
        _say(f"     from {i}: {[int(v) for v in row.tolist()]}")
    _say(f"   expert loads (copies per expert, all ranks): {loads.tolist()}")
    return matrix[dist.get_rank()].tolist()


def show_all_to_all_bytes(moe, x, sent):
    """comm_log's bytes per all-to-all against the copies this rank sent away (`sent`, by destination) and the
    uniform-routing formula; then every collective of the forward and backward, counted."""
    T, k, d, P, e = x.shape[0], moe.top_k, moe.d_model, moe.ep_size, x.element_size()
    away = sum(n for j, n in enumerate(sent) if j != dist.get_rank())
    _say(f"   rank 0 bytes per all-to-all (measured from the splits): dispatch {comm_log['dispatch_fwd:bytes']} "
         f"(= {int(away)} copies sent away x d x e), combine {comm_log['combine_fwd:bytes']}; "
         f"uniform-routing formula T k d e (P-1)/P = {T * k * d * e * (P - 1) / P:.0f}")
    counts = {key[:-6]: v for key, v in comm_log.items() if key.endswith(":count")}
    _say(f"   collectives on rank 0 (forward + backward): {counts}")


def show_one_host_sync_per_layer(moe, counter):
    _say(f"   host synchronisations on rank 0 (forward + backward, counted): {sum(counter.syncs.values())} "
         f"{dict(counter.syncs)}, tensors made from host data: {counter.uploads}; design: 1 per layer per "
         f"micro-batch ({'the split sizes' if moe.ep_size > 1 else 'the expert loop sizes'})")


def show_ep_equals_one_process(moe, reference, x_all, x, y, aux):
    """`moe`'s output, input, expert and router gradients (`y`, `aux` and the gradients of its forward and
    backward on this rank's slice `x`) against `reference`, one process on all tokens `x_all`."""
    rank, P, T, local = dist.get_rank(), moe.ep_size, x.shape[0], moe.local_experts
    x_ref = x_all.clone().requires_grad_(True)
    y_ref, aux_ref = reference(x_ref)
    (y_ref.square().sum() + aux_ref).backward()
    mine = slice(rank * T, (rank + 1) * T)
    errs = torch.tensor([
        (y - y_ref[mine]).abs().max().item(),
        (x.grad - x_ref.grad[mine]).abs().max().item(),
        (moe.w1.grad - reference.w1.grad[rank * local:(rank + 1) * local]).abs().max().item(),
        abs(aux.item() - aux_ref.item()),
    ])
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    router_grad = moe.router.weight.grad.clone()
    dist.all_reduce(router_grad)  # each rank holds its tokens' share of the router's gradient
    _say(f"   against the single-process MoE on all {P * T} tokens: max |dy| {errs[0]:.1e}, |dx| {errs[1]:.1e}, "
         f"|dW_expert| {errs[2]:.1e}, |d aux| (statistics summed over the ranks) {errs[3]:.1e}, "
         f"|d router grad (summed)| {(router_grad - reference.router.weight.grad).abs().max().item():.1e}")


def show_grouped_gemm_equals_loop(moe, x):
    """The same layer as `moe` in float32, its experts as a loop and as torch._grouped_mm where supported."""
    results, supported = {}, grouped_gemm_supported(x.device, torch.float32)
    for impl in ("loop", "grouped") if supported else ("loop",):
        torch.manual_seed(0)
        m = GroupedGEMMMoE(moe.d_model, moe.d_hidden, moe.num_experts, moe.top_k, ep_group=moe.ep_group,
                           stats_group=moe.stats_group, expert_impl=impl).float()
        x32 = x.detach().float().requires_grad_(True)
        y32, _, c = _forward_backward_syncs(m, x32)
        results[impl] = (y32, x32.grad, m.w1.grad, sum(c.syncs.values()), c.ops["_grouped_mm"])
    if not supported:
        _say(f"== float32 experts on {x.device}: torch._grouped_mm not available here, the loop runs")
        return
    pairs = zip(results["loop"][:3], results["grouped"][:3])
    diff = torch.tensor(max((a - b).abs().max().item() for a, b in pairs))
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    _say(f"== float32 experts on {x.device}: loop vs torch._grouped_mm ({results['grouped'][4]} grouped GEMM calls "
         f"forward + backward): max |d y, dx, dW1| {diff.item():.1e}; host synchronisations: loop "
         f"{results['loop'][3]}, grouped {results['grouped'][3]} (with EP size 1 a dropless grouped layer reads "
         "nothing back)")


def show_balancing_loss_from_coeff_to_coeff_times_e():
    lb = load_balancing_loss(torch.zeros(12, 4), 1, 1.0, selected=torch.arange(12).remainder(4)[:, None])
    skew = torch.zeros(12, 4)
    skew[:, 0] = 5.0
    _say(f"== load balancing loss (coeff 1): uniform routing {lb.item():.3f} (= coeff), all tokens on one "
         f"expert {load_balancing_loss(skew, 1, 1.0).item():.3f} (-> coeff * E = 4 as the logit gap grows)")


def show_capacity(moe, x, capacity_factor=1.0):
    """The same layer with a capacity: no expert takes more than C = ceil(cf T k / E) of a rank's copies."""
    torch.manual_seed(0)
    capped = MoE(moe.d_model, moe.d_hidden, moe.num_experts, moe.top_k, ep_group=moe.ep_group,
                 capacity_factor=capacity_factor)
    with torch.no_grad():
        capped(x)
    T, k, E = x.shape[0], moe.top_k, moe.num_experts
    C = expert_capacity(T, k, E, capacity_factor)
    kept = int(capped.last_load.sum())
    _say(f"== capacity factor {capacity_factor}: C = ceil(cf T k / E) = ceil({capacity_factor} x {T} x {k} / {E}) = "
         f"{C} copies per expert per rank; rank 0 keeps {capped.last_load.tolist()} (dropless: "
         f"{moe.last_load.tolist()}), {T * k - kept} of its {T * k} copies dropped (their slots contribute zero)")


def show_balancing_bias_update():
    bias = torch.zeros(4)
    update_balancing_bias(bias, torch.tensor([10.0, 2.0, 2.0, 2.0]), rate=1e-3)
    _say(f"== balancing bias after one update with loads [10, 2, 2, 2]: {bias.tolist()}")


def demo():
    rank, P = _init()
    torch.set_default_dtype(torch.float64)
    d, h, E, k, T = 16, 32, 8 if P != 3 else 6, 2, 64
    group = dist.group.WORLD
    torch.manual_seed(0)
    moe = MoE(d, h, E, k, ep_group=group, stats_group=group)
    torch.manual_seed(0)
    reference = MoE(d, h, E, k)  # one process, all experts, all tokens
    x_all = torch.randn(P * T, d, generator=torch.Generator().manual_seed(1))
    x = x_all[rank * T:(rank + 1) * T].clone().requires_grad_(True)
    comm_log.clear()
    y, aux, counter = _forward_backward_syncs(moe, x)  # the one step every claim below reads
    sent = show_dispatch_matrix(moe, x)
    show_all_to_all_bytes(moe, x, sent)
    show_ep_equals_one_process(moe, reference, x_all, x, y, aux)
    show_one_host_sync_per_layer(moe, counter)
    show_balancing_loss_from_coeff_to_coeff_times_e()
    show_capacity(moe, x)
    _say("== beyond the chapter")
    show_grouped_gemm_equals_loop(moe, x)
    show_balancing_bias_update()
    dist.barrier()  # gloo aborts a rank that tears down while a peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    demo()
