"""Mixture of Experts with expert parallelism: top-k router, balancing losses, all-to-all dispatch/combine.

An MoE layer replaces one MLP by E expert MLPs and a router. Each token goes to its top-k experts and
their outputs are summed with the router's weights: parameters grow E times, FLOPs per token only k times.

Router. logits = x W_r (T x E); probabilities by a softmax over ALL experts; the top-k per token are
selected and (by default, as Mixtral) their weights renormalised to sum to one. Without pressure the router
collapses onto a few experts, so two auxiliary losses are added (Switch Transformer, ST-MoE, Megatron-LM):

    load balancing   coeff * E * sum_i f_i P_i      f_i: share of the T*k assignments sent to expert i
                                                    P_i: mean router probability of expert i over tokens
    router z-loss    coeff * mean_t (logsumexp_i logits_ti)^2   (keeps logits small, softmax stable)

f is not differentiable; the gradient flows through P, pushing probability away from overloaded experts.
Perfectly uniform routing (f_i = P_i = 1/E) gives exactly coeff; concentrating every token on one expert
with certainty gives coeff * E. Optional
capacity factor cf: each expert takes at most ceil(T k / E * cf) assignments, the lowest-probability ones
are dropped (their slot contributes zero); the default None is dropless. Optional auxiliary-loss-free
balancing (DeepSeek-V3): a per-expert bias is added to the scores for the SELECTION only, and after each
step bias_i += rate * sign(mean load - load_i).

Expert parallelism. With an EP group of P ranks each rank holds E/P experts (expert e on EP rank
e // (E/P)) and T local tokens. One forward is four steps:
  1. dispatch: sort the T*k token copies by expert; exchange per-expert counts (a small all-to-all); send
     each copy to the rank of its expert with an uneven all_to_all_single;
  2. compute: regroup the received copies expert-major and run each local expert on its slice;
  3. combine: the reverse all-to-all returns each result to the rank of its token;
  4. unpermute and sum the k results of each token, weighted by the router.
The backward is the same two all-to-alls in reverse. Bytes sent per all-to-all per rank:
T k d e (P-1)/P under uniform routing (a copy stays home with probability 1/P).

Where EP lives (Megatron "MoE parallel folding", see topology.py): EP groups are drawn from the data- and
context-parallel ranks of one (tp, pp) position; the ranks holding the same experts form the expert-data-
parallel group EDP, with EP x EDP = DP x CP. Dense weights (router, attention) are all-reduced over DP x CP;
expert weights over EDP only, because an expert's gradient already sums the tokens of its whole EP group.
Both are scaled by 1 / (DP x CP), the number of ranks whose mean loss is the objective.

Run `torchrun --nproc_per_node=4 moe_ep.py` (or `python moe_ep.py` for one rank).
"""
import math
import os
import tempfile
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

comm_log = Counter()  # collectives issued by this rank: counts and bytes that left it, by kind


def _group_info(group):
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


# ----------------------------------------------------------------------------------------------------
# Auxiliary losses (optionally over a group of ranks that share one batch of tokens)
# ----------------------------------------------------------------------------------------------------

def _global_value(local_part, group):
    """Forward value: the sum over `group` of every rank's part; gradient: this rank's part only. Each rank's
    logits then receive exactly the gradient of the global loss with respect to them."""
    if _group_info(group)[1] == 1:
        return local_part
    total = local_part.detach().clone()
    dist.all_reduce(total, group=group)
    return local_part + (total - local_part.detach())


def _global_sum(t, group):
    t = t.detach().clone()
    if _group_info(group)[1] > 1:
        dist.all_reduce(t, group=group)
    return t


def load_balancing_loss(router_logits, top_k, coeff, group=None, selected=None):
    """Switch/Megatron: coeff * E * sum_i f_i P_i over the tokens of this rank, or of all ranks of `group`.

    `selected` (T, k) are the experts actually chosen (e.g. with a balancing bias); default top-k of logits."""
    T, E = router_logits.shape
    probs = torch.softmax(router_logits.float() if router_logits.dtype != torch.float64 else router_logits, -1)
    if selected is None:
        selected = probs.topk(top_k, dim=-1).indices
    counts = torch.bincount(selected.reshape(-1), minlength=E).to(probs.dtype)
    counts = _global_sum(counts, group)
    tokens = _global_sum(torch.tensor(float(T), dtype=probs.dtype, device=probs.device), group)
    f = counts / (tokens * top_k)
    local_part = coeff * E * (f * probs.sum(0)).sum() / tokens  # P_i = sum over all tokens / T_global
    return _global_value(local_part, group)


def z_loss(router_logits, coeff, group=None):
    """ST-MoE router z-loss: coeff * mean over tokens of logsumexp(logits)^2."""
    lse = torch.logsumexp(router_logits.float() if router_logits.dtype != torch.float64 else router_logits, -1)
    tokens = _global_sum(torch.tensor(float(lse.shape[0]), dtype=lse.dtype, device=lse.device), group)
    return _global_value(coeff * (lse ** 2).sum() / tokens, group)


def update_balancing_bias(bias, load, rate):
    """DeepSeek-V3 auxiliary-loss-free balancing: raise the bias of underloaded experts, lower the others.
    `load` (E,) token counts of the step (sum them over the data-parallel ranks first)."""
    with torch.no_grad():
        bias += rate * torch.sign(load.float().mean() - load.float()).to(bias.dtype)
    return bias


def expert_capacity(tokens, top_k, num_experts, capacity_factor):
    return math.ceil(tokens * top_k / num_experts * capacity_factor)


# ----------------------------------------------------------------------------------------------------
# Router
# ----------------------------------------------------------------------------------------------------

class Router(nn.Module):
    def __init__(self, d_model, num_experts, top_k, normalize=True, balancing_bias=False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        nn.init.normal_(self.weight, std=d_model ** -0.5)
        self.top_k, self.normalize = top_k, normalize
        # selection-only bias of auxiliary-loss-free balancing: a buffer, never trained by gradients
        self.register_buffer("bias", torch.zeros(num_experts) if balancing_bias else None)

    def forward(self, x):
        """x (T, d) -> logits (T, E), weights (T, k), experts (T, k)."""
        logits = x @ self.weight.t()
        probs = torch.softmax(logits.float() if logits.dtype != torch.float64 else logits, dim=-1)
        scores = probs if self.bias is None else probs + self.bias
        experts = scores.topk(self.top_k, dim=-1).indices
        weights = probs.gather(-1, experts)  # the bias selects, it never weights
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights.to(x.dtype), experts


def apply_capacity(experts, weights, num_experts, capacity):
    """Keep, for every expert, its `capacity` highest-weight assignments; returns a (T, k) keep mask."""
    flat_e, flat_w = experts.reshape(-1), weights.reshape(-1).detach()
    by_weight = torch.argsort(flat_w, descending=True, stable=True)
    order = by_weight[torch.argsort(flat_e[by_weight], stable=True)]  # expert-major, heaviest first
    counts = torch.bincount(flat_e, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(order)
    slot[order] = torch.arange(order.numel(), device=order.device) - starts[flat_e[order]]
    return (slot < capacity).view_as(experts)


# ----------------------------------------------------------------------------------------------------
# The all-to-alls
# ----------------------------------------------------------------------------------------------------

def _log(kind, rows, row_bytes, rank):
    comm_log[kind + ":count"] += 1
    comm_log[kind + ":bytes"] += sum(n for j, n in enumerate(rows) if j != rank) * row_bytes


class _AllToAllTokens(torch.autograd.Function):
    """Uneven all_to_all_single of token rows; the backward sends the gradients back along the same routes."""

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


# ----------------------------------------------------------------------------------------------------
# The MoE layer
# ----------------------------------------------------------------------------------------------------

class MoE(nn.Module):
    """Top-k MoE of GELU MLP experts, expert-parallel over `ep_group`. forward(x) -> (y, aux_loss).

    Layout-independent initialisation: the router and ALL experts' weights are drawn from the default RNG in
    the same order on every rank and each rank keeps its slice, so under one seed every layout holds the
    same global weights (simple and exact; a production model would seed a generator per expert instead)."""

    def __init__(self, d_model, d_hidden, num_experts, top_k, ep_group=None, capacity_factor=None,
                 aux_loss_coeff=1e-2, z_loss_coeff=1e-3, normalize_topk=True, balancing_bias=False,
                 stats_group=None):
        super().__init__()
        ep_rank, ep_size = _group_info(ep_group)
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by the EP group size {ep_size}; "
                             f"use an EP size dividing {num_experts}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be positive, or None for dropless")
        self.d_model, self.num_experts, self.top_k = d_model, num_experts, top_k
        self.ep_group, self.ep_rank, self.ep_size = ep_group, ep_rank, ep_size
        self.local_experts = num_experts // ep_size
        self.capacity_factor, self.stats_group = capacity_factor, stats_group
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        self.router = Router(d_model, num_experts, top_k, normalize_topk, balancing_bias)
        w1 = torch.randn(num_experts, d_model, d_hidden) * d_model ** -0.5
        w2 = torch.randn(num_experts, d_hidden, d_model) * d_hidden ** -0.5
        mine = slice(ep_rank * self.local_experts, (ep_rank + 1) * self.local_experts)
        self.w1 = nn.Parameter(w1[mine].clone())
        self.w2 = nn.Parameter(w2[mine].clone())
        self.last_load = None  # tokens per expert of the last forward (local tokens), for the bias update

    def expert_params(self):
        return [self.w1, self.w2]

    def dense_params(self):
        return list(self.router.parameters())

    def _route(self, x):
        logits, weights, experts = self.router(x)
        keep = torch.ones_like(experts, dtype=torch.bool)
        if self.capacity_factor is not None:
            cap = expert_capacity(x.shape[0], self.top_k, self.num_experts, self.capacity_factor)
            keep = apply_capacity(experts, weights, self.num_experts, cap)
        return logits, weights, experts, keep

    def _run_local_experts(self, tokens, expert_of_row):
        """tokens sorted expert-major; expert_of_row (N,) local expert index of each row."""
        counts = torch.bincount(expert_of_row, minlength=self.local_experts).tolist()
        outs = []
        for e, rows in enumerate(tokens.split(counts)):
            outs.append(F.gelu(rows @ self.w1[e]) @ self.w2[e])
        return torch.cat(outs) if outs else tokens

    def forward(self, x):
        if x.shape[-1] != self.d_model:
            raise ValueError(f"input's last dim {x.shape[-1]} != d_model={self.d_model}")
        shape = x.shape
        x = x.reshape(-1, self.d_model)
        T, k, E, P = x.shape[0], self.top_k, self.num_experts, self.ep_size
        logits, weights, experts, keep = self._route(x)
        aux = load_balancing_loss(logits, k, self.aux_loss_coeff, self.stats_group, selected=experts) + \
            z_loss(logits, self.z_loss_coeff, self.stats_group)

        # 1. the kept token copies, sorted by expert (= by destination rank, then local expert)
        token_of_copy = torch.arange(T, device=x.device).repeat_interleave(k)[keep.reshape(-1)]
        expert_of_copy = experts.reshape(-1)[keep.reshape(-1)]
        order = torch.argsort(expert_of_copy, stable=True)
        sorted_tokens = x[token_of_copy[order]]
        counts = torch.bincount(expert_of_copy, minlength=E)
        self.last_load = counts.detach()
        if P == 1:
            y_sorted = self._run_local_experts(sorted_tokens, expert_of_copy[order])
        else:
            send_counts = rearrange(counts, "(p e) -> p e", p=P)
            recv_counts = _exchange_counts(send_counts, self.ep_group)
            send_splits, recv_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
            received = _AllToAllTokens.apply(sorted_tokens, send_splits, recv_splits, self.ep_group, "dispatch")
            # 2. received rows are source-major (rank i, then local expert); regroup expert-major
            local_expert = torch.arange(self.local_experts, device=x.device).repeat(P)
            expert_of_row = local_expert.repeat_interleave(recv_counts.reshape(-1))
            regroup = torch.argsort(expert_of_row, stable=True)
            out_rows = self._run_local_experts(received[regroup], expert_of_row[regroup])
            back = torch.empty_like(out_rows)
            back[regroup] = out_rows
            # 3. combine: send every result back to the rank of its token
            y_sorted = _AllToAllTokens.apply(back, recv_splits, send_splits, self.ep_group, "combine")
        # 4. unpermute and sum the k weighted results per token
        weight_of_copy = weights.reshape(-1)[keep.reshape(-1)]
        y = torch.zeros_like(x).index_add(0, token_of_copy[order], y_sorted * weight_of_copy[order, None])
        return y.reshape(shape), aux


def reduce_moe_gradients(moe, dense_group, expert_group, dense_world):
    """Sum router gradients over `dense_group` (DP x CP) and expert gradients over `expert_group` (EDP), both
    divided by `dense_world` = DP x CP: an expert's gradient already holds every token of its EP group."""
    for params, group in ((moe.dense_params(), dense_group), (moe.expert_params(), expert_group)):
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if _group_info(group)[1] > 1:
                dist.all_reduce(p.grad, group=group)
            p.grad.div_(dense_world)


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


def demo():
    rank, P = _init()
    say = print if rank == 0 else (lambda *a, **k: None)
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
    y, aux = moe(x)
    (y.square().sum() + aux).backward()
    send = rearrange(moe.last_load, "(p e) -> p e", p=P).sum(1).to(torch.float64)
    matrix = [torch.zeros(P, dtype=torch.float64) for _ in range(P)]
    dist.all_gather(matrix, send)
    loads = moe.last_load.clone()
    dist.all_reduce(loads)
    say(f"== MoE: d={d}, hidden={h}, E={E} experts, top-{k}, EP over {P} rank(s) ({E // P} experts each), "
        f"T={T} tokens per rank, float64")
    say("   dispatch matrix (token copies rank i -> rank j):")
    for i, row in enumerate(matrix):
        say(f"     from {i}: {[int(v) for v in row.tolist()]}")
    say(f"   expert loads (copies per expert, all ranks): {loads.tolist()}")
    e_bytes = x.element_size()
    mine = matrix[rank].tolist()
    say(f"   rank 0 bytes per all-to-all (measured from the splits): dispatch {comm_log['dispatch_fwd:bytes']} "
        f"(= {int(sum(n for j, n in enumerate(mine) if j != 0))} copies sent away x d x e), combine "
        f"{comm_log['combine_fwd:bytes']}; uniform-routing formula T k d e (P-1)/P = "
        f"{T * k * d * e_bytes * (P - 1) / P:.0f}")
    counts = {key[:-6]: v for key, v in comm_log.items() if key.endswith(":count")}
    say(f"   collectives on rank 0 (forward + backward): {counts}")

    x_ref = x_all.clone().requires_grad_(True)
    y_ref, aux_ref = reference(x_ref)
    (y_ref.square().sum() + aux_ref).backward()
    errs = torch.tensor([
        (y - y_ref[rank * T:(rank + 1) * T]).abs().max().item(),
        (x.grad - x_ref.grad[rank * T:(rank + 1) * T]).abs().max().item(),
        (moe.w1.grad - reference.w1.grad[rank * (E // P):(rank + 1) * (E // P)]).abs().max().item(),
        abs(aux.item() - aux_ref.item()),
    ])
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    router_grad = moe.router.weight.grad.clone()
    dist.all_reduce(router_grad)
    say(f"   against the single-process MoE on all {P * T} tokens: max |dy| {errs[0]:.1e}, |dx| {errs[1]:.1e}, "
        f"|dW_expert| {errs[2]:.1e}, |d aux| {errs[3]:.1e}, |d router grad (summed)| "
        f"{(router_grad - reference.router.weight.grad).abs().max().item():.1e}")

    lb = load_balancing_loss(torch.zeros(12, 4), 1, 1.0, selected=torch.arange(12).remainder(4)[:, None])
    skew = torch.zeros(12, 4)
    skew[:, 0] = 5.0
    say(f"== load balancing loss (coeff 1): uniform routing {lb.item():.3f} (= coeff), all tokens on one "
        f"expert {load_balancing_loss(skew, 1, 1.0).item():.3f} (-> coeff * E = 4 as the logit gap grows)")
    bias = torch.zeros(4)
    update_balancing_bias(bias, torch.tensor([10.0, 2.0, 2.0, 2.0]), rate=1e-3)
    say(f"== balancing bias after one update with loads [10, 2, 2, 2]: {bias.tolist()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    demo()
