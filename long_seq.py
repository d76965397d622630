"""Long sequences: Ring Attention, Ulysses and context-parallel (zigzag) sharding.

Attention costs O(s^2) compute and, unfused, O(s^2) memory; at 128K+ tokens even one layer's activations
outgrow a GPU. Four techniques split the sequence, and they differ in WHAT they split and WHERE they talk:

    technique            splits                          collectives per layer                 constraint
    Megatron SP          non-attention activations       all-gather + reduce-scatter (in TP)   inside a TP group
                         (LayerNorm, dropout) along s
    context parallel     every activation along s        only inside attention (ring/Ulysses) s % 2P (zigzag)
    Ring Attention       q, k, v along s; KV travels      P-1 KV sends fwd; P-1 KV + P dKV bwd  any head count
    Ulysses              s -> heads by all-to-all         4 all-to-alls fwd (q, k, v, out), 4 bwd  H % P

Per GPU per layer (bytes sent, forward, e bytes per element, s the full sequence, P ranks):
    Ring:      (P-1) x 2 b (s/P) h_kv d e = 2 (P-1)/P b s h_kv d e   (overlappable with the block compute)
    Ulysses:   (P-1)/P^2 b s (2 h + 2 h_kv) d e   (one all-to-all sends (P-1)/P of a (s/P)-long tensor)
    All-gather CP (Llama 3): the same bytes as the ring's KV, in one exposed all-gather, full K and V held.
Memory per rank: Ring keeps only O(s/P): q, k, v, out of its shard and the log-sum-exp (b h s/P); Ulysses
holds full-sequence activations for h/P heads, also s/P of the total.

Ring Attention (Liu et al. 2023). Rank r holds a shard of q, k, v. In P steps the KV shards travel around
the ring (r sends to r+1, receives from r-1), the next transfer in flight while the current block is
computed. Each block yields a partial output o_i with its row log-sum-exp l_i; partial results merge
exactly: l = logaddexp(l_a, l_b), o = e^(l_a - l) o_a + e^(l_b - l) o_b, in FP32 (or wider) accumulators.
The backward repeats the ring from the saved out and l (as FlashAttention does): dQ stays local, dK and dV
travel with their KV block and arrive home after P hops.

Causal load balancing. With contiguous shards, under a causal mask rank 0 attends to one block and rank
P-1 to P: the last rank does ~2P-1 times the work of the first, and everyone waits for it. Zigzag cuts the
sequence into 2P chunks and gives rank r chunks r and 2P-1-r: one early and one late chunk. Then at
ring step 0 a rank computes its causal diagonal block and at every later step exactly half a block: all
of q against the first half of a KV block from an earlier rank, or the second half of q against all of a
KV block from a later rank. Every rank does the same work at every step. Positions (for RoPE) and labels
must be sharded the same way: `zigzag_shard` keeps global position ids if you shard `arange(s)`.

Ulysses (Jacobs et al. 2023, DeepSpeed). Each rank holds a contiguous sequence shard of all heads; an
all-to-all trades it for the full sequence of H/P heads, ordinary attention runs per head, and a reverse
all-to-all restores sequence shards. The heads must divide by P; with grouped-query attention and fewer
KV heads than ranks, each KV head is replicated (`repeat_interleave`, so query head i still meets KV head
i // (H/H_kv)).

Run `torchrun --nproc_per_node=4 long_seq.py` (or plain `python long_seq.py` for one rank).
"""
import math
import os
import tempfile
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange

# What each collective of this file sent from this rank: counts and bytes, by kind. Reset with .clear().
comm_log = Counter()
# Attended (query, key) pairs computed by this rank's ring-attention forward, by ring step.
work_log = Counter()


def _log(kind, tensor, fraction=1.0):
    """Count one collective and the bytes that leave this rank (`fraction` of the tensor)."""
    comm_log[kind + ":count"] += 1
    comm_log[kind + ":bytes"] += round(tensor.numel() * tensor.element_size() * fraction)


def _sent_fraction(group):
    """An all-to-all keeps 1/P of its buffer and sends (P-1)/P; so does a ring reduce-scatter."""
    _, world = _group_info(group)
    return (world - 1) / world


def _group_info(group):
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


# ----------------------------------------------------------------------------------------------------
# Sharding the sequence
# ----------------------------------------------------------------------------------------------------

def zigzag_shard(x, dim, rank, world):
    """Rank `rank`'s zigzag shard of x along `dim`: chunks rank and 2*world-1-rank of 2*world."""
    if x.shape[dim] % (2 * world):
        raise ValueError(f"sequence length {x.shape[dim]} (dim {dim}) is not divisible by 2*world = {2 * world}; "
                         f"pad the sequence to a multiple of {2 * world}")
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def zigzag_unshard(shards, dim):
    """Inverse of zigzag_shard: the full tensor from the list of every rank's shard (rank order)."""
    world = len(shards)
    halves = [s.chunk(2, dim=dim) for s in shards]
    return torch.cat([halves[r][0] for r in range(world)] + [halves[r][1] for r in reversed(range(world))], dim=dim)


def contiguous_shard(x, dim, rank, world):
    """Rank `rank`'s contiguous shard of x along `dim` (Ulysses, non-causal ring)."""
    if x.shape[dim] % world:
        raise ValueError(f"sequence length {x.shape[dim]} (dim {dim}) is not divisible by world = {world}; "
                         f"pad the sequence to a multiple of {world}")
    return x.chunk(world, dim=dim)[rank]


def _check_qkv(q, k, v):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be (batch, heads, seq, head_dim), the scaled_dot_product_attention layout")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; k and v "
                         "must match, and share batch, seq and head_dim with q")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads H={q.shape[1]} must be a multiple of KV heads H_kv={k.shape[1]} (GQA)")


# ----------------------------------------------------------------------------------------------------
# One block of attention, forward and backward, with explicit log-sum-exp
# ----------------------------------------------------------------------------------------------------

def _repeat_kv(t, heads):
    """GQA: KV head j serves query heads j*g .. j*g+g-1 (g = H / H_kv)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _sum_kv_groups(t, kv_heads):
    return t if t.shape[1] == kv_heads else rearrange(t, "b (hk g) s d -> b hk g s d", hk=kv_heads).sum(2)


def _scores(q, k, scale, causal, acc):
    s = torch.einsum("bhqd,bhkd->bhqk", q.to(acc), _repeat_kv(k, q.shape[1]).to(acc)) * scale
    if causal:  # a diagonal block: local order is global order within it
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _block_forward(q, k, v, scale, causal, acc):
    s = _scores(q, k, scale, causal, acc)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("bhqk,bhkd->bhqd", p, _repeat_kv(v, q.shape[1]).to(acc))
    b, h, rows, cols = s.shape  # attended pairs, from the shapes (no device sync)
    work_log["pairs"] += b * h * (rows * (rows + 1) // 2 if causal else rows * cols)
    return out, lse


def _block_backward(q, k, v, dout, lse, delta, scale, causal, acc):
    """Gradients of one block from the final lse and delta = rowsum(dout * out) (FlashAttention-2)."""
    s = _scores(q, k, scale, causal, acc)
    p = torch.exp(s - lse[..., None])
    vx = _repeat_kv(v, q.shape[1]).to(acc)
    dv = torch.einsum("bhqk,bhqd->bhkd", p, dout)
    dp = torch.einsum("bhqd,bhkd->bhqk", dout, vx)
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("bhqk,bhkd->bhqd", ds, _repeat_kv(k, q.shape[1]).to(acc)) * scale
    dk = torch.einsum("bhqk,bhqd->bhkd", ds, q.to(acc)) * scale
    return dq, _sum_kv_groups(dk, k.shape[1]), _sum_kv_groups(dv, k.shape[1])


def _merge(out, lse, block_out, block_lse):
    """Fold a block's (out, lse) into the running ones, in place: the stable log-sum-exp merge."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse)[..., None]).add_(block_out * torch.exp(block_lse - new_lse)[..., None])
    lse.copy_(new_lse)


def _ring_blocks(step, rank, src, s_local, causal):
    """Which rows of q meet which columns of the KV block from rank `src`, and whether the block is diagonal.

    Zigzag causal: step 0 is the causal diagonal; a block from an earlier rank is attended by all of q but
    only in its first half (its early chunk); a block from a later rank only by q's second half (our late
    chunk), in full. Non-causal: everything."""
    full = slice(0, s_local)
    if not causal:
        return full, full, False
    half = s_local // 2
    if step == 0:
        return full, full, True
    if src < rank:
        return full, slice(0, half), False
    return slice(half, s_local), full, False


# ----------------------------------------------------------------------------------------------------
# Ring attention
# ----------------------------------------------------------------------------------------------------

def _ring_exchange(send, group, kind):
    """Send `send` to the next rank of the ring, receive the previous rank's; returns (buffer, requests)."""
    rank, world = _group_info(group)
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, dist.get_global_rank(group, (rank + 1) % world), group),
           dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (rank - 1) % world), group)]
    _log(kind, send)
    return recv, dist.batch_isend_irecv(ops)


def _wait(requests):
    for r in requests:
        r.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale):
        rank, world = _group_info(group)
        acc = torch.promote_types(q.dtype, torch.float32)
        b, h, s_local, d = q.shape
        out = torch.zeros(b, h, s_local, d, dtype=acc, device=q.device)
        lse = torch.full((b, h, s_local), float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v])  # one message per hop
        for step in range(world):
            if step < world - 1:  # start the next hop now: it overlaps this block's compute
                next_kv, requests = _ring_exchange(kv, group, "ring_kv_fwd")
            src = (rank - step) % world
            rows, cols, diagonal = _ring_blocks(step, rank, src, s_local, causal)
            o, l = _block_forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], scale, diagonal, acc)
            _merge(out[:, :, rows], lse[:, :, rows], o, l)
            if step < world - 1:
                _wait(requests)
                kv = next_kv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        rank, world = _group_info(group)
        acc = lse.dtype
        s_local = q.shape[2]
        dout = dout.contiguous().to(acc)
        delta = (dout * out.to(acc)).sum(-1)
        dq = torch.zeros_like(q, dtype=acc)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv, dtype=acc)  # the gradient of the KV block we hold; it travels with it
        for step in range(world):
            if step < world - 1:
                next_kv, kv_requests = _ring_exchange(kv, group, "ring_kv_bwd")
            src = (rank - step) % world
            rows, cols, diagonal = _ring_blocks(step, rank, src, s_local, causal)
            dq_b, dk_b, dv_b = _block_backward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                               dout[:, :, rows], lse[:, :, rows], delta[:, :, rows],
                                               scale, diagonal, acc)
            dq[:, :, rows] += dq_b
            dkv[0][:, :, cols] += dk_b
            dkv[1][:, :, cols] += dv_b
            if world > 1:
                if step < world - 1:
                    _wait(kv_requests)
                    kv = next_kv
                # after the last step this hop brings our own block's finished gradient home
                dkv, dkv_requests = _ring_exchange(dkv, group, "ring_dkv_bwd")
                _wait(dkv_requests)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q, k, v, group, causal=True, scale=None):
    """Attention over a sequence sharded across `group`. (batch, heads, seq_local, head_dim) tensors.

    causal=True expects the zigzag layout (zigzag_shard of the full sequence); causal=False any consistent
    sharding. GQA/MQA: k and v may have fewer heads than q. Validation happens before any communication."""
    _check_qkv(q, k, v)
    _, world = _group_info(group)
    if causal and q.shape[2] % 2:
        raise ValueError(f"causal ring attention takes zigzag shards (two chunks per rank): the local sequence "
                         f"length {q.shape[2]} must be even, i.e. the full length a multiple of 2*P = {2 * world}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), group, causal, scale)


def ring_saved_bytes(b, h, h_kv, s_local, d, dtype):
    """Bytes ring attention keeps for backward: q, out (h heads), k, v (h_kv heads) and the lse, all O(s/P)."""
    e = torch.empty(0, dtype=dtype).element_size()
    acc_e = torch.empty(0, dtype=torch.promote_types(dtype, torch.float32)).element_size()
    return b * s_local * d * (2 * h + 2 * h_kv) * e + b * h * s_local * acc_e


# ----------------------------------------------------------------------------------------------------
# Ulysses
# ----------------------------------------------------------------------------------------------------

class _AllToAll(torch.autograd.Function):
    """all_to_all_single on a tensor whose first dim indexes the destination rank. Its backward is the same
    exchange applied to the gradient (chunk j came from rank j, so its gradient goes back to rank j)."""

    @staticmethod
    def forward(ctx, x, group, kind):
        ctx.group, ctx.kind = group, kind
        return _all_to_all(x, group, kind + "_fwd")

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, ctx.kind + "_bwd"), None, None


def _all_to_all(x, group, kind):
    # the collective reads and writes raw memory: both buffers must be contiguous (empty_like would copy
    # the strides of a permuted gradient and scramble the chunks)
    x = x.contiguous()
    out = torch.empty_like(x)
    _log(kind, x, fraction=_sent_fraction(group))
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x, group, world):
    """(b, H, s/P, d) sequence shard -> (b, H/P, s, d) head shard."""
    x = rearrange(x, "b (p h) s d -> p b h s d", p=world).contiguous()
    x = _AllToAll.apply(x, group, "ulysses_a2a")
    return rearrange(x, "p b h s d -> b h (p s) d")


def _heads_to_seq(x, group, world):
    """(b, H/P, s, d) head shard -> (b, H, s/P, d) sequence shard."""
    x = rearrange(x, "b h (p s) d -> p b h s d", p=world).contiguous()
    x = _AllToAll.apply(x, group, "ulysses_a2a")
    return rearrange(x, "p b h s d -> b (p h) s d")


def ulysses_attention(q, k, v, group, causal=True, scale=None):
    """Attention over contiguous sequence shards via two all-to-alls around full-sequence attention."""
    _check_qkv(q, k, v)
    _, world = _group_info(group)
    h, h_kv = q.shape[1], k.shape[1]
    if h % world:
        raise ValueError(f"Ulysses splits heads across ranks: H={h} must be divisible by P={world}; "
                         f"use a group size that divides {h}, or ring_attention")
    if h_kv % world and world % h_kv:
        raise ValueError(f"KV heads H_kv={h_kv} must divide by P={world} or divide P (to be replicated); "
                         "choose another group size")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if world == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=h_kv != h)
    if h_kv < world:  # replicate KV heads so that every rank gets the ones its query heads use
        k, v = _repeat_kv(k, world), _repeat_kv(v, world)
    q, k, v = (_seq_to_heads(t, group, world) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return _heads_to_seq(out, group, world)


# ----------------------------------------------------------------------------------------------------
# Optional: all-gather KV (Llama 3's context parallelism)
# ----------------------------------------------------------------------------------------------------

# torch 2.13 renames the flat collectives (the old names still work, with a deprecation warning)
_all_gather_flat = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class _AllGatherSeq(torch.autograd.Function):
    """All-gather into a new leading rank dim; backward reduce-scatters the gradient (sum over its users)."""

    @staticmethod
    def forward(ctx, x, group):
        _, world = _group_info(group)
        ctx.group = group
        out = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)
        _log("allgather_kv_fwd", x, fraction=world - 1)  # a ring all-gather forwards P-1 shards
        _all_gather_flat(out, x.contiguous().view(-1), group=group)
        return out.view(world, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty(grad[0].numel(), dtype=grad.dtype, device=grad.device)
        _log("allgather_kv_bwd", grad, fraction=_sent_fraction(ctx.group))
        _reduce_scatter_flat(out, grad.contiguous().view(-1), group=ctx.group)
        return out.view(grad.shape[1:]), None


def allgather_attention(q, k, v, group, causal=True, scale=None):
    """Each rank gathers the whole K and V (O(s) memory per rank, one exposed all-gather) and attends its
    zigzag query shard to them with a position mask. Simple, and cheap when h_kv is small (GQA)."""
    _check_qkv(q, k, v)
    rank, world = _group_info(group)
    if causal and q.shape[2] % 2:
        raise ValueError(f"causal all-gather attention takes zigzag shards: local length {q.shape[2]} must be even")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s_local = q.shape[2]
    kv = torch.stack([k, v])
    if world > 1:
        kv = _AllGatherSeq.apply(kv, group)  # (P, 2, b, h_kv, s_local, d)
        kv = zigzag_unshard(list(kv.unbind(0)), dim=3) if causal else rearrange(kv, "p two b h s d -> two b h (p s) d")
    mask = None
    if causal:
        positions = zigzag_shard(torch.arange(s_local * world, device=q.device), 0, rank, world)
        mask = positions[:, None] >= torch.arange(s_local * world, device=q.device)[None, :]
    return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


# ----------------------------------------------------------------------------------------------------
# Work per rank: why zigzag
# ----------------------------------------------------------------------------------------------------

def causal_pairs_per_rank(seq, world, layout):
    """Attended (query, key) pairs of each rank under a causal mask: sum of (position + 1) over its queries."""
    positions = torch.arange(seq)
    shard = zigzag_shard if layout == "zigzag" else contiguous_shard
    return [int((shard(positions, 0, r, world) + 1).sum()) for r in range(world)]


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


def _max_err(a, b):
    return (a - b).abs().max().item()


def demo():
    rank, P = _init()
    torch.set_num_threads(max(1, torch.get_num_threads() // P))
    say = print if rank == 0 else (lambda *a, **k: None)
    group = dist.group.WORLD
    b, h, h_kv, d, s = 2, 8, 4, 16, 64 * P
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, s, d, generator=gen, dtype=torch.float64) for n in (h, h_kv, h_kv))
    dout = torch.randn(b, h, s, d, generator=gen, dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    ref.backward(dout)
    say(f"== P={P} ranks, b={b}, H={h}, H_kv={h_kv}, s={s}, d={d}, float64, causal; errors against "
        "F.scaled_dot_product_attention on the whole sequence (max over ranks)")

    rows = []
    for name, fn, shard in (("ring (zigzag)", ring_attention, zigzag_shard),
                            ("ulysses", ulysses_attention, contiguous_shard),
                            ("all-gather KV", allgather_attention, zigzag_shard)):
        local = [shard(t, 2, rank, P).clone().requires_grad_(True) for t in (q, k, v)]
        comm_log.clear()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = fn(*local, group, causal=True)
        out.backward(shard(dout, 2, rank, P))
        errs = [_max_err(out, shard(ref, 2, rank, P))] + [_max_err(l.grad, shard(r.grad, 2, rank, P))
                                                          for l, r in zip(local, leaves)]
        err = torch.tensor(max(errs))
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        saved_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}.values())
        rows.append((name, err.item(), dict(comm_log), saved_bytes))

    e = 8  # float64
    formulas = {
        "ring (zigzag)": f"fwd KV 2(P-1)/P b s h_kv d e = {2 * (P - 1) / P * b * s * h_kv * d * e:.0f}; bwd the same "
                         f"KV plus dK,dV P times: 2 b s h_kv d e_acc = {2 * b * s * h_kv * d * e:.0f}",
        "ulysses": f"fwd (P-1)/P^2 b s (2h + 2h_kv') d e = "
                   f"{(P - 1) / P ** 2 * b * s * (2 * h + 2 * max(h_kv, P if P > h_kv else h_kv)) * d * e:.0f}",
        "all-gather KV": f"fwd KV (P-1)/P b s 2 h_kv d e = {(P - 1) / P * b * s * 2 * h_kv * d * e:.0f}",
    }
    for name, err, log, saved_bytes in rows:
        say(f"\n-- {name}: max error {err:.1e}; tensors saved for backward on rank 0: {saved_bytes} bytes")
        for key in sorted(k for k in log if k.endswith(":count")):
            kind = key[:-6]
            say(f"   {kind:20s} {log[key]:3d} sends, {log[kind + ':bytes']:9d} bytes sent by this rank")
        say(f"   formula: {formulas[name]}" + (" (a ring all-gather forwards P-1 shards: the ring's KV bytes in "
                                                 "one exposed collective, the whole KV held)"
                                                 if name == "all-gather KV" else ""))
    say(f"   ring formula for the saved tensors: {ring_saved_bytes(b, h, h_kv, s // P, d, torch.float64)} bytes "
        f"(q, k, v, out and lse of the local shard: O(s/P))")

    say("\n== causal attention work per rank (attended query-key pairs), s=%d:" % s)
    for layout in ("contiguous", "zigzag"):
        pairs = causal_pairs_per_rank(s, P, layout)
        say(f"   {layout:10s} {pairs}  max/min = {max(pairs) / min(pairs):.2f}")
    work_log.clear()
    local = [zigzag_shard(t, 2, rank, P) for t in (q, k, v)]
    ring_attention(*local, group, causal=True)
    mine = torch.tensor([work_log["pairs"]], dtype=torch.float64)
    all_work = [torch.zeros(1, dtype=torch.float64) for _ in range(P)]
    dist.all_gather(all_work, mine)
    say(f"   pairs computed by ring_attention's blocks per rank (b*H*pairs): {[int(w.item()) for w in all_work]}")

    fwd_bytes = {name: sum(v for key, v in log.items() if key.endswith("fwd:bytes")) for name, _, log, _ in rows}
    saved = {name: sb for name, _, _, sb in rows}
    h_rep = max(h_kv, P)  # Ulysses replicates KV heads when H_kv < P
    table = [
        ("Megatron SP", "LN/dropout acts along s", "AG + RS in TP", "4(t-1)/t b s (h d) e", "(in TP code)",
         "inside a TP group", "non-attention acts / t"),
        ("context par.", "every activation along s", "attention only", "ring or Ulysses below", "",
         "s % 2P (zigzag)", "all acts / P"),
        ("Ring", "q, k, v along s", f"{P - 1} KV sends", f"{2 * (P - 1) / P * b * s * h_kv * d * e:.0f}",
         str(fwd_bytes["ring (zigzag)"]), "none on heads", str(saved["ring (zigzag)"])),
        ("Ulysses", "s -> heads", "4 all-to-alls", f"{(P - 1) / P ** 2 * b * s * (2 * h + 2 * h_rep) * d * e:.0f}",
         str(fwd_bytes["ulysses"]), "H % P == 0", str(saved["ulysses"])),
        ("all-gather KV", "q along s, full KV", "1 all-gather", f"{(P - 1) / P * b * s * 2 * h_kv * d * e:.0f}",
         str(fwd_bytes["all-gather KV"]), "none on heads", str(saved["all-gather KV"])),
    ]
    say("\n== what splits what (bytes per GPU per attention layer, forward; saved = bytes kept for backward)")
    head = ("technique", "splits", "collectives", "formula bytes", "measured", "constraint", "saved bytes")
    widths = [13, 25, 15, 26, 12, 18, 22]
    for row in (head,) + tuple(table):
        say("   " + " ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    dist.destroy_process_group()


if __name__ == "__main__":
    demo()
