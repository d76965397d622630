"""Long sequences: context parallelism (CP) by ring attention and Ulysses, with zigzag causal load balancing.

Why CP. A layer's activations grow as O(s): about 34 b s H bytes at 16 bits (Korthikanti et al. 2022; b sequences of
s tokens, width H = heads x head_dim; e bytes per element below), and attention's work as O(s^2): 4 b s^2 H FLOPs
forward (QK^T and PV), half that under a causal mask. At 128K tokens one layer's activations outgrow a GPU. CP cuts the
sequence into P shards, one per rank of a CP group, so every activation of every layer holds s/P tokens and each
rank does 1/P of the attention work. Only attention needs the other shards (a query meets every earlier key); two
ways to bring them follow. In what follows H_kv is the KV width (fewer heads under GQA), e_acc the accumulator's bytes.

Ring attention (Liu et al. 2023). Rank r holds q, k, v of its shard. In P steps the K/V shards travel round the ring
(r sends to r+1, receives from r-1): P-1 hops, each posted before the current block is computed, so that it flies
while the block computes. A block of q against one K/V shard gives a partial output o_i and its rows' log-sum-exp
l_i, and partial softmaxes merge exactly: l = logaddexp(l_a, l_b), o = e^(l_a - l) o_a + e^(l_b - l) o_b, in FP32
(float64 for float64). Backward replays the ring from the saved out and l, as FlashAttention-2 does: dQ stays home,
dK and dV travel with their block and come home after P hops, each hop waited for only after the next block. Every
block runs in a fused SDPA kernel that returns (out, lse) and takes them back for its gradients: no (s/P)^2 scores
are ever written (impl="reference" writes the same block in einsums, the readable definition).
    bytes sent per rank per layer (ring_comm_bytes):
        forward   (P-1) x 2 b (s/P) H_kv e = 2 (P-1)/P b s H_kv e          the K/V of every other shard
        backward  the same K/V again, plus dK, dV P times: 2 b s H_kv e_acc
    memory per rank (ring_memory_bytes), forward + backward, O(s/P) with no s^2 term:
        b (s/P) ((3 H + 6 H_kv) e + (H + 4 H_kv) e_acc)    q, out, dout, k, v, two K/V blocks of a hop;
                                                           dq, the dK/dV held and the one arriving
        + b heads (s/P) e_acc                              the lse
Causal load balancing by zigzag. With contiguous shards under a causal mask rank 0 attends one block and rank P-1
P blocks: the last rank does ~2P-1 times the first's work, and every rank waits for it. Zigzag cuts the sequence
into 2P chunks and gives rank i chunks i and 2P-1-i, one early and one late (zigzag_shard). Ring step 0 is then the
causal diagonal, and at every later step each rank computes exactly half a block: all of q against the first half
of an earlier rank's K/V, or the second half of q against all of a later rank's. The same work on every rank at
every step, and no mask built (the diagonal uses the kernels' is_causal). Positions (RoPE) and labels shard the
same way: zigzag_shard of arange(s) keeps the global position ids. The length must be a multiple of 2P.

Ulysses (Jacobs et al. 2023, DeepSpeed). Each rank holds s/P tokens of all heads; an all-to-all trades them for all
s tokens of H/P heads (sequence -> heads), ordinary attention runs per head, and a second all-to-all trades back
(heads -> sequence). The chapter words the first exchange the other way round (heads to sequence); but before
attention every rank holds what the rest of the layer leaves it, a sequence shard of every head, and attention needs
the whole sequence of a head. The heads must divide by P; n_kv KV heads of d channels, fewer than P, are replicated
to P first (H_kv' = max(n_kv, P) d). Each of the four all-to-alls (q, k, v, out) keeps 1/P of an s/P-token tensor home:
    bytes sent per rank per layer (ulysses_comm_bytes):
        forward   (P-1)/P b (s/P) (2 H + 2 H_kv') e;  backward the same (dout, dq, dk, dv)
    memory per rank: the whole s for H/P heads, also O(s/P); but every byte is exposed (no compute to hide behind),
    and P stops at the head count.
Ring or Ulysses: Ulysses sends fewer bytes once P > 1 + H/H_kv (MHA: P > 2) and runs one SDPA call, but needs P to
divide the heads and exposes its bytes; the ring has no head limit, and its transfers hide while a half block's
compute, 2 b (s/P)^2 H FLOPs, outlasts the next K/V's 2 b (s/P) H_kv e bytes.

SP vs CP. Megatron sequence parallelism (SP, in train_gpt.py's tensor-parallel code) shards along s only the
activations that TP leaves whole: the LayerNorm and dropout activations between the TP regions, inside the TP group
of t ranks. An all-gather enters each TP region and a reduce-scatter leaves it, in place of TP's all-reduce: the
same 4 (t-1)/t b s H e bytes per layer forward. Activation memory per layer at 16 bits, scores not stored:
b s H (10 + 24/t) under TP alone, 34 b s H / t with SP; but inside the TP regions every rank still attends over
the whole sequence. CP shards the whole sequence through every layer, attention included, over its own group:
34 b s H / (t P) with SP, attention work / (t P), for the ring's or Ulysses's bytes above. The two compose.

The full file's demo, `torchrun --nproc_per_node=4 long_seq.py` (or `python long_seq.py`, one rank), runs ring and
Ulysses against full attention, bytes against these formulas, zigzag's balance, then the forms beyond the chapter;
`--bench` measures peak memory and time at a long sequence.
"""
import math
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange
from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

# What each collective of this file sent from this rank: counts and bytes, by kind. Reset with .clear().
comm_log = Counter()
# Attended (query, key) pairs computed by this rank's attention blocks (ring and all-gather forward), key "pairs".
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

def _check_rank(rank, world):
    # chunk indexing would accept rank -1 (the last rank's chunks) and rank >= world (other ranks' chunks)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank={rank}, world={world}: need world >= 1 and 0 <= rank < world (this rank's index "
                         "in the group that shares the sequence)")


def zigzag_shard(x, dim, rank, world):
    """Rank `rank`'s zigzag shard of x along `dim`: chunks rank and 2*world-1-rank of 2*world."""
    _check_rank(rank, world)
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
    _check_rank(rank, world)
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
    # the kernels would reject a mix only after the first KV hop, all-to-all or all-gather: a peer may hang
    if not q.dtype == k.dtype == v.dtype or not q.device == k.device == v.device:
        raise ValueError(f"q ({q.dtype}, {q.device}), k ({k.dtype}, {k.device}) and v ({v.dtype}, {v.device}) must "
                         "share dtype and device; convert k and v with .to(q)")


# ----------------------------------------------------------------------------------------------------
# One block of attention, forward and backward, with its log-sum-exp: a fused kernel, or the readable reference
# ----------------------------------------------------------------------------------------------------
# A block is q's rows against one K/V shard's columns. Forward returns (out, lse); backward takes the FINAL out and
# lse of the rows (after every block is merged) and so returns exactly this block's share of dq, dk, dv. The
# reference writes the block in einsums; it also runs where no fused kernel fits (float64 or odd head_dim on CUDA).
# The fused kernels' plumbing (PyTorch's private aten calls) waits at the end of the chapter, after Ulysses.

def _repeat_kv(t, heads):
    """GQA: KV head j serves query heads j*g .. j*g+g-1 (g = H / H_kv)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _sum_kv_groups(t, kv_heads):
    return t if t.shape[1] == kv_heads else rearrange(t, "b (hk g) s d -> b hk g s d", hk=kv_heads).sum(2)


def _acc_dtype(dtype):
    """The merge's accumulator: FP32, or float64 for float64 inputs (the dtype of the kernels' lse too)."""
    return torch.promote_types(dtype, torch.float32)


# The reference: every score of the block materialised, (rows x cols) per head, in the accumulator dtype.

def _scores(q, k, scale, causal, acc):
    s = torch.einsum("bhqd,bhkd->bhqk", q.to(acc), _repeat_kv(k, q.shape[1]).to(acc)) * scale
    if causal:  # a diagonal block: local order is global order within it
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _reference_forward(q, k, v, scale, causal):
    acc = _acc_dtype(q.dtype)
    s = _scores(q, k, scale, causal, acc)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    return torch.einsum("bhqk,bhkd->bhqd", p, _repeat_kv(v, q.shape[1]).to(acc)), lse


def _reference_backward(dout, q, k, v, out, lse, scale, causal):
    """Gradients of one block from the FINAL out and lse of its rows (FlashAttention-2): P = exp(S - lse) is
    this block's share of the softmax, delta = rowsum(dout * out) the softmax's Jacobian term."""
    acc = lse.dtype
    dout = dout.to(acc)
    delta = (dout * out.to(acc)).sum(-1)
    p = torch.exp(_scores(q, k, scale, causal, acc) - lse[..., None])
    dv = torch.einsum("bhqk,bhqd->bhkd", p, dout)
    dp = torch.einsum("bhqd,bhkd->bhqk", dout, _repeat_kv(v, q.shape[1]).to(acc))
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("bhqk,bhkd->bhqd", ds, _repeat_kv(k, q.shape[1]).to(acc)) * scale
    dk = torch.einsum("bhqk,bhqd->bhkd", ds, q.to(acc)) * scale
    return dq, _sum_kv_groups(dk, k.shape[1]), _sum_kv_groups(dv, k.shape[1])


def _block_forward(kernel, q, k, v, scale, causal):
    """One block: (out, lse, extras). `kernel` from fused_kernel(), None for the reference."""
    b, h, rows, _ = q.shape
    cols = k.shape[2]  # attended pairs, from the shapes (no device sync)
    work_log["pairs"] += b * h * (rows * (rows + 1) // 2 if causal else rows * cols)
    if kernel is None:
        return (*_reference_forward(q, k, v, scale, causal), ())
    return _fused_forward(kernel, q, k, v, scale, causal)


def _block_backward(kernel, extras, dout, q, k, v, out, lse, scale, causal):
    if kernel is None:
        return _reference_backward(dout, q, k, v, out, lse, scale, causal)
    return _fused_backward(kernel, extras, dout, q, k, v, out, lse, scale, causal)


def _merge(out, lse, block_out, block_lse):
    """Fold a block's (out, lse) into the running ones, in place: the stable log-sum-exp merge, in the
    accumulator dtype of `out` and `lse` (FP32, float64 for float64 inputs) whatever the block's dtype."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse)[..., None]).add_(block_out * torch.exp(block_lse - new_lse)[..., None])
    lse.copy_(new_lse)


def _ring_blocks(step, rank, src, s_local, causal):
    """Which rows of q meet which columns of the KV block from rank `src`, and whether the block is diagonal.

    Zigzag causal: step 0 is the causal diagonal; a block from an earlier rank is attended by all of q but
    only in its first half (its early chunk); a block from a later rank only by q's second half (our late
    chunk), in full. Non-causal: everything. Only the diagonal is masked, and the kernels' own is_causal
    (top-left aligned, as local order is global order on the diagonal) masks it: no mask is ever built."""
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

class _RingSendRecv:
    """One hop of the ring in flight: `send` goes to the next rank while the previous rank's buffer of the same
    shape arrives. Tags keep the KV and the dK/dV hops apart when both are in flight (gloo matches by tag)."""

    def __init__(self, send, group, kind, tag=0):
        rank, world = _group_info(group)
        self.recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, dist.get_global_rank(group, (rank + 1) % world), group, tag),
               dist.P2POp(dist.irecv, self.recv, dist.get_global_rank(group, (rank - 1) % world), group, tag)]
        _log(kind, send)
        self.requests = dist.batch_isend_irecv(ops)

    def wait(self):
        """The received buffer. The requests are dropped: they hold the sent buffer, which may now be freed."""
        for r in self.requests:
            r.wait()
        self.requests = None
        return self.recv


class _RingAttention(torch.autograd.Function):
    """Shapes: q, out, dout (b, h, n, d) and k, v (b, h_kv, n, d) with n = s/P this rank's tokens; lse (b, h, n);
    rows and cols slice n (all of it, or a half under zigzag), so a block is (b, h, |rows|, d) against
    (b, h_kv, |cols|, d)."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, kernel):
        rank, world = _group_info(group)
        acc, s_local = _acc_dtype(q.dtype), q.shape[2]
        kv = torch.stack([k, v])  # (2, b, h_kv, n, d): one message per hop
        for step in range(world):
            if step < world - 1:  # send kv (2, b, h_kv, n, d) to rank + 1 now, to overlap this block's compute
                kv_hop = _RingSendRecv(kv, group, "ring_kv_fwd")
            src = (rank - step) % world  # the rank whose K/V we hold at this step
            rows, cols, diagonal = _ring_blocks(step, rank, src, s_local, causal)
            # (b, h, |rows|, d) and (b, h, |rows|): this block's output and log-sum-exp
            block_out, block_lse, ctx.extras = _block_forward(kernel, q[:, :, rows], kv[0][:, :, cols],
                                                              kv[1][:, :, cols], scale, diagonal)
            if step == 0:  # the first block covers every row: (b, h, n, d), (b, h, n) in the accumulator dtype
                out, lse = block_out.to(acc), block_lse.to(acc)
            else:
                _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            if step < world - 1:
                kv = kv_hop.wait()  # (2, b, h_kv, n, d): rank - 1's, the K/V of rank - step - 1
        out = out.to(q.dtype)  # (b, h, n, d)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.kernel = group, causal, scale, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale, kernel = ctx.group, ctx.causal, ctx.scale, ctx.kernel
        rank, world = _group_info(group)
        acc, s_local = lse.dtype, q.shape[2]
        dout = dout.contiguous().to(q.dtype)  # (b, h, n, d)
        dq = torch.zeros_like(q, dtype=acc)  # (b, h, n, d): stays home
        kv = torch.stack([k, v])  # (2, b, h_kv, n, d): the ring replayed
        for step in range(world):
            if step < world - 1:  # send kv (2, b, h_kv, n, d) to rank + 1, overlapping this block's backward
                kv_hop = _RingSendRecv(kv, group, "ring_kv_bwd")
            src = (rank - step) % world
            rows, cols, diagonal = _ring_blocks(step, rank, src, s_local, causal)
            # (b, h, |rows|, d), (b, h_kv, |cols|, d) twice: this block's share of dq, dk, dv
            dq_block, dk_block, dv_block = _block_backward(kernel, ctx.extras, dout[:, :, rows], q[:, :, rows],
                                                           kv[0][:, :, cols], kv[1][:, :, cols], out[:, :, rows],
                                                           lse[:, :, rows], scale, diagonal)
            dq[:, :, rows] += dq_block
            if step == 0:  # our own KV block, every column: its gradient (2, b, h_kv, n, d) starts here
                dkv = torch.stack([dk_block, dv_block]).to(acc)
            else:  # the gradient of the block we hold, summed by the ranks it visited before: in flight since
                dkv = dkv_hop.wait()  # (2, b, h_kv, n, d): sent last step, its transfer overlapped this compute
                dkv[0][:, :, cols] += dk_block
                dkv[1][:, :, cols] += dv_block
            del dq_block, dk_block, dv_block  # freed before the next buffer is allocated
            if world > 1:  # send dkv (2, b, h_kv, n, d) on with its block; waited for after the next block
                dkv_hop = _RingSendRecv(dkv, group, "ring_dkv_bwd", tag=1)
            if step < world - 1:
                kv = kv_hop.wait()  # (2, b, h_kv, n, d) from rank - 1
        if world > 1:  # the P-th hop brought our own block's gradient (2, b, h_kv, n, d) home, summed over every rank
            dkv = dkv_hop.wait()  # (2, b, h_kv, n, d)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def _check_impl(impl):
    if impl not in ("fused", "reference"):
        raise ValueError(f"impl={impl!r}: use 'fused' (a fused SDPA kernel per block) or 'reference' (einsum)")


def ring_attention(q, k, v, group, causal=True, scale=None, impl="fused"):
    """Attention over a sequence sharded across `group`. (batch, heads, seq_local, head_dim) tensors.

    causal=True expects the zigzag layout (zigzag_shard of the full sequence); causal=False any consistent
    sharding. Every rank's shard has the same shape: the ring passes fixed-size KV buffers (gloo aborts the
    process on a size mismatch, NCCL reads garbage). GQA/MQA: k and v may have fewer heads than q.
    impl="fused" runs each block in a fused kernel (fused_kernel(q, k); the reference where none fits the
    device and dtype), impl="reference" in einsums.
    Validation happens before any communication."""
    _check_qkv(q, k, v)
    _check_impl(impl)
    _, world = _group_info(group)
    if causal and world > 1 and q.shape[2] % 2:  # one rank: the diagonal block's mask covers any length
        raise ValueError(f"causal ring attention takes zigzag shards (two chunks per rank): the local sequence "
                         f"length {q.shape[2]} must be even, i.e. the full length a multiple of 2*P = {2 * world}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    kernel = fused_kernel(q, k) if impl == "fused" else None
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), group, causal, scale, kernel)


def ring_saved_bytes(b, h, h_kv, s_local, d, dtype):
    """Bytes ring attention keeps for backward: q, out (h heads), k, v (h_kv heads) and the lse, all O(s/P)."""
    e = torch.empty(0, dtype=dtype).element_size()
    acc_e = torch.empty(0, dtype=_acc_dtype(dtype)).element_size()
    return b * s_local * d * (2 * h + 2 * h_kv) * e + b * h * s_local * acc_e


def ring_memory_bytes(b, h, h_kv, s_local, d, dtype):
    """The O(s/P) memory of ring attention forward + backward on one rank, the unit its measured peak is
    compared with: q, out, dout (h heads) and k, v and the two KV blocks of a hop, the one in use and the one
    arriving (4 more h_kv-head tensors), at e bytes per element; at the accumulator's width (FP32 for 16-bit
    inputs) dq, the dK/dV of the block held and the dK/dV arriving with the next one, and the lse.
    No term in s_local^2: a fused kernel never writes a block's (s/P) x (s/P) scores."""
    e = torch.empty(0, dtype=dtype).element_size()
    acc_e = torch.empty(0, dtype=_acc_dtype(dtype)).element_size()
    return b * s_local * d * ((3 * h + 6 * h_kv) * e + (h + 4 * h_kv) * acc_e) + b * h * s_local * acc_e


def whole_sequence_memory_bytes(b, h, h_kv, s, d, dtype):
    """The O(s) memory of attention forward + backward on the whole sequence on one rank (the bench's SDPA
    run), the unit its measured peak is compared with: q, out, dout, dq (h heads) and k, v, dk, dv (h_kv heads)
    at e bytes per element, and the lse at the accumulator's width."""
    e = torch.empty(0, dtype=dtype).element_size()
    acc_e = torch.empty(0, dtype=_acc_dtype(dtype)).element_size()
    return b * s * d * (4 * h + 4 * h_kv) * e + b * h * s * acc_e


def ring_comm_bytes(b, s, kv_width, world, e, e_acc=None):
    """Bytes one rank sends per attention layer under ring_attention over `world` ranks, by direction: forward the
    K and V of one shard (2 b (s/P) kv_width elements) world-1 times; backward the same, plus dK and dV world times
    at e_acc bytes (the accumulator's width: FP32 for 16-bit inputs; default e). kv_width = KV heads x head_dim."""
    e_acc = e if e_acc is None else e_acc
    kv_block = 2 * b * (s / world) * kv_width  # K and V of one shard, elements
    return {"ring_fwd": (world - 1) * kv_block * e,
            "ring_bwd": (world - 1) * kv_block * e + (world * kv_block * e_acc if world > 1 else 0)}


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
    """Attention over contiguous sequence shards via two all-to-alls around full-sequence attention. Every
    rank's shard has the same shape, as for ring_attention (the all-to-alls move fixed-size pieces)."""
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


def ulysses_comm_bytes(b, s, q_width, kv_width, world, e):
    """Bytes one rank sends per attention layer under ulysses_attention over `world` ranks, by direction: each of
    the 4 all-to-alls (q, k, v, out; backward dout, dq, dk, dv) keeps 1/world of a tensor of s/world tokens and
    sends the rest. kv_width: the KV heads after replication (max(n_kv, P) heads) x head_dim."""
    a2a = (world - 1) / world * b * s / world * (2 * q_width + 2 * kv_width) * e
    return {"ulysses_fwd": a2a, "ulysses_bwd": a2a}


# ----------------------------------------------------------------------------------------------------
# The fused kernels the ring's blocks run in: PyTorch's private aten entry points, behind `fused_kernel`
# ----------------------------------------------------------------------------------------------------
# Tiles of the scores live in registers / cache, only (out, lse) and (dq, dk, dv) are written. `_block_forward` and
# `_block_backward` call these for a `kernel` that `fused_kernel` chose; everything above reads without them.

def fused_kernel(q, k):
    """The fused SDPA kernel that runs a block of q against k (and v like k), or None for the reference math.

    CPU: aten's flash kernel (float32, float64, bfloat16, float16; GQA native). CUDA, in this order: flash
    (float16/bfloat16, GQA native), then memory-efficient (also float32; no GQA, so KV heads are repeated:
    O(s/P) bytes). cuDNN attention is left out: it covers flash's dtypes, and its lse layout and arguments
    have changed between releases. float64 on CUDA has no fused kernel: the reference runs there (its memory
    is O((s/P)^2) per block; float64 is for parity tests), and so does a head_dim that is not a multiple of 8.
    The torch.backends.cuda checks apply the rules of F.scaled_dot_product_attention (architecture, head_dim,
    dtype, the user's torch.backends.cuda.enable_*_sdp toggles)."""
    if q.device.type == "cpu":
        return "cpu_flash" if q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16) else None
    if q.device.type == "cuda" and q.shape[-1] % 8 == 0:  # F.sdpa pads head_dim to a multiple of 8; we do not
        gqa = q.shape[1] != k.shape[1]
        if can_use_flash_attention(SDPAParams(q, k, k, None, 0.0, False, gqa)):
            return "cuda_flash"
        if can_use_efficient_attention(SDPAParams(q, q, q, None, 0.0, False, False)):
            return "cuda_efficient"
    return None


def _fused_forward(kernel, q, k, v, scale, causal):
    """(out in q's dtype, lse (b, h, rows) in the accumulator dtype, what the backward kernel needs)."""
    aten = torch.ops.aten
    if kernel == "cpu_flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, ()
    if kernel == "cuda_flash":
        out, lse, cum_q, cum_k, _, _, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return out, lse, (cum_q, cum_k, seed, offset)
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return out, lse[:, :, :q.shape[2]], (seed, offset)  # its lse has rows padded to a multiple of 32


def _fused_backward(kernel, extras, dout, q, k, v, out, lse, scale, causal):
    """(dq, dk, dv) of one block from the final out and lse of its rows (the kernels compute delta from out).
    `extras` come from a forward call of the same kernel (dropout is 0, so its RNG state is never read)."""
    aten = torch.ops.aten
    lse = lse.contiguous()
    if kernel == "cpu_flash":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                        scale=scale)
    if kernel == "cuda_flash":
        cum_q, cum_k, seed, offset = extras
        return aten._scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, cum_q, cum_k, q.shape[2],
                                                                k.shape[2], 0.0, causal, seed, offset, scale=scale)
    seed, offset = extras
    rows = q.shape[2]
    padded = lse.new_zeros(*lse.shape[:2], -(-rows // 32) * 32)  # the kernel's layout (strides multiple of 8)
    padded[:, :, :rows] = lse
    kx, vx = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, kx, vx, None, out, padded, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, _sum_kv_groups(dk, k.shape[1]), _sum_kv_groups(dv, k.shape[1])


# ======================================================================================================================
# BEYOND THE CHAPTER: the hybrid Ulysses x ring (USP), all-gather KV, work per rank, a CPU memory meter, demo, bench
# ======================================================================================================================
import argparse
import os
import statistics
import sys
import tempfile
import time
import weakref

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


# ----------------------------------------------------------------------------------------------------
# Hybrid: Ulysses inside, ring across (USP, Fang and Zhao 2024; Megatron-LM's a2a+p2p with hierarchical CP sizes)
# ----------------------------------------------------------------------------------------------------
# Ulysses stops at P = H_kv (and its all-to-alls cross nodes once P leaves one); the ring's blocks shrink with s/P
# until its K/V transfers no longer hide behind them. The hybrid splits CP = u x r: u consecutive CP ranks form a
# Ulysses group (inside a node when TP x u fits one), the r ranks at stride u a ring (topology.py's cp_ulysses and
# cp_ring groups). hybrid_attention runs an all-to-all over the Ulysses group that trades the rank's s/P tokens of
# all H heads for s/r tokens of H/u heads (K and V alike: u must divide H_kv), the core's ring over the ring group on
# that chunk, and the inverse all-to-all. The layout (hybrid_shard) is zigzag over the ring, each of its two chunks
# cut contiguously into u pieces, Ulysses rank i holding piece i of the early chunk and piece u-1-i of the late one:
# exactly zigzag_shard over all P = u r ranks at CP rank c = i + u j, so positions and labels shard as for the ring,
# and the u pieces an all-to-all brings in fall into the ring's order by zigzag_unshard. Causal work is balanced
# twice over: the ring ranks by zigzag, the Ulysses ranks by computing the same chunk for different heads
# (hybrid_pairs_per_rank: (H/u) x the ring shard's pairs, the same on every rank).
#
# Bytes per rank per layer (hybrid_comm_bytes): the 4 all-to-alls (K and V in one message) each keep 1/u of a tensor
# of s/P tokens, (u-1)/u b (s/(u r)) (2 H + 2 H_kv) e each way (ulysses_comm_bytes over u of the P ranks); the ring
# passes K and V of H_kv/u on s/r tokens, 2 (r-1)/(r u) b s H_kv e forward, the same and dK, dV r times at e_acc
# backward (ring_comm_bytes over r). u = 1 is the pure ring, r = 1 pure Ulysses. Memory per rank is O(s/P): after
# the all-to-all a rank holds s/r tokens of H/u heads, as many elements as s/P tokens of H heads, so the ring's part
# is ring_memory_bytes at P; the layer's own s/P tensors (q, k, v, out, dout) stay beside the all-to-alls' copies.
#
# When the hybrid wins. (1) Past the KV heads: Ulysses needs H_kv % P (or replicates KV heads: more bytes, more
# memory); the hybrid needs only H_kv % u, so a GQA model with 8 KV heads runs CP 32 as 8 x 4. (2) Past a node: with
# the Ulysses group inside it, only the ring crosses nodes, and it sends 2 (r-1)/(r u) b s H_kv e there instead of
# the pure ring's 2 (P-1)/P: about u times less; pure Ulysses at that P would run its exposed all-to-alls over the
# slow links. (3) Short chunks: a ring step computes half a causal block, 2 b l^2 H FLOPs for l local rows, while
# the next K and V, 2 b l H_kv e bytes, travel; the transfer hides when l >= (H_kv/H) e F / B (F FLOP/s, B the
# link's bytes/s). The pure ring has l = s/P, the hybrid's ring l = s/r: it hides at u times shorter sequences.
# H100 (F = 989e12 at e = 2) over InfiniBand (B = 45 GB/s per GPU) with H_kv/H = 1/8: l >= 5.5K tokens, so a ring of
# 32 needs s >= 176K, the hybrid 8 x 4 s >= 22K. Bytes alone, forward, at the same P: pure Ulysses minus the hybrid
# = (r-1)/P b s ((2 H + 2 H_kv)/P - 2 H_kv) e, so Ulysses sends fewer exactly when P > 1 + H/H_kv, but every byte of
# it is exposed, while the ring's part of the hybrid can hide. Inside one node with H_kv % P == 0, pure Ulysses is
# the simple choice; the hybrid pays off past the KV heads and past the node.

def hybrid_shard(x, dim, ulysses_rank, ulysses_size, ring_rank, ring_size):
    """The shard of x along `dim` for hybrid_attention at Ulysses rank i of u and ring rank j of r: zigzag over
    the ring (chunks j and 2r-1-j of 2r), each of the two chunks split contiguously into u pieces, piece i of the
    early chunk and piece u-1-i of the late one (mirrored, like zigzag itself). That is zigzag_shard over the
    whole CP group at CP rank c = i + u j (inner ranks consecutive, as topology.py numbers them), so positions
    and labels shard as for the ring at the same CP. Needs the length to be a multiple of 2 u r."""
    _check_rank(ulysses_rank, ulysses_size)
    _check_rank(ring_rank, ring_size)
    world = ulysses_size * ring_size
    if x.shape[dim] % (2 * world):
        raise ValueError(f"sequence length {x.shape[dim]} (dim {dim}) is not divisible by 2*u*r = 2*{ulysses_size}"
                         f"*{ring_size} = {2 * world}; pad the sequence to a multiple of {2 * world}")
    ring = x.chunk(2 * ring_size, dim=dim)
    early = ring[ring_rank].chunk(ulysses_size, dim=dim)[ulysses_rank]
    late = ring[2 * ring_size - 1 - ring_rank].chunk(ulysses_size, dim=dim)[ulysses_size - 1 - ulysses_rank]
    return torch.cat([early, late], dim=dim)


def hybrid_unshard(shards, dim, ulysses_size, ring_size):
    """Inverse of hybrid_shard: the full tensor from every rank's shard, in CP rank order c = i + u j."""
    if len(shards) != ulysses_size * ring_size:
        raise ValueError(f"{len(shards)} shards for u*r = {ulysses_size}*{ring_size} ranks: pass one per CP rank")
    ring_shards = [zigzag_unshard(shards[j * ulysses_size:(j + 1) * ulysses_size], dim) for j in range(ring_size)]
    return zigzag_unshard(ring_shards, dim)


def _gather_ring_shard(x, group, u):
    """(..., b, H, s/P, d) hybrid shard -> (..., b, H/u, s/r, d): this rank's H/u heads of its ring rank's zigzag
    shard. The all-to-all brings piece i from Ulysses rank i, [early_i, late_(u-1-i)]; zigzag_unshard puts the
    u pieces in order (early pieces ascending, then late pieces ascending)."""
    x = rearrange(x, "... (p h) s d -> p ... h s d", p=u).contiguous()
    x = _AllToAll.apply(x, group, "hybrid_a2a")
    return zigzag_unshard(list(x.unbind(0)), dim=-2)


def _scatter_ring_shard(x, group, u):
    """(b, H/u, s/r, d) -> (b, H, s/P, d): the inverse; Ulysses rank i gets back its pieces of every head."""
    x = torch.stack([zigzag_shard(x, -2, i, u) for i in range(u)])
    x = _AllToAll.apply(x, group, "hybrid_a2a")
    return rearrange(x, "p b h s d -> b (p h) s d")


def check_hybrid(kv_heads, seq_local, ulysses_size):
    """The hybrid's rules on sizes, before any communication: u divides the KV heads (then the query heads too,
    a multiple of them), and with u > 1 the local length is even (two zigzag pieces per rank)."""
    if kv_heads % ulysses_size:
        raise ValueError(f"hybrid attention splits the KV heads over the Ulysses group: H_kv={kv_heads} must be "
                         f"divisible by the Ulysses size u={ulysses_size} (cp_ulysses); choose u among "
                         f"{[n for n in range(1, kv_heads + 1) if kv_heads % n == 0]}")
    if ulysses_size > 1 and seq_local % 2:
        raise ValueError(f"hybrid attention takes hybrid_shard shards (two pieces per rank): the local sequence "
                         f"length {seq_local} must be even, i.e. the full length a multiple of 2*u*r")


def hybrid_attention(q, k, v, ulysses_group, ring_group, causal=True, scale=None, impl="fused"):
    """Attention over a sequence sharded across u x r ranks (hybrid_shard): an all-to-all over `ulysses_group`
    trades sequence pieces for heads, ring_attention over `ring_group` runs on the gathered zigzag ring shard
    (H/u heads, s/r tokens), and the inverse all-to-all restores the (b, H, s/P, d) layout. Either group None
    is a dimension of size 1: pure ring (ulysses_group None) or pure Ulysses (ring_group None). GQA/MQA: u must
    divide the KV heads. Every rank's shard has the same shape; validation happens before any communication."""
    _check_qkv(q, k, v)
    _check_impl(impl)
    _, u = _group_info(ulysses_group)
    check_hybrid(k.shape[1], q.shape[2], u)
    if u == 1:  # a group of one rank issues no communication
        return ring_attention(q, k, v, ring_group, causal=causal, scale=scale, impl=impl)
    q = _gather_ring_shard(q, ulysses_group, u)
    k, v = _gather_ring_shard(torch.stack([k, v]), ulysses_group, u).unbind(0)  # one message for K and V
    out = ring_attention(q, k, v, ring_group, causal=causal, scale=scale, impl=impl)
    return _scatter_ring_shard(out, ulysses_group, u)


def hybrid_comm_bytes(b, s, q_width, kv_width, ulysses, ring, e, e_acc=None):
    """Bytes one rank sends per attention layer under hybrid_attention, by group and direction (derived above):
    the core's Ulysses formula over the u ranks of the inner group on s/(u r) tokens, and the core's ring formula
    over the r ranks of the outer group on H_kv/u of the KV width; ulysses=1 is the pure ring, ring=1 pure Ulysses
    (KV heads divisible by P). q_width and kv_width are the query and KV widths this rank's attention holds, heads x
    head_dim (under TP: / t); e bytes per element, e_acc those of the ring's dK/dV accumulator (FP32 for 16-bit,
    default e). Keys: ulysses_fwd, ulysses_bwd (the all-to-alls, inner group), ring_fwd, ring_bwd (the KV passes)."""
    u, r = ulysses, ring
    return {**ulysses_comm_bytes(b, s / r, q_width, kv_width, u, e),  # u ranks share a ring shard of s/r tokens
            **ring_comm_bytes(b, s, kv_width / u, r, e, e_acc)}


def hybrid_memory_bytes(b, h, h_kv, s, d, dtype, ulysses, ring):
    """The O(s/P) memory of hybrid_attention forward + backward on one rank: the ring's (ring_memory_bytes) on
    its gathered shard, s/r tokens of h/u and h_kv/u heads (as many elements as s/P tokens of h and h_kv heads),
    and with u > 1 the layer's own s/P tensors beside the all-to-alls' copies: q, k, v, out, dout at e."""
    u, r = ulysses, ring
    local = b * (s // (u * r)) * d * (3 * h + 2 * h_kv) * torch.empty(0, dtype=dtype).element_size()
    return ring_memory_bytes(b, h // u, h_kv // u, s // r, d, dtype) + (local if u > 1 else 0)


# ----------------------------------------------------------------------------------------------------
# All-gather KV (Llama 3's context parallelism)
# ----------------------------------------------------------------------------------------------------
# Each rank gathers the whole K and V in one all-gather, (P-1)/P b s 2 H_kv e bytes forward (the ring's K/V bytes,
# exposed rather than overlapped) and a reduce-scatter of dK, dV backward, and holds them: O(s) K/V per rank, cheap
# when H_kv is small (GQA). Its zigzag query shard meets its prefix as an unmasked block plus a causal diagonal
# block per chunk, run by the core's block kernels and merged by the core's log-sum-exp merge.

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


class _LocalBlocks(torch.autograd.Function):
    """q attends a list of (rows, cols, causal) blocks of k and v on this rank, merged by log-sum-exp: the
    ring's block arithmetic without the ring."""

    @staticmethod
    def forward(ctx, q, k, v, blocks, scale, kernel):
        acc = _acc_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        for rows, cols, causal in blocks:
            block_out, block_lse, ctx.extras = _block_forward(kernel, q[:, :, rows], k[:, :, cols], v[:, :, cols],
                                                              scale, causal)
            _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.scale, ctx.kernel = blocks, scale, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous().to(q.dtype)
        dq, dk, dv = (torch.zeros_like(t, dtype=lse.dtype) for t in (q, k, v))
        for rows, cols, causal in ctx.blocks:
            dq_b, dk_b, dv_b = _block_backward(ctx.kernel, ctx.extras, dout[:, :, rows], q[:, :, rows],
                                               k[:, :, cols], v[:, :, cols], out[:, :, rows], lse[:, :, rows],
                                               ctx.scale, causal)
            dq[:, :, rows] += dq_b
            dk[:, :, cols] += dk_b
            dv[:, :, cols] += dv_b
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _prefix_blocks(rank, world, s_local, causal):
    """The blocks of a zigzag query shard against the whole sequence's KV in global order. Each of its two
    chunks (global chunk j, c positions) sees every earlier chunk in full and its own chunk causally:
    (chunk rows, columns [0, j c), unmasked) + (chunk rows, columns [j c, (j+1) c), is_causal). No mask."""
    if not causal:
        return [(slice(0, s_local), slice(0, s_local * world), False)]
    c = s_local // 2
    blocks = []
    for half, j in ((0, rank), (1, 2 * world - 1 - rank)):
        rows = slice(half * c, (half + 1) * c)
        if j > 0:
            blocks.append((rows, slice(0, j * c), False))
        blocks.append((rows, slice(j * c, (j + 1) * c), True))
    return blocks


def allgather_attention(q, k, v, group, causal=True, scale=None, impl="fused"):
    """Each rank gathers the whole K and V (O(s) memory per rank, one exposed all-gather) and attends its
    zigzag query shard (causal) or any shard (non-causal) to them. Simple, and cheap when h_kv is small (GQA).
    Causal: each query chunk meets its prefix as an unmasked block plus a causal diagonal block, merged by
    log-sum-exp, so the fused kernels run (a boolean (s/P) x s position mask would rule them out). Every rank's
    shard has the same shape, as for ring_attention."""
    _check_qkv(q, k, v)
    _check_impl(impl)
    rank, world = _group_info(group)
    if causal and q.shape[2] % 2:
        raise ValueError(f"causal all-gather attention takes zigzag shards: local length {q.shape[2]} must be even")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    kernel = fused_kernel(q, k) if impl == "fused" else None
    blocks = _prefix_blocks(rank, world, q.shape[2], causal)
    if world > 1:
        kv = _AllGatherSeq.apply(torch.stack([k, v]), group)  # (P, 2, b, h_kv, s_local, d)
        kv = zigzag_unshard(list(kv.unbind(0)), dim=3) if causal else rearrange(kv, "p two b h s d -> two b h (p s) d")
        k, v = kv.unbind(0)  # the whole sequence, in global order
    return _LocalBlocks.apply(q.contiguous(), k.contiguous(), v.contiguous(), blocks, scale, kernel)


# ----------------------------------------------------------------------------------------------------
# Work per rank: why zigzag
# ----------------------------------------------------------------------------------------------------

def causal_pairs_per_rank(seq, world, layout):
    """Attended (query, key) pairs of each rank under a causal mask: sum of (position + 1) over its queries."""
    positions = torch.arange(seq)
    shard = zigzag_shard if layout == "zigzag" else contiguous_shard
    return [int((shard(positions, 0, r, world) + 1).sum()) for r in range(world)]


def hybrid_pairs_per_rank(seq, heads, ulysses, ring, ring_layout="zigzag"):
    """Causal attention work of each CP rank (c = ulysses_rank + ulysses * ring_rank) under hybrid_attention:
    heads/u query heads times the attended pairs of its ring rank's shard (`ring_layout` of the ring)."""
    pairs = causal_pairs_per_rank(seq, ring, ring_layout)
    return [heads // ulysses * pairs[c // ulysses] for c in range(ulysses * ring)]


# ----------------------------------------------------------------------------------------------------
# Measuring peak memory on CPU
# ----------------------------------------------------------------------------------------------------

class PeakMemory(TorchDispatchMode):
    """The most tensor-storage bytes alive at once while active, a CPU stand-in for
    torch.cuda.max_memory_allocated: every storage an op creates counts from its creation until it is freed
    (weakref.finalize on the storage). Storages that existed before (the inputs) are not counted: add them.
    It sees every tensor an op returns, not a kernel's private scratch (the CPU flash kernels' per-thread
    tiles, whose size does not grow with s). `largest` is the biggest single storage created."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = self.largest = 0
        self._bytes = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = id(storage)  # a storage keeps one Python object for its whole life
                if key not in inputs and key not in self._bytes:
                    self._bytes[key] = storage.nbytes()
                    weakref.finalize(storage, self._free, key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    self.largest = max(self.largest, storage.nbytes())
        return out

    def _free(self, key):
        self.live -= self._bytes.pop(key)


# ----------------------------------------------------------------------------------------------------
# The demo and the benchmark
# ----------------------------------------------------------------------------------------------------

def _init(backend="gloo"):
    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group(backend)
        else:
            store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
            dist.init_process_group(backend, store=store, rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def _max_err(a, b):
    return (a - b).abs().max().item()


def _demo_heads(P):
    """Head counts for the demo: H=8, H_kv=4 where Ulysses can split them over P ranks (so P=8 shows GQA with
    replicated KV heads), else the smallest GQA pair that it can split, H=2P and H_kv=P; and why, for the header."""
    if 8 % P == 0 and (4 % P == 0 or P % 4 == 0):
        return 8, 4, ""
    return 2 * P, P, f" (H=8, H_kv=4 do not split over P={P} ranks for Ulysses; H=2P, H_kv=P instead)"


def _demo_ulysses(P, h_kv):
    """The hybrid's Ulysses size for the demo and the bench: the smallest u > 1 that divides P (leaving a ring of
    r = P/u > 1) and the KV heads; else pure Ulysses (u = P) where it divides them, else pure ring (u = 1)."""
    for u in range(2, P):
        if P % u == 0 and h_kv % u == 0:
            return u
    return P if h_kv % P == 0 else 1


def _hybrid_groups(rank, P, u):
    """This rank's (Ulysses group, ring group, Ulysses rank, ring rank) for CP = u x (P/u) over the world, CP rank
    = Ulysses rank + u x ring rank (topology.py's cp_ulysses and cp_ring, built here so the file stays copyable).
    new_group is collective: every rank creates every group, in the same order."""
    r = P // u
    inner = [dist.new_group(list(range(j * u, (j + 1) * u))) if u > 1 else None for j in range(r)]
    outer = [dist.new_group(list(range(i, P, u))) if r > 1 else None for i in range(u)]
    i, j = rank % u, rank // u
    return inner[j], outer[i], i, j


def _run_variant(fn, shard, q, k, v, dout, leaves):
    """One forward + backward of `fn` on this rank's shards: the max error against the whole-sequence reference
    `leaves` (out and grads) over ranks, what it sent (comm_log), the bytes it saved for backward and the attended
    pairs its forward computed (work_log)."""
    local = [shard(t).clone().requires_grad_(True) for t in (q, k, v)]
    comm_log.clear()
    work_log.clear()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn(*local)
    work = work_log["pairs"]
    out.backward(shard(dout))
    ref = leaves[-1]
    errs = [_max_err(out, shard(ref))] + [_max_err(l.grad, shard(r.grad)) for l, r in zip(local, leaves)]
    err = torch.tensor(max(errs))
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    saved_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}.values())
    return {"err": err.item(), "log": dict(comm_log), "saved": saved_bytes, "work": work}


def show_equivalence(rows, say):
    """Claim: every variant computes attention on the whole sequence, outputs and gradients, to rounding."""
    say("\n== errors against F.scaled_dot_product_attention on the whole sequence (out, dq, dk, dv; max over ranks)")
    for name, row in rows.items():
        say(f"   {name:22s} {row['err']:.1e}")


def _sent(row, direction):
    """Bytes a variant's collectives sent from this rank in one direction ('fwd' or 'bwd'), all kinds together."""
    return sum(v for key, v in row["log"].items() if key.endswith(direction + ":bytes"))


def show_bytes(rows, formulas, say):
    """Claim: what each variant sends per rank, forward and backward, equals its formula."""
    say("\n== bytes sent by rank 0, per collective kind, and each direction beside its formula")
    for name, row in rows.items():
        fwd, bwd, text = formulas[name]
        say(f"-- {name}: {text}")
        for key in sorted(k for k in row["log"] if k.endswith(":count")):
            kind = key[:-6]
            say(f"   {kind:20s} {row['log'][key]:3d} sends, {row['log'][kind + ':bytes']:9d} bytes")
        for direction, formula in (("fwd", fwd), ("bwd", bwd)):
            measured = _sent(row, direction)
            say(f"   {direction}: measured {measured:9d}, formula {formula:9.0f}  "
                f"{'equal' if measured == formula else 'DIFFERENT'}")


def show_saved_memory(rows, b, h, h_kv, s_local, d, say):
    """Claim: ring attention keeps only its O(s/P) shard for backward (q, k, v, out, lse)."""
    say(f"\n== tensors saved for backward on rank 0; ring formula (ring_saved_bytes) "
        f"{ring_saved_bytes(b, h, h_kv, s_local, d, torch.float64)} bytes")
    for name, row in rows.items():
        say(f"   {name:22s} {row['saved']:9d} bytes")


def _work_per_rank(row, P):
    """The attended pairs each rank's blocks computed (work_log), gathered from every rank."""
    mine = torch.tensor([row["work"]], dtype=torch.float64)
    every = [torch.zeros(1, dtype=torch.float64) for _ in range(P)]
    dist.all_gather(every, mine)
    return [int(w.item()) for w in every]


def show_balance(rows, s, P, say):
    """Claim: under a causal mask zigzag gives every rank the same work, contiguous shards do not; the ring's
    blocks compute exactly those pairs."""
    say(f"\n== causal attention work per rank (attended query-key pairs), s={s}:")
    for layout in ("contiguous", "zigzag"):
        pairs = causal_pairs_per_rank(s, P, layout)
        say(f"   {layout:10s} {pairs}  max/min = {max(pairs) / min(pairs):.2f}")
    say(f"   ring (zigzag) blocks, b x heads x pairs per rank: {_work_per_rank(rows['ring (zigzag)'], P)}")


def show_hybrid_balance(rows, s, P, b, h, u, say):
    """Claim: the hybrid's blocks do the same work on every rank, as hybrid_pairs_per_rank predicts."""
    name = f"hybrid {u} x {P // u}"
    say(f"\n== causal attention work per rank under the hybrid, s={s}:")
    say(f"   {name} blocks, b x heads x pairs per rank: {_work_per_rank(rows[name], P)}")
    say(f"   hybrid_pairs_per_rank x b (heads/u x the ring shard's pairs): "
        f"{[b * w for w in hybrid_pairs_per_rank(s, h, u, P // u)]}; with a contiguous ring: "
        f"{[b * w for w in hybrid_pairs_per_rank(s, h, u, P // u, ring_layout='contiguous')]}")


def show_table(rows, b, s, P, h, h_kv, d, u, say):
    """What splits what: the techniques side by side, forward bytes per rank (formula, measured), saved bytes."""
    e = 8  # float64
    fwd = {name: _sent(row, "fwd") for name, row in rows.items()}
    h_rep = max(h_kv, P)  # Ulysses replicates KV heads when H_kv < P
    hyb = hybrid_comm_bytes(b, s, h * d, h_kv * d, u, P // u, e)
    table = [
        ("Megatron SP", "LN/dropout acts along s", "AG + RS in TP", "4(t-1)/t b s (h d) e", "(in TP code)",
         "inside a TP group", "non-attention acts / t"),
        ("context par.", "every activation along s", "attention only", "ring or Ulysses below", "",
         "s % 2P (zigzag)", "all acts / P"),
        ("Ring", "q, k, v along s", f"{P - 1} KV sends", f"{2 * (P - 1) / P * b * s * h_kv * d * e:.0f}",
         fwd["ring (zigzag)"], "none on heads", rows["ring (zigzag)"]["saved"]),
        ("Ulysses", "s -> heads", "4 all-to-alls", f"{(P - 1) / P ** 2 * b * s * (2 * h + 2 * h_rep) * d * e:.0f}",
         fwd["ulysses"], "H % P == 0", rows["ulysses"]["saved"]),
        (f"hybrid {u}x{P // u}", "s -> heads in u, ring r", "a2a + ring", f"{hyb['ulysses_fwd'] + hyb['ring_fwd']:.0f}",
         fwd[f"hybrid {u} x {P // u}"], "H_kv % u == 0", rows[f"hybrid {u} x {P // u}"]["saved"]),
        ("all-gather KV", "q along s, full KV", "1 all-gather", f"{(P - 1) / P * b * s * 2 * h_kv * d * e:.0f}",
         fwd["all-gather KV"], "none on heads", rows["all-gather KV"]["saved"]),
    ]
    say("\n== what splits what (bytes per GPU per attention layer, forward; saved = bytes kept for backward)")
    head = ("technique", "splits", "collectives", "formula bytes", "measured", "constraint", "saved bytes")
    widths = [13, 25, 15, 26, 12, 18, 22]
    for row in (head,) + tuple(table):
        say("   " + " ".join(str(c).ljust(w) for c, w in zip(row, widths)))


def demo():
    """The chapter's claims first (ring and Ulysses equal full attention, their bytes equal the formulas, zigzag
    balances the causal work), then the forms beyond it (the einsum reference, the hybrid, all-gather KV)."""
    rank, P = _init()
    torch.set_num_threads(max(1, torch.get_num_threads() // P))
    say = print if rank == 0 else (lambda *a, **k: None)
    world = dist.group.WORLD
    h, h_kv, why = _demo_heads(P)
    u = _demo_ulysses(P, h_kv)
    ulysses_group, ring_group, i, j = _hybrid_groups(rank, P, u)
    b, d, s = 2, 16, 64 * P
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, s, d, generator=gen, dtype=torch.float64) for n in (h, h_kv, h_kv))
    dout = torch.randn(b, h, s, d, generator=gen, dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    ref.backward(dout)
    say(f"== P={P} ranks, b={b}, H={h}, H_kv={h_kv}{why}, s={s}, d={d}, float64, causal; blocks run in the fused "
        f"kernel {fused_kernel(q, k)!r}")

    def zigzag(t):
        return zigzag_shard(t, 2, rank, P)

    def run(variants):
        return {name: _run_variant(fn, shard, q, k, v, dout, leaves + [ref]) for name, (fn, shard) in variants.items()}

    e = 8  # float64, and so its accumulator
    ring = ring_comm_bytes(b, s, h_kv * d, P, e)
    uly = ulysses_comm_bytes(b, s, h * d, max(h_kv, P) * d, P, e)
    formulas = {
        "ring (zigzag)": (ring["ring_fwd"], ring["ring_bwd"], "ring_comm_bytes: fwd K,V P-1 times, 2 (P-1)/P b s "
                          "H_kv e; bwd the same plus dK,dV P times, 2 b s H_kv e_acc"),
        "ulysses": (uly["ulysses_fwd"], uly["ulysses_bwd"], "ulysses_comm_bytes: (P-1)/P b (s/P) (2 H + 2 H_kv') e "
                    "each way, H_kv' = max(H_kv, P) (KV heads replicated to P)"),
    }
    say("\n######## The chapter: ring attention (zigzag) and Ulysses")
    rows = run({"ring (zigzag)": (lambda q, k, v: ring_attention(q, k, v, world), zigzag),
                "ulysses": (lambda q, k, v: ulysses_attention(q, k, v, world),
                            lambda t: contiguous_shard(t, 2, rank, P))})
    show_equivalence(rows, say)
    show_bytes(rows, formulas, say)
    show_balance(rows, s, P, say)
    show_saved_memory(rows, b, h, h_kv, s // P, d, say)

    hybrid = f"hybrid {u} x {P // u}"
    hyb = hybrid_comm_bytes(b, s, h * d, h_kv * d, u, P // u, e)
    gathered = (P - 1) / P * b * s * 2 * h_kv * d * e  # a ring all-gather forwards P-1 shards; so does its RS back
    formulas.update({
        "ring reference": (ring["ring_fwd"], ring["ring_bwd"], "the same collectives as the fused ring"),
        hybrid: (hyb["ulysses_fwd"] + hyb["ring_fwd"], hyb["ulysses_bwd"] + hyb["ring_bwd"],
                 "hybrid_comm_bytes: all-to-alls (u-1)/u b s/P (2 H + 2 H_kv) e each way, ring 2 (r-1)/(r u) b s "
                 "H_kv e forward, backward with dK,dV r times"),
        "all-gather KV": (gathered, gathered, "(P-1)/P b s 2 H_kv e each way: the ring's K/V bytes in one exposed "
                          "all-gather, the whole K/V held"),
    })
    say(f"\n######## Beyond the chapter: the einsum reference, the hybrid Ulysses {u} x ring {P // u}, all-gather KV")
    beyond = run({
        "ring reference": (lambda q, k, v: ring_attention(q, k, v, world, impl="reference"), zigzag),
        hybrid: (lambda q, k, v: hybrid_attention(q, k, v, ulysses_group, ring_group),
                 lambda t: hybrid_shard(t, 2, i, u, j, P // u)),
        "all-gather KV": (lambda q, k, v: allgather_attention(q, k, v, world), zigzag),
    })
    show_equivalence(beyond, say)
    show_bytes(beyond, formulas, say)
    show_hybrid_balance(beyond, s, P, b, h, u, say)
    show_saved_memory(beyond, b, h, h_kv, s // P, d, say)
    show_table({**rows, **beyond}, b, s, P, h, h_kv, d, u, say)
    say("\n(peak memory and time at a long sequence, fused against reference, and the hybrid's bytes and memory "
        "beside ring and Ulysses: python long_seq.py --bench, or under torchrun)")
    dist.barrier()  # gloo aborts a rank that tears down while a peer still talks to it
    dist.destroy_process_group()


def _fwd_bwd(fn, inputs, dout, device):
    for t in inputs:
        t.grad = None
    fn(*inputs).backward(dout)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_bytes(fn, inputs, dout, device):
    """Peak bytes of one forward + backward, counting its inputs (q, k, v, dout) and all it allocates."""
    held = sum(t.untyped_storage().nbytes() for t in list(inputs) + [dout])
    for t in inputs:  # gradients of an earlier run would count in the baseline
        t.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        _fwd_bwd(fn, inputs, dout, device)
        return torch.cuda.max_memory_allocated(device) - base + held, None
    with PeakMemory() as mem:
        _fwd_bwd(fn, inputs, dout, device)
    return mem.peak + held, mem.largest


def check_bench_args(seq, batch, heads, kv_heads, head_dim, repeats, world, cp_ulysses=None):
    """The bench's sizes, before any process group: every rank fails alike, none waits for the others."""
    for flag, value in (("--seq", seq), ("--batch", batch), ("--heads", heads), ("--kv-heads", kv_heads),
                        ("--head-dim", head_dim), ("--repeats", repeats),
                        ("--cp-ulysses", 1 if cp_ulysses is None else cp_ulysses)):
        if value < 1:
            raise ValueError(f"{flag} {value} must be a positive integer")
    if seq % (2 * world):
        raise ValueError(f"--seq {seq} must be a multiple of 2 x the {world} ranks (zigzag shards)")
    if heads % kv_heads:
        raise ValueError(f"--heads {heads} must be a multiple of --kv-heads {kv_heads} (GQA)")
    if cp_ulysses is not None and (world % cp_ulysses or kv_heads % cp_ulysses):
        raise ValueError(f"--cp-ulysses {cp_ulysses} must divide the {world} ranks and --kv-heads {kv_heads}")


def _bench_runs(b, h, h_kv, s, d, dtype, P, u, local, full, dout_local, dout_full, reference, rank, say):
    """name -> (function of q, k, v, its inputs, its dout, memory formula, bytes formula) for the bench."""
    r = P // u
    ulysses_group, ring_group, _, _ = _hybrid_groups(rank, P, u)  # collective: every rank, before any run
    e = torch.empty(0, dtype=dtype).element_size()
    e_acc = torch.empty(0, dtype=_acc_dtype(dtype)).element_size()

    def sent(u_, r_):  # hybrid_comm_bytes forward + backward: u_ = 1 the ring, r_ = 1 Ulysses
        return sum(hybrid_comm_bytes(b, s, h * d, h_kv * d, u_, r_, e, e_acc).values())

    world = dist.group.WORLD
    ring_mem = ring_memory_bytes(b, h, h_kv, s // P, d, dtype)
    runs = {"ring fused": (lambda q, k, v: ring_attention(q, k, v, world), local, dout_local, ring_mem, sent(1, P))}
    if reference:
        runs["ring reference"] = (lambda q, k, v: ring_attention(q, k, v, world, impl="reference"), local, dout_local,
                                  ring_mem, sent(1, P))
    if h_kv % P == 0:  # no KV replication: the formula's case
        runs["ulysses"] = (lambda q, k, v: ulysses_attention(q, k, v, world), local, dout_local,
                           hybrid_memory_bytes(b, h, h_kv, s, d, dtype, P, 1), sent(P, 1))
    else:
        say(f"   (ulysses skipped: --kv-heads {h_kv} is not a multiple of the {P} ranks)")
    runs[f"hybrid {u} x {r}"] = (lambda q, k, v: hybrid_attention(q, k, v, ulysses_group, ring_group), local,
                                 dout_local, hybrid_memory_bytes(b, h, h_kv, s, d, dtype, u, r), sent(u, r))
    runs["SDPA, whole seq, 1 rank"] = (lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=h_kv != h), full, dout_full,
        whole_sequence_memory_bytes(b, h, h_kv, s, d, dtype), 0)
    return runs


def bench(seq, batch, heads, kv_heads, head_dim, dtype, repeats, reference, cp_ulysses=None):
    """Forward + backward at a long sequence, causal: peak memory, bytes sent and time of ring attention (fused
    and reference), Ulysses, the hybrid (Ulysses cp_ulysses x ring) and single-rank SDPA on the whole sequence,
    each beside its formulas (ring_memory_bytes, hybrid_memory_bytes, hybrid_comm_bytes: all O(s/P))."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    check_bench_args(seq, batch, heads, kv_heads, head_dim, repeats, world, cp_ulysses)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:  # before the process group: NCCL binds each rank's communicators to its current device
        torch.cuda.set_device(device)
    rank, P = _init("nccl" if cuda else "gloo")
    if not cuda:
        torch.set_num_threads(max(1, torch.get_num_threads() // P))
    say = print if rank == 0 else (lambda *a, **k: None)
    b, h, h_kv, d, s = batch, heads, kv_heads, head_dim, seq
    u = _demo_ulysses(P, h_kv) if cp_ulysses is None else cp_ulysses
    s_local = s // P
    gen = torch.Generator(device).manual_seed(rank)

    def leaves(n, length):
        return torch.randn(b, n, length, d, generator=gen, device=device, dtype=dtype).requires_grad_(True)

    local, full = [leaves(n, s_local) for n in (h, h_kv, h_kv)], [leaves(n, s) for n in (h, h_kv, h_kv)]
    dout_local, dout_full = leaves(h, s_local).detach(), leaves(h, s).detach()
    kernel = fused_kernel(local[0], local[1])
    say(f"== attention forward + backward, causal: P={P} ranks, b={b}, H={h}, H_kv={h_kv}, s={s} (s/P={s_local}), "
        f"d={d}, {str(dtype)[6:]}, {device.type}; fused kernel: {kernel or 'none (reference math)'}")
    runs = _bench_runs(b, h, h_kv, s, d, dtype, P, u, local, full, dout_local, dout_full, reference, rank, say)
    peaks, sent = {}, {}
    for name, (fn, inputs, dout, _, _) in runs.items():
        comm_log.clear()
        peak, largest = _peak_bytes(fn, inputs, dout, device)
        sent[name] = sum(v for key, v in comm_log.items() if key.endswith(":bytes"))
        found = torch.tensor([peak, largest or 0], dtype=torch.float64, device=device)  # NCCL: GPU tensors only
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        peaks[name] = found.tolist()
    times = {name: [] for name in runs}
    for _ in range(repeats):  # alternating, so that a slow spell of a shared machine hits every variant
        for name, (fn, inputs, dout, _, _) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            _fwd_bwd(fn, inputs, dout, device)
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step waits for the slowest rank
            times[name].append(elapsed.item())

    acc_e = torch.empty(0, dtype=_acc_dtype(dtype)).element_size()
    block = b * h * s_local ** 2 * acc_e
    say(f"   memory formulas per rank: ring_memory_bytes (q, out, dout, dq; k, v, dk, dv, two KV blocks; lse) "
        f"{runs['ring fused'][3] / 2**20:.1f} MiB; hybrid_memory_bytes (the ring's on s/r tokens of H/u heads + "
        f"the layer's own q, k, v, out, dout) {runs[f'hybrid {u} x {P // u}'][3] / 2**20:.1f} MiB")
    say(f"   for scale: one block's scores, b H (s/P)^2 at {acc_e} bytes, = {block / 2**20:.1f} MiB "
        f"(the reference holds several); the whole-sequence O(s) formula = "
        f"{runs['SDPA, whole seq, 1 rank'][3] / 2**20:.1f} MiB")
    say(f"   {'':24s} {'peak MiB/rank':>13s} {'x formula':>9s} {'largest MiB':>11s} {'bytes sent':>11s} "
        f"{'formula':>11s} {'median s':>9s}  all runs (fwd+bwd)")
    for name, (_, _, _, mem_formula, bytes_formula) in runs.items():
        peak, largest = peaks[name]
        biggest = f"{largest / 2**20:11.1f}" if not cuda else f"{'-':>11s}"
        say(f"   {name:24s} {peak / 2**20:13.1f} {peak / mem_formula:9.2f} {biggest} {sent[name]:11d} "
            f"{bytes_formula:11.0f} {statistics.median(times[name]):9.3f}  "
            + " ".join(f"{t:.3f}" for t in times[name]))
    say("   (x formula: ring_memory_bytes for the ring, hybrid_memory_bytes for the hybrid and for Ulysses (u = P, "
        "r = 1), the whole-sequence formula for SDPA; bytes: rank 0's, forward + backward, beside "
        "hybrid_comm_bytes (u = 1 the ring, r = 1 Ulysses); "
        + ("CUDA peak from torch.cuda.max_memory_allocated)" if cuda else
           "CPU peak from PeakMemory, the live storages of every op's outputs, plus the inputs)"))
    dist.barrier()  # no rank tears its sockets down while a peer may still be using them
    dist.destroy_process_group()


BENCH_DEFAULTS = {"seq": 8192, "batch": 1, "heads": 4, "head_dim": 64, "dtype": "float32", "repeats": 3}


def _main():
    parser = argparse.ArgumentParser(description="Ring / Ulysses / all-gather attention: demo (fixed small sizes, "
                                     "every variant checked against SDPA), or --bench with the sizes below")
    parser.add_argument("--bench", action="store_true", help="peak memory and time at a long sequence")
    parser.add_argument("--seq", type=int, help=f"full sequence length (default {BENCH_DEFAULTS['seq']})")
    parser.add_argument("--batch", type=int, help=f"default {BENCH_DEFAULTS['batch']}")
    parser.add_argument("--heads", type=int, help=f"default {BENCH_DEFAULTS['heads']}")
    parser.add_argument("--kv-heads", type=int, help="default: --heads")
    parser.add_argument("--head-dim", type=int, help=f"default {BENCH_DEFAULTS['head_dim']}")
    parser.add_argument("--dtype", choices=["float32", "float64", "bfloat16", "float16"],
                        help=f"default {BENCH_DEFAULTS['dtype']}")
    parser.add_argument("--repeats", type=int, help=f"default {BENCH_DEFAULTS['repeats']}")
    parser.add_argument("--no-reference", action="store_true", help="skip the einsum reference (O((s/P)^2))")
    parser.add_argument("--cp-ulysses", type=int, help="the hybrid's Ulysses size u (default: the smallest u > 1 "
                        "dividing the ranks, leaving a ring, and the KV heads)")
    args = parser.parse_args()
    sizes = ("seq", "batch", "heads", "kv_heads", "head_dim", "dtype", "repeats", "no_reference", "cp_ulysses")
    given = [name for name in sizes if getattr(args, name) is not None and getattr(args, name) is not False]
    if not args.bench:
        if given:  # the demo's sizes are fixed: a flag it would ignore is a mistake, said before any group
            if int(os.environ.get("RANK", 0)) == 0:
                flags = ", ".join("--" + name.replace("_", "-") for name in given)
                print(f"long_seq.py: error: {flags} apply only with --bench (the demo's sizes are fixed)",
                      file=sys.stderr)
            sys.exit(2)
        return demo()
    for name, value in BENCH_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    try:
        check_bench_args(args.seq, args.batch, args.heads, kv_heads, args.head_dim, args.repeats,
                         int(os.environ.get("WORLD_SIZE", 1)), args.cp_ulysses)
    except ValueError as e:  # bad input: one line on rank 0 and exit code 2, not a traceback per rank
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"long_seq.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    bench(args.seq, args.batch, args.heads, kv_heads, args.head_dim, getattr(torch, args.dtype), args.repeats,
          not args.no_reference, args.cp_ulysses)


if __name__ == "__main__":
    _main()
