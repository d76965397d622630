"""Activation recomputation (checkpointing): memory traded for FLOPs, each measured beside its formula.

What a layer keeps for backward. Backward needs tensors of the forward: every matmul's input, the softmax output,
every dropout mask. Autograd saves them, and between the end of the forward and the start of the backward all of
them are alive at once, for every layer. Korthikanti et al. (2022) count one pre-LN layer (s tokens, b sequences,
h hidden, a heads) in 16-bit, 2 bytes an element and 1 byte a dropout-mask element:

    LayerNorms   LN1 input 2 sbh, LN2 input 2 sbh                                          4 sbh
    attention    QKV input (LN1 output) 2 sbh, Q and K 4 sbh, V 2 sbh,
                 projection input 2 sbh, projection dropout mask 1 sbh                     11 sbh
                 softmax output 2 as^2b, its dropout mask 1 as^2b, dropout output 2 as^2b    5 as^2b
    MLP          fc1 input (LN2 output) 2 sbh, GELU input 8 sbh, fc2 input 8 sbh,
                 MLP dropout mask 1 sbh                                                    19 sbh
    a layer      s b h (34 + 5 a s / h) bytes; L layers keep L times that

`kept_bytes_per_layer` writes them with e bytes an element, m a mask element: s b h (16 e + 2 m) + a s^2 b (2 e +
m), plus the two LayerNorms' mean and 1/std, 4 s b e_ln bytes, which the paper leaves out. On CUDA m = 1, e_ln = 4
(FP32 statistics); on CPU m = e_ln = e (the input's dtype). `Block` is that layer, every saved tensor in sight.

FLOPs (matmul FLOPs, 2 a multiply-add): a layer's forward is 24 b s h^2 (QKV 6, projection 2, fc1 and fc2 16) +
4 b s^2 h (QK^T 2, xV 2); its backward is twice that, so a step costs 3 forwards: 72 b s h^2 a layer, i.e. 6 N
FLOPs a token for N = 12 h^2 weights a layer. The policies (`POLICY_TABLE`) keep and add:

    none       keeps all of the above. FLOPs: 72 b s h^2 + 12 b s^2 h a layer, 6 N a token and the core's.
    full       keeps each layer's input only, s b h e a layer; backward first recomputes the layer's forward.
               FLOPs: one forward more, 2 N a token: 72 -> 96 b s h^2 a layer, +33%.
    sqrt       Chen et al. (2016): checkpoints segments of seg = round(sqrt(L)) layers and keeps each segment's
               input, ceil(L / seg) s b h e. Backward recomputes one segment at a time: the FLOPs of full.
    selective  Korthikanti et al.: recomputes only the attention core (QK^T, mask, softmax, dropout, xV), whose
               memory grows with s^2 and whose FLOPs are small. Kept: s b h (16 e + 2 m) + 4 s b e_ln, 34 s b h in
               16-bit: the 5 a s^2 b terms go (the core keeps its input, the QKV output, 3 s b h e, in place of
               its Q, K and V copies). FLOPs: 2 b s^2 h a layer (QK^T redone; the paper counts xV too, 4 b s^2 h).

The peak decides memory, not the kept bytes: backward recomputes one unit at a time and holds all its activations
at once on top of what is kept. With A one layer's `none` bytes and X = s b h e a block input, peak = kept + W + T
(`peak_bytes`): W, recomputed and alive at once, none 0, full A - X, sqrt seg A - X, selective the core's q, k, v
copies and s^2 tensors; T, a kernel transient at the largest of a block's moments (`peak_bytes_terms`). So full
peaks (L - 1)(A - X) below none. The chapter says full recomputation takes activation memory from O(L) to
O(sqrt L): that is Chen et al.'s sqrt, not `full` as Megatron-LM runs it (a segment a layer), which keeps L inputs,
O(L) but A/X >= 17 times below none. sqrt's O(sqrt L) is its kept bytes; its peak adds a whole segment:
peak(sqrt) - peak(full) = (seg - 1) A - (L - ceil(L/seg)) X (seg dividing L), negative only once L > (A/X)^2:
below 289 layers sqrt peaks higher. Its kept bytes pay where they add up: a pipeline holds several micro-batches'.

`run_blocks` runs blocks under a policy with non-reentrant `torch.utils.checkpoint`, which stops recomputing once
the tensors the backward needs are rebuilt (selective never redoes xV) and restores the RNG state first: the same
dropout masks, gradients bit-identical to no recomputation. `measure_kept_bytes` logs every storage the forward's
ops create (a CPU stand-in for the CUDA allocator's statistics) and counts those alive when it returns,
`measure_peak_bytes` follows them through the backward, `measure_flops` counts with `FlopCounterMode` (which sees
the recomputation): all three equal the formulas to the byte and the FLOP.

Beyond the chapter, the full file: op-level selective checkpointing, activation offloading to host memory (bus time
instead of FLOPs), where sqrt's peak falls below full's, the demo (`python3 checkpointing.py [--json] [--long]`).
"""
import gc
import math
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode


# ---- the block: pre-LN attention + MLP with dropout, written out so every saved tensor is visible ----------

class Block(nn.Module):
    def __init__(self, hidden, heads, seq_len, dropout=0.1):
        super().__init__()
        for name, value in (("hidden", hidden), ("heads", heads), ("seq_len", seq_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if hidden % heads:
            raise ValueError(f"hidden={hidden} must be divisible by heads={heads}")
        self.heads, self.dropout, self.seq_len = heads, dropout, seq_len
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        self.register_buffer("future", torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1), persistent=False)
        self.recompute_attention_core = False  # set by the `selective` policy

    def attention_core(self, q, k, v):
        """softmax(QK^T / sqrt(d) + causal mask), dropout, times V: the O(s^2) part."""
        s = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
        att = att.masked_fill(self.future[:s, :s], float("-inf"))
        att = F.dropout(F.softmax(att, dim=-1), self.dropout, self.training)
        return att @ v

    def forward(self, x):
        if x.shape[1] > self.seq_len:  # the causal mask is built once, seq_len x seq_len
            raise ValueError(f"sequence length {x.shape[1]} exceeds the block's seq_len={self.seq_len}; "
                             f"build the block with seq_len >= {x.shape[1]}")
        q, k, v = rearrange(self.qkv(self.ln1(x)), "b s (three a d) -> three b a s d", three=3, a=self.heads)
        core = run_attention_core(self, self.attention_core, q, k, v)
        x = x + F.dropout(self.proj(rearrange(core, "b a s d -> b s (a d)")), self.dropout, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.dropout, self.training)


def make_blocks(layers, hidden, heads, seq_len, dropout=0.1, seed=0):
    torch.manual_seed(seed)
    return nn.ModuleList(Block(hidden, heads, seq_len, dropout) for _ in range(layers))


# ---- what one layer keeps under each policy, term by term (the docstring's table) ---------------------------

def layer_keeps_everything(b, s, h, a, e, mask, e_ln):
    """Policy none: every tensor the block's autograd graph saves (e bytes an element, `mask` bytes a dropout
    mask element, `e_ln` bytes a LayerNorm statistic)."""
    sbh, as2b = s * b * h, a * s * s * b
    return {"LN1 input": sbh * e, "QKV input (LN1 output)": sbh * e, "Q and K (matmul copies)": 2 * sbh * e,
            "V (matmul copy)": sbh * e, "projection input": sbh * e, "projection dropout mask": sbh * mask,
            "softmax output": as2b * e, "attention dropout mask": as2b * mask,
            "attention dropout output (input of xV)": as2b * e,
            "LN2 input": sbh * e, "fc1 input (LN2 output)": sbh * e, "GELU input": 4 * sbh * e,
            "fc2 input": 4 * sbh * e, "MLP dropout mask": sbh * mask,
            "LayerNorm mean and 1/std (2 LNs)": 4 * s * b * e_ln}


def layer_keeps_all_but_the_attention_core(b, s, h, a, e, mask, e_ln):
    """Policy selective: the s^2 terms go, and so do the core's Q, K and V copies (its matmuls' saved inputs);
    the checkpointed core keeps its own inputs q, k, v instead: views of the QKV output, one 3 sbh storage."""
    terms = layer_keeps_everything(b, s, h, a, e, mask, e_ln)
    for name in ("Q and K (matmul copies)", "V (matmul copy)", "softmax output", "attention dropout mask",
                 "attention dropout output (input of xV)"):
        del terms[name]
    terms["QKV output (the core's checkpointed inputs)"] = 3 * s * b * h * e
    return terms


def layer_keeps_its_input(b, s, h, a, e, mask, e_ln):
    """Policy full: the checkpoint keeps the block's input, nothing else."""
    return {"block input": s * b * h * e}


def sqrt_segment_size(layers):
    return max(1, round(math.sqrt(layers)))


def one_layer(layers):
    return 1


# ---- the policies, for any nn.ModuleList of blocks -------------------------------------------------------

@dataclass(frozen=True)
class Policy:
    """A row of `POLICY_TABLE`: how `run_blocks` runs it, what it keeps (`kept_bytes`), what backward redoes
    (`training_flops`) and what it holds at its peak (`peak_bytes_terms`)."""
    segment: Optional[Callable] = None  # L -> layers per checkpointed segment; None: no block is checkpointed
    recompute_attention_core: bool = False  # checkpoint the attention core inside every block (`run_attention_core`)
    kept: Optional[Callable] = None  # (b, s, h, a, e, mask, e_ln) -> {term: bytes} a layer keeps; None: per segment
    recomputed_flops: Callable = lambda gemms, core: 0  # a layer's forward GEMM, core FLOPs -> FLOPs backward redoes

    def run(self, blocks, x):
        """Forward through `blocks`; `x` is the hidden state, or a tuple of tensors every block takes and returns."""
        for block in blocks:
            block.recompute_attention_core = self.recompute_attention_core
        if self.segment is None:
            return _run_segment(blocks, *_as_args(x))
        size = self.segment(len(blocks))
        for start in range(0, len(blocks), size):  # each segment keeps its input; backward recomputes the rest
            x = self.checkpointed(blocks[start:start + size], x)
        return x

    def checkpointed(self, blocks, x):
        """One segment under a checkpoint: its input kept, the rest recomputed in backward."""
        return checkpoint(_run_segment, blocks, *_as_args(x), use_reentrant=False)

    def peak_terms(self, layers, b, s, h, a, e):
        """Bytes alive on top of `kept_bytes` at each of a block's moments where the peak can occur, term by term:
        W ("recomputed: ..."), and T for PyTorch's CPU kernels (CUDA's fused dropout and FP32 statistics change T)."""
        layer = kept_bytes_per_layer("none", b, s, h, a, e)
        x, scores = s * b * h * e, a * s * s * b * e
        qkv_copied, core_copied = matmul_copies(b, a)
        ln_stats = layer["LayerNorm mean and 1/std (2 LNs)"] // 2  # one LayerNorm's
        mlp_saved = ln_stats + sum(layer[k] for k in ("LN2 input", "fc1 input (LN2 output)", "GELU input",
                                                      "fc2 input", "MLP dropout mask"))
        end = {"QKV output (a local variable of forward)": 3 * x * qkv_copied,
               "attention output (a local variable)": x * core_copied, "fc2 output (before dropout)": x}
        mlp = {"gradient through the MLP dropout": x, "MLP dropout mask (freed)": -layer["MLP dropout mask"],
               "gradient of the fc2 input": 4 * x}
        # above the end of the forward once a s / h exceeds about 15 (long sequences)
        att = {"MLP and LN2 saved tensors (freed)": -mlp_saved, "projection input and dropout mask (freed)":
               -(layer["projection input"] + layer["projection dropout mask"]),
               "residual, attention output and V gradients": 3 * x, "attention probabilities' gradient": scores}
        names = ("end of a block's forward", "MLP backward", "attention backward")
        if self.segment is not None:  # full, sqrt: a whole segment recomputed at once
            seg = self.segment(layers)
            unit = {f"recomputed: {seg} layer(s) less the kept input": seg * sum(layer.values()) - x}
            # a shorter last segment leaves the largest one below it, and by its attention backward the gradient
            # from above (which took the place of the freed input of the segment above) is used up
            lower = {"gradient from the segment above (used up)": -x if layers % seg else 0}
            return dict(zip(names, ({**unit, **end}, {**unit, **mlp}, {**unit, **att, **lower})))
        if self.recompute_attention_core:  # the QKV output is kept; backward recomputes the core, copies included
            s2 = sum(layer[k] for k in ("softmax output", "attention dropout mask",
                                        "attention dropout output (input of xV)"))
            core = {"recomputed: q, k, v copies": 3 * x * qkv_copied,
                    "recomputed: softmax, dropout mask and output": s2}
            del end["QKV output (a local variable of forward)"]
            return dict(zip(names, (end, mlp, {**core, **att})))
        return dict(zip(names, (end, mlp, att)))


POLICY_TABLE = {
    "none": Policy(kept=layer_keeps_everything),
    "full": Policy(segment=one_layer, kept=layer_keeps_its_input, recomputed_flops=lambda gemms, core: gemms + core),
    "sqrt": Policy(segment=sqrt_segment_size, recomputed_flops=lambda gemms, core: gemms + core),
    # only QK^T is redone: the core's checkpoint stops once softmax and dropout are rebuilt (no backward needs xV's)
    "selective": Policy(recompute_attention_core=True, kept=layer_keeps_all_but_the_attention_core,
                        recomputed_flops=lambda gemms, core: core // 2),
}
POLICIES = tuple(POLICY_TABLE)


def policy_row(policy):
    """A policy by its name in `POLICY_TABLE`, or a `Policy` itself (as the full file's at-scale forms are)."""
    rule = policy if isinstance(policy, Policy) else POLICY_TABLE.get(policy)
    if rule is None:
        raise ValueError(f"policy={policy!r}; choose one of {POLICIES} or pass a Policy")
    return rule


def run_attention_core(block, core, *args):
    """How a block runs its attention core `core(*args)`: checkpointed when the `selective` policy marked the
    block (`block.recompute_attention_core`), plainly otherwise. Any block adopts selective by calling this."""
    if getattr(block, "recompute_attention_core", False):
        return checkpoint(core, *args, use_reentrant=False)
    return core(*args)


def _run_segment(blocks, *state):
    """Each block maps the state to the next one: a hidden state, or a tuple of tensors (the hidden state and a
    running auxiliary loss, say) passed as positional arguments and returned as a tuple."""
    state = state if len(state) > 1 else state[0]
    for block in blocks:
        state = block(*state) if isinstance(state, tuple) else block(state)
    return state


def _as_args(state):
    return state if isinstance(state, tuple) else (state,)


def run_blocks(blocks, x, policy="none"):
    """Forward through `blocks` with one policy (a name in `POLICY_TABLE`, or a `Policy`). `x` is the hidden
    state, or a tuple of tensors that every block takes as arguments and returns (see `_run_segment`)."""
    return policy_row(policy).run(blocks, x)


# ---- the formulas: kept bytes, FLOPs and the peak per policy ---------------------------------------------

def kept_bytes_per_layer(policy, b, s, h, a, e, device="cpu"):
    """Bytes one layer keeps from forward to backward, term by term: on CUDA dropout keeps a bool mask (1 byte)
    and LayerNorm FP32 statistics; on CPU a mask (x * bernoulli) and the statistics are in x's dtype."""
    kept = policy_row(policy).kept
    if kept is None:
        raise ValueError(f"per-layer kept bytes are not defined for policy {policy!r} (a segment keeps its input: "
                         f"kept_bytes); {', '.join(n for n, r in POLICY_TABLE.items() if r.kept)} have them")
    mask, e_ln = (1, 4) if device == "cuda" else (e, e)
    return kept(b, s, h, a, e, mask, e_ln)


def kept_bytes(policy, layers, b, s, h, a, e, device="cpu"):
    rule = policy_row(policy)
    if rule.kept is None:  # sqrt: one input per segment
        return math.ceil(layers / rule.segment(layers)) * s * b * h * e
    return layers * sum(kept_bytes_per_layer(rule, b, s, h, a, e, device).values())


def korthikanti_bytes_per_layer(policy, b, s, h, a):
    """The paper's 16-bit figures, for comparison (no TP: t = 1)."""
    return {"none": s * b * h * (34 + 5 * a * s / h), "selective": 34 * s * b * h, "full": 2 * s * b * h}.get(policy)


def training_flops(policy, layers, b, s, h):
    """Matmul FLOPs of forward + backward (+ recomputation) for `layers` blocks."""
    gemms = 24 * b * s * h * h          # QKV 6, projection 2, fc1 8, fc2 8
    core = 4 * b * s * s * h            # QK^T 2, xV 2
    return layers * (3 * (gemms + core) + policy_row(policy).recomputed_flops(gemms, core))  # backward: 2 forwards


def matmul_copies(b, a):
    """Which reshapes copy (the kept bytes are the same either way, the peak not): bmm folds (b, a) of q, k, v,
    slices of the QKV output, by a view only when b = 1 or a = 1; the attention output (b, s, a d) unless a = 1."""
    return b > 1 and a > 1, a > 1


def peak_bytes_terms(policy, layers, b, s, h, a, e):
    """{moment: {term: bytes on top of `kept_bytes`}} of one forward and backward (`Policy.peak_terms`)."""
    return policy_row(policy).peak_terms(layers, b, s, h, a, e)


def peak_bytes(policy, layers, b, s, h, a, e):
    """(peak bytes, moment, W, T): kept + the largest moment of `peak_bytes_terms`, its recomputed working set W and
    the rest, the transient T."""
    moments = peak_bytes_terms(policy, layers, b, s, h, a, e)
    moment = max(moments, key=lambda m: sum(moments[m].values()))
    work = sum(v for k, v in moments[moment].items() if k.startswith("recomputed"))
    transient = sum(moments[moment].values()) - work
    return kept_bytes(policy, layers, b, s, h, a, e) + work + transient, moment, work, transient


# ---- measuring: storages alive between forward and backward, the peak, FLOPs of a training step ----------

class _AllocationLog(TorchDispatchMode):
    """Log, in order, every storage an op creates (+bytes) and its release (-bytes, from a weak reference to the
    storage). Outputs on a storage already logged or `foreign` (parameters, buffers, inputs) are views or in-place
    results, not new memory. It sees the tensors ops return, not a kernel's scratch."""

    def __init__(self, foreign=()):
        super().__init__()
        self.events, self.serial_of, self._refs, self._foreign = [], {}, {}, set(foreign)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out,) if isinstance(out, torch.Tensor) else tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = id(storage)  # unique while alive; the entry goes when the storage does
                if key not in self.serial_of and key not in self._foreign:
                    serial, nbytes = len(self.events), storage.nbytes()
                    self.serial_of[key] = serial
                    self.events.append((serial, nbytes))
                    self._refs[key] = weakref.ref(storage, lambda _, k=key, n=nbytes: self._free(k, n))
        return out

    def _free(self, key, nbytes):
        self.events.append((self.serial_of.pop(key), -nbytes))
        del self._refs[key]


def measure_kept_bytes(blocks, x, policy):
    """Bytes alive between forward and backward: storages created in forward and still referenced (by autograd, a
    checkpoint or a cache), plus the input (a tuple state's first tensor), minus the output."""
    state = tuple(t.detach() for t in _as_args(x))
    state[0].requires_grad_(True)
    # views of parameters, buffers (the causal mask) and the input are not activations
    foreign = {id(t.untyped_storage()) for t in list(blocks.parameters()) + list(blocks.buffers()) + list(state)}
    with _AllocationLog(foreign) as log:
        y = run_blocks(blocks, state if isinstance(x, tuple) else state[0], policy)
    gc.collect()
    alive = {key: log.events[serial][1] for key, serial in log.serial_of.items()}  # created, not yet freed
    for out in _as_args(y):
        alive.pop(id(out.untyped_storage()), None)
    return sum(alive.values()) + state[0].untyped_storage().nbytes(), y


def measure_peak_bytes(blocks, x, policy):
    """The most bytes of activations and their gradients alive at once in one forward and backward, from each
    storage's creation to its release: not the parameters' gradients (the same under every policy), the input or
    the output's gradient. The garbage collector is off, so that each tensor goes with its last reference."""
    x = x.detach().requires_grad_(True)
    grad_out = torch.ones_like(x)
    for p in blocks.parameters():
        p.grad = None
    with _AllocationLog():
        # the first op under a Python dispatch mode imports torch._dynamo; garbage cycles from that import hold
        # the callers' frames (a block's forward, with its local variables) until the next collection
        torch.zeros(1) + 1
    foreign = {id(t.untyped_storage()) for t in [*blocks.parameters(), *blocks.buffers(), x, grad_out]}
    gc.disable()
    try:
        with _AllocationLog(foreign) as log:
            run_blocks(blocks, x, policy).backward(grad_out)
        # AccumulateGrad adopts the tensor backward created as .grad: find them by their live storages
        grads = {log.serial_of.get(id(p.grad.untyped_storage())) for p in blocks.parameters()}
    finally:
        gc.enable()
    live = peak = 0
    for serial, nbytes in log.events:
        if serial not in grads:
            live += nbytes
            peak = max(peak, live)
    return peak


def measure_flops(blocks, x, policy):
    x = x.detach().requires_grad_(True)
    with FlopCounterMode(display=False) as counter:
        run_blocks(blocks, x, policy).sum().backward()
    return counter.get_total_flops()


def gradients(blocks, x, policy, seed=1234):
    """Input and parameter gradients of one forward/backward under a fixed dropout seed."""
    x = x.detach().requires_grad_(True)
    for p in blocks.parameters():
        p.grad = None
    torch.manual_seed(seed)
    out = run_blocks(blocks, x, policy)
    out.backward(torch.ones_like(out))
    return [x.grad] + [p.grad.clone() for p in blocks.parameters()]


# BEYOND THE CHAPTER: op-level selective checkpointing, sqrt against full, offloading, the demo
import argparse
import dataclasses
import json

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# ---- op-level selective checkpointing (`SELECTIVE_SAC`): a Policy subclass -----------------------------------
# The idea of `selective` with PyTorch's selective-checkpoint policy API (torchtitan's op-level SAC): the whole
# block is checkpointed (one layer a segment, as under full), the outputs of its projection GEMMs (aten.addmm and
# aten.mm) are cached, every other op is recomputed. Kept: the block input and the 4 GEMM outputs,
# s b h (1 + 3 + 1 + 4 + 1) e = 10 s b h e, less than `selective`, because LayerNorm, GELU and dropout are
# recomputed as well (cheap element-wise work, which FlopCounterMode does not count). FLOPs: both core matmuls
# are redone, 4 b s^2 h a layer: xV's output is the input of the cached projection GEMM, whose saved copy the
# backward needs. A checkpoint around the attention core needs a block that exposes its core; the policy API
# works on any block, picks ops by name and caches whole op outputs. The SAC cache is invisible to saved-tensor
# hooks; `_AllocationLog` sees it because it follows the storages themselves. At the peak its W is A - X less the
# cached fc1 output (4X); its cache frees each cached output once used, and recomputing the attention core is a
# fourth moment.

def _gemm_outputs_only(ctx, op, *args, **kwargs):
    """torchtitan-style op-level SAC: cache the projection GEMMs, recompute everything else."""
    if op in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def layer_keeps_its_input_and_gemm_outputs(b, s, h, a, e, mask, e_ln):
    """Policy selective_sac: the checkpoint's input and the cache of the four projection GEMMs' outputs."""
    sbh = s * b * h
    return {"block input": sbh * e, "QKV GEMM output": 3 * sbh * e, "projection GEMM output": sbh * e,
            "fc1 GEMM output": 4 * sbh * e, "fc2 GEMM output": sbh * e}


@dataclass(frozen=True)
class OpLevelCheckpointing(Policy):
    """A Policy whose checkpoints keep what `context_fn` (torch.utils.checkpoint's) tells them to: here the outputs
    of `_gemm_outputs_only`'s ops."""
    context_fn: Callable = lambda: create_selective_checkpoint_contexts(_gemm_outputs_only)

    def checkpointed(self, blocks, x):
        return checkpoint(_run_segment, blocks, *_as_args(x), use_reentrant=False, context_fn=self.context_fn)

    def peak_terms(self, layers, b, s, h, a, e):
        """The moments of `Policy.peak_terms` under op-level SAC, and the recomputation of the attention core."""
        layer = kept_bytes_per_layer("none", b, s, h, a, e)
        x, scores = s * b * h * e, a * s * s * b * e
        qkv_copied, core_copied = matmul_copies(b, a)
        s2 = sum(layer[k] for k in ("softmax output", "attention dropout mask",
                                    "attention dropout output (input of xV)"))
        ln_stats = layer["LayerNorm mean and 1/std (2 LNs)"] // 2  # one LayerNorm's
        none = Policy().peak_terms(layers, b, s, h, a, e)  # the transients of a block without recomputation
        mlp, att = none["MLP backward"], none["attention backward"]
        # it recomputes the layer but its cached GEMM outputs: fc1's (the GELU input) and the QKV output,
        # which q, k, v are views of when not copied; the cache gives each cached output up once it is used
        unit = {"recomputed: the layer less its input and cached GEMM outputs":
                sum(layer.values()) - x - layer["GELU input"] - 3 * x * (not qkv_copied)}
        used = {"cached QKV (if copied), projection and fc2 outputs (used, freed)": -(3 * x * qkv_copied + 2 * x)}
        return {"end of a block's recomputation": {**unit, "attention output (a local variable)": x * core_copied,
                                                   "cached projection output (used, freed)": -x},
                "MLP backward": {**unit, **used, **mlp}, "attention backward": {**unit, **used, **att},
                "recomputation of the attention core": {
                    "recomputed: LN1 output and statistics, q and k copies, softmax, dropout mask and output":
                        x + ln_stats + 2 * x * qkv_copied + s2,
                    "masked scores (a local variable until dropout returns)": scores}}


SELECTIVE_SAC = OpLevelCheckpointing(segment=one_layer, kept=layer_keeps_its_input_and_gemm_outputs,
                                     recomputed_flops=lambda gemms, core: core)
# the recomputation policies the report measures: the chapter's four and op-level SAC (offloading: below)
RECOMPUTATION_POLICIES = {**POLICY_TABLE, "selective_sac": SELECTIVE_SAC}


# ---- sqrt against full: where sqrt's peak is the lower one ------------------------------------------------
# The transients of sqrt and full are the same, so peak(sqrt) - peak(full) = (seg - 1) A - (L - ceil(L/seg)) X (the
# module docstring; exact when seg divides L, a shorter last segment can make sqrt's one X lower): sqrt lowers the
# peak only when sqrt(L) > A/X, L > (A/X)^2. A/X = 16 + 2m/e + a s (2e + m)/(h e) + 4 e_ln/(h e) is at least 18 on
# CPU and 17 in 16-bit on CUDA and grows with a s / h: below 17^2 = 289 layers at any sequence length, and below
# thousands for long sequences, sqrt's peak is the higher one. The demo prints A/X and the first such L for its
# shapes and for a 16-bit CUDA layer of GPT-3 6.7B's size, and with --long measures both policies at that L for a
# tiny block.

def sqrt_lowers_peak(layers, layer_bytes, input_bytes):
    """Whether sqrt's peak is below full's: ceil(L / seg) kept inputs + one segment's activations against L kept
    inputs + one layer's (each less the recomputed unit's kept input; the transients are the same). Exact when
    seg divides L; with a shorter last segment sqrt's peak can be one input lower still (`peak_bytes_terms`)."""
    seg = sqrt_segment_size(layers)
    return math.ceil(layers / seg) * input_bytes + seg * layer_bytes < layers * input_bytes + layer_bytes


def first_layers_where_sqrt_lowers_peak(layer_bytes, input_bytes):
    """The smallest L for which `sqrt_lowers_peak`: about (A / X)^2, A one layer's activations, X its input."""
    layers = 1
    while not sqrt_lowers_peak(layers, layer_bytes, input_bytes):
        layers += 1
    return layers


# ---- activation offloading (`OffloadPolicy`): what autograd saves waits in host memory, not recomputed ------
# The other lever: keep every saved tensor, but not on the device. Under `offload` each block's saved tensors
# (autograd's, caught by torch.autograd.graph.saved_tensors_hooks; parameters and buffers stay) are copied to host
# memory during the block's forward and copied back before the block's backward. The copies are exact and keep
# their strides (so the backward runs the same kernels): the gradients are bit-identical to none's.
# `selective+offload` recomputes the attention core as `selective` does and offloads the rest: the s^2 terms never
# cross the bus. With K the bytes the policy underneath keeps (`kept_bytes` of none or selective), a step has
#
#     device-resident activations   X = s b h e, the caller's input (all the rest waits on the host)
#     copied to the host (forward)  K, and the same K back (backward): in 16-bit s b h (34 + 5 a s / h) a layer
#                                   under offload, 34 s b h under selective+offload
#
# On CUDA the host copies are pinned and made on a side stream, so the forward does not wait for them; the
# backward of block i waits for block i's copies only, and starts block i-1's (the next backward) at once. On CPU
# the "host" copy is a separate CPU tensor, which `measure_kept_bytes` counts too (`measure_offload` subtracts
# it). Offloading spends bus time instead of FLOPs: a layer's copy out hides behind its forward when
# K_layer / B_pcie <= F_layer / rate (the copy back has the backward, twice as long); otherwise the step waits for
# the difference, and once that wait exceeds a recomputed forward, F_layer / rate, recomputation is the cheaper
# way to free the memory (`offload_or_recompute`). These hooks do not combine with full or sqrt recomputation
# (a checkpoint would offload only its segment's input, already the least there is), and one backward brings the
# activations back once (no retain_graph).

class ActivationOffload:
    """Saved-tensor hooks that keep each block's saved activations on the host from its forward to its backward.
    `hooks(i)` is the context for block i's forward. Tensors on the storage of one of `stay` (the parameters and
    buffers) are no activations and stay where they are. Counts the bytes copied each way."""

    def __init__(self, stay=()):
        self.stay = {t.untyped_storage().data_ptr() for t in stay}
        self.host = {}  # block -> the host copies of its saved tensors, in saving order
        self.back = {}  # block -> {slot: a saved tensor back on the device}, until autograd unpacks it
        self.ready = {}  # block -> a CUDA event: its copies back are done
        self.streams = {}  # device -> the side stream the copies run on
        self.bytes_to_host = self.bytes_to_device = 0

    def hooks(self, index):
        return torch.autograd.graph.saved_tensors_hooks(lambda tensor: self.pack(index, tensor), self.unpack)

    def side_stream(self, device):
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]

    def pack(self, index, tensor):
        if tensor.untyped_storage().data_ptr() in self.stay:
            return tensor
        host = torch.empty_like(tensor, device="cpu", pin_memory=tensor.is_cuda)  # a dense layout keeps its strides
        if tensor.is_cuda:
            stream = self.side_stream(tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor is computed
            with torch.cuda.stream(stream):
                host.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)  # its memory is not reused before the copy has read it
        else:
            host.copy_(tensor)
        self.host.setdefault(index, []).append(host)
        self.bytes_to_host += tensor.numel() * tensor.element_size()
        return index, len(self.host[index]) - 1, tensor.device

    def bring_back(self, index, device):
        """Copy block `index`'s saved tensors back to `device` (on CUDA on the side stream, recording an event)."""
        copies = self.host.pop(index)
        if device.type == "cuda":
            stream = self.side_stream(device)
            with torch.cuda.stream(stream):
                back = [torch.empty_like(h, device=device).copy_(h, non_blocking=True) for h in copies]
            self.ready[index] = stream.record_event()
        else:
            back = [torch.empty_like(h, device=device).copy_(h) for h in copies]
        self.back[index] = dict(enumerate(back))
        self.bytes_to_device += sum(h.numel() * h.element_size() for h in copies)

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        index, slot, device = packed
        if index in self.host:  # block index's backward begins, and its tensors were not prefetched
            self.bring_back(index, device)
        if device.type == "cuda" and index - 1 in self.host:  # block index - 1's backward is next: prefetch it
            self.bring_back(index - 1, device)
        if slot not in self.back.get(index, {}):
            raise RuntimeError("offloaded activations come back once: a second backward (retain_graph) cannot "
                               "use them")
        tensor = self.back[index].pop(slot)
        if device.type == "cuda":
            current = torch.cuda.current_stream(device)
            current.wait_event(self.ready[index])
            tensor.record_stream(current)  # allocated on the side stream, used on this one
        return tensor


def run_offloaded(blocks, x, recompute="none", offload=None):
    """`run_blocks` with `recompute` (none or selective), one block at a time under `offload`'s hooks (a new
    `ActivationOffload` by default)."""
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute={recompute!r}: offloading runs over one of ('none', 'selective')")
    if offload is None:
        offload = ActivationOffload([t for block in blocks for t in (*block.parameters(), *block.buffers())])
    for index in range(len(blocks)):
        with offload.hooks(index):
            x = run_blocks(blocks[index:index + 1], x, recompute)
    return x


@dataclass(frozen=True)
class OffloadPolicy(Policy):
    """A Policy that runs its blocks by `run_offloaded` over the recomputation `underneath` (none or selective),
    with `offload` (an ActivationOffload whose counts the caller reads; None: a new one each forward)."""
    underneath: str = "none"
    offload: Optional[ActivationOffload] = None

    def run(self, blocks, x):
        return run_offloaded(blocks, x, self.underneath, self.offload)


# run_blocks(blocks, x, OFFLOAD_POLICIES["offload"]): what train_gpt.py's --recompute offload runs
OFFLOAD_POLICIES = {"offload": OffloadPolicy(underneath="none"),
                    "selective+offload": OffloadPolicy(underneath="selective",
                                                       recomputed_flops=POLICY_TABLE["selective"].recomputed_flops)}


def offload_bytes(policy, layers, b, s, h, a, e, device="cpu"):
    """The formula: device-resident activation bytes, bytes copied to the host and back in one step."""
    moved = kept_bytes(OFFLOAD_POLICIES[policy].underneath, layers, b, s, h, a, e, device)
    return {"device_resident": s * b * h * e, "to_host": moved, "to_device": moved}


def measure_offload(blocks, x, policy):
    """The same, measured in one forward and backward: the storages alive between them (`measure_kept_bytes`)
    less the host copies, and the bytes `ActivationOffload` copied each way."""
    offload = ActivationOffload([*blocks.parameters(), *blocks.buffers()])
    kept, y = measure_kept_bytes(blocks, x, dataclasses.replace(OFFLOAD_POLICIES[policy], offload=offload))
    on_host = offload.bytes_to_host  # every copy is still there before the backward
    y.backward(torch.ones_like(y))
    return {"device_resident": kept - on_host, "to_host": offload.bytes_to_host, "to_device": offload.bytes_to_device}


def offload_or_recompute(b, s, h, a, e=2, pcie_bytes_per_s=25e9, flops_per_s=400e12, device="cuda"):
    """Per layer and offload policy: the copy's time K_layer / B_pcie against the forward's F_layer / rate that
    it hides behind, the wait if it does not, the bus bandwidth from which it would, and the verdict: offloading
    is free, or cheaper than recomputing a forward, or recomputation wins."""
    forward = training_flops("none", 1, b, s, h) / 3 / flops_per_s  # a step is 3 forwards (backward = 2)
    rows = []
    for policy, rule in OFFLOAD_POLICIES.items():
        layer = sum(kept_bytes_per_layer(rule.underneath, b, s, h, a, e, device).values())
        copy = layer / pcie_bytes_per_s
        wait = max(0.0, copy - forward) + max(0.0, copy - 2 * forward)  # the copy out, the copy back
        verdict = "offload free" if wait == 0 else "offload, waiting" if wait < forward else "recomputation wins"
        rows.append({"policy": policy, "layer_bytes": layer, "copy_s": copy, "forward_s": forward, "wait_s": wait,
                     "free_from_bytes_per_s": layer / forward, "verdict": verdict})
    return rows


def offload_against_formulas(blocks, x, a, pcie_bytes_per_s=25e9, flops_per_s=400e12):
    """Per offload policy on `blocks`: gradients against none's, bytes measured beside `offload_bytes`; then
    `offload_or_recompute` for this shape and a GPT-3 6.7B-sized layer, 16-bit on CUDA."""
    (b, s, h), layers, e = x.shape, len(blocks), x.element_size()
    reference = gradients(blocks, x, "none")
    rows = [{"policy": policy, "gradients_identical": all(
                torch.equal(r, g) for r, g in zip(reference, gradients(blocks, x, OFFLOAD_POLICIES[policy]))),
             "measured": measure_offload(blocks, x, policy), "formula": offload_bytes(policy, layers, b, s, h, a, e)}
            for policy in OFFLOAD_POLICIES]
    shapes = {"report": (b, s, h, a), "gpt3_6.7b": (1, 2048, 4096, 32)}
    timing = {name: {"shape": dict(zip("bsha", shape)),
                     "rows": offload_or_recompute(*shape, 2, pcie_bytes_per_s, flops_per_s)}
              for name, shape in shapes.items()}
    return {"rows": rows, "pcie_bytes_per_s": pcie_bytes_per_s, "flops_per_s": flops_per_s, "timing": timing}

# ---- the report: the chapter's measurements first, then the peaks, the L sweep and sqrt against full ------

def _check_report_args(layers, b, s, h, a, dropout, sweep):
    for name, flag, value in (("layers", "--layers", layers), ("b", "--batch", b), ("s", "--seq", s),
                              ("h", "--hidden", h), ("a", "--heads", a)):
        if value < 1:  # else a division by zero or a math domain error deep in the formulas
            raise ValueError(f"{name}={value} must be a positive integer ({flag})")
    if sweep is not None and (not sweep or min(sweep) < 1):  # None: no sweep
        raise ValueError(f"sweep={sweep!r}: give one or more layer counts >= 1 (--sweep)")
    if not 0.0 < dropout < 1.0:  # p = 0 keeps no masks, and the formulas count them: every figure would differ
        raise ValueError(f"dropout={dropout!r} must be in (0, 1): the formulas printed beside the measurements "
                         "count the dropout masks (Korthikanti et al.'s accounting); 0.1 is usual")


def policies_against_formulas(blocks, x, a):
    """Per policy: kept bytes, FLOPs and the forward+backward peak of `blocks` on `x`, each beside its formula
    (and the paper's 16-bit figure where it gives one)."""
    (b, s, h), layers, e = x.shape, len(blocks), x.element_size()
    rows = []
    for name, policy in RECOMPUTATION_POLICIES.items():
        kept, _ = measure_kept_bytes(blocks, x, policy)
        peak, moment, work, transient = peak_bytes(policy, layers, b, s, h, a, e)
        paper = korthikanti_bytes_per_layer(name, b, s, h, a)
        rows.append({"policy": name, "saved_bytes": kept, "formula_bytes": kept_bytes(policy, layers, b, s, h, a, e),
                     "flops": measure_flops(blocks, x, policy),
                     "formula_flops": training_flops(policy, layers, b, s, h),
                     "korthikanti_16bit_bytes": None if paper is None else layers * paper,
                     "peak_bytes": measure_peak_bytes(blocks, x, policy), "formula_peak_bytes": peak,
                     "peak_moment": moment, "peak_working_set": work, "peak_transient": transient})
    return rows


def kept_bytes_against_layers(sweep, shape, dtype, dropout):
    """Kept bytes and peaks of none, full and sqrt for every L of `sweep` (a block of `shape`), beside the
    formulas, and the growth exponent x of kept ~ L^x between the smallest and the largest L."""
    e = torch.empty(0, dtype=dtype).element_size()
    xs = torch.randn(shape["b"], shape["s"], shape["h"], dtype=dtype)
    rows = []
    for L in sweep:
        blocks = make_blocks(L, shape["h"], shape["a"], shape["s"], dropout).to(dtype)
        row = {"layers": L}
        for policy in ("none", "full", "sqrt"):
            row[policy] = measure_kept_bytes(blocks, xs, policy)[0]
            row[policy + "_formula"] = kept_bytes(policy, L, e=e, **shape)
            row[policy + "_peak"] = measure_peak_bytes(blocks, xs, policy)
            row[policy + "_peak_formula"] = peak_bytes(policy, L, e=e, **shape)[0]
        rows.append(row)
    first, last = min(rows, key=lambda r: r["layers"]), max(rows, key=lambda r: r["layers"])
    exponents = None if first is last else {
        p: math.log(last[p] / first[p]) / math.log(last["layers"] / first["layers"]) for p in ("none", "full", "sqrt")}
    return {"config": {**shape, "dtype": str(dtype).replace("torch.", "")}, "rows": rows, "growth_exponent": exponents}


def report(layers=4, b=2, s=64, h=64, a=4, dropout=0.1, dtype=torch.float32, sweep=(4, 16, 64), crossover=True,
           pcie_bytes_per_s=25e9, flops_per_s=400e12):
    """Every measurement the demo prints, as one dict (what --json writes). `sweep=None` skips the L sweep,
    `crossover=False` the measurement at the first L where sqrt's peak is lower (its formula stays); the bus
    bandwidth and the GPU's rate are those `offload_or_recompute` weighs."""
    _check_report_args(layers, b, s, h, a, dropout, sweep)
    e = torch.empty(0, dtype=dtype).element_size()
    x = torch.randn(b, s, h, dtype=dtype, generator=torch.Generator().manual_seed(0))
    blocks = make_blocks(layers, h, a, s, dropout).to(dtype)
    small = dict(b=1, s=16, h=32, a=2)
    # in this order: each measurement draws its inputs and dropout masks from the default RNG
    return {"config": {"layers": layers, "batch": b, "seq": s, "hidden": h, "heads": a, "dropout": dropout,
                       "dtype": str(dtype).replace("torch.", ""), "bytes_per_element": e},
            "rows": policies_against_formulas(blocks, x, a),
            "sweep": None if sweep is None else kept_bytes_against_layers(sweep, small, dtype, dropout),
            "sqrt_vs_full": sqrt_vs_full(dict(b=b, s=s, h=h, a=a), small, e, dtype, dropout, measure=crossover),
            "offload": offload_against_formulas(blocks, x, a, pcie_bytes_per_s, flops_per_s)}


def sqrt_vs_full(shape, sweep_shape, e, dtype=torch.float32, dropout=0.1, measure=True):
    """Where sqrt's peak goes below full's (`sqrt_lowers_peak`): for the report's shapes, for 16-bit on CUDA at
    a GPT-3 6.7B-sized layer (formula only), and measured at the first such L for a tiny block, whose A / X
    is close to the least it can be (18 on CPU, as s / h -> 0)."""
    def case(b, s, h, a, e, device="cpu"):
        layer, x = sum(kept_bytes_per_layer("none", b, s, h, a, e, device).values()), s * b * h * e
        return {"shape": dict(b=b, s=s, h=h, a=a, e=e, device=device), "layer_over_input": layer / x,
                "first_layers": first_layers_where_sqrt_lowers_peak(layer, x)}
    out = {"report": case(e=e, **shape), "sweep": case(e=e, **sweep_shape),
           "cuda_16bit": case(1, 2048, 4096, 32, 2, "cuda"), "tiny": case(2, 2, 32, 2, e)}
    if measure:
        tiny = out["tiny"]
        sh, L = tiny["shape"], tiny["first_layers"]
        blocks = make_blocks(L, sh["h"], sh["a"], sh["s"], dropout).to(dtype)
        x = torch.randn(sh["b"], sh["s"], sh["h"], dtype=dtype)
        for policy in ("full", "sqrt"):
            tiny[policy + "_peak"] = measure_peak_bytes(blocks, x, policy)
            tiny[policy + "_peak_formula"] = peak_bytes(policy, L, sh["b"], sh["s"], sh["h"], sh["a"], e)[0]
    return out


def show_kept_bytes_and_flops(r):
    c = r["config"]
    print(f"== the chapter: L={c['layers']} blocks, b={c['batch']}, s={c['seq']}, h={c['hidden']}, a={c['heads']}, "
          f"{c['dtype']}, dropout {c['dropout']}: kept bytes and FLOPs, measured beside the formulas")
    print(f"{'policy':14s} {'kept bytes':>11s} {'formula':>11s} {'paper 16-bit':>12s} {'MFLOP':>9s} "
          f"{'formula':>9s} {'vs none':>8s}")
    base = r["rows"][0]["flops"]
    for row in r["rows"]:
        paper = "" if row["korthikanti_16bit_bytes"] is None else f"{row['korthikanti_16bit_bytes']:.0f}"
        print(f"{row['policy']:14s} {row['saved_bytes']:11d} {row['formula_bytes']:11d} {paper:>12s} "
              f"{row['flops'] / 1e6:9.2f} {row['formula_flops'] / 1e6:9.2f} {row['flops'] / base - 1:+8.1%}")


def show_per_layer_terms_against_the_paper(r):
    c = r["config"]
    e, shape = c["bytes_per_element"], (c["batch"], c["seq"], c["hidden"], c["heads"])
    terms = kept_bytes_per_layer("none", *shape, e)
    cuda16 = kept_bytes_per_layer("none", *shape, 2, device="cuda")
    paper = korthikanti_bytes_per_layer("none", *shape)
    print(f"\nper-layer terms, policy none: here ({e}-byte elements; CPU dropout keeps {e}-byte masks) | "
          "bf16 on CUDA (1-byte masks, FP32 LN statistics)")
    for name, v in terms.items():
        print(f"   {name:42s} {v:9d} | {cuda16[name]:9d}")
    ln = cuda16["LayerNorm mean and 1/std (2 LNs)"]
    print(f"   bf16/CUDA total {sum(cuda16.values())} = the paper's sbh(34 + 5as/h) = {paper:.0f} + {ln} bytes of "
          "LayerNorm statistics, which the paper leaves out")


def show_peak_is_kept_plus_working_set_plus_transient(r):
    print("\n== the forward+backward peak, measured | formula = kept + W (recomputed, alive at once) + T (transient), "
          "at the moment it occurs")
    for row in r["rows"]:
        print(f"{row['policy']:14s} {row['peak_bytes']:9d} | {row['formula_peak_bytes']:9d} = "
              f"{row['formula_bytes']:9d} + {row['peak_working_set']:8d} + {row['peak_transient']:7d}   "
              f"{row['peak_moment']}")


def show_kept_bytes_against_layers(r):
    sw = r["sweep"]
    if sw is None:
        print("\n(--long or --sweep: kept bytes and peaks against L, sqrt's growing as sqrt(L))")
        return
    print(f"\n== kept bytes and peak against L (b={sw['config']['b']}, s={sw['config']['s']}, "
          f"h={sw['config']['h']}): measured (formula)")
    for row in sw["rows"]:
        print(f"   L={row['layers']:3d}  kept  none {row['none']:9d} ({row['none_formula']})  full {row['full']:8d} "
              f"({row['full_formula']})  sqrt {row['sqrt']:7d} ({row['sqrt_formula']})")
        print(f"          peak  none {row['none_peak']:9d} ({row['none_peak_formula']})  full {row['full_peak']:8d} "
              f"({row['full_peak_formula']})  sqrt {row['sqrt_peak']:7d} ({row['sqrt_peak_formula']})")
    g = sw["growth_exponent"]
    if g:
        print(f"   growth exponent (kept ~ L^x): none {g['none']:.2f}, full {g['full']:.2f}, sqrt {g['sqrt']:.2f}")


def show_where_sqrt_lowers_the_peak(r):
    print("\n== sqrt's peak is below full's only when ceil(L/seg) inputs + seg layers < L inputs + 1 layer, "
          "about L > (A/X)^2 (A: a layer's activations, X: its input)")
    for name, case in r["sqrt_vs_full"].items():
        sh = case["shape"]
        line = (f"   {name:10s} b={sh['b']} s={sh['s']} h={sh['h']} a={sh['a']} e={sh['e']} {sh['device']:4s}: "
                f"A/X = {case['layer_over_input']:6.2f}, first L = {case['first_layers']}")
        if "sqrt_peak" in case:
            line += (f"; measured there: full {case['full_peak']} ({case['full_peak_formula']}), "
                     f"sqrt {case['sqrt_peak']} ({case['sqrt_peak_formula']})")
        print(line)
    if "sqrt_peak" not in r["sqrt_vs_full"]["tiny"]:
        print("   (--long measures full and sqrt at the tiny block's first L)")


def show_offload_against_recomputation(r):
    off = r["offload"]
    print("\n== offloading: saved tensors on the host from each block's forward to its backward, measured (formula)")
    for row in off["rows"]:
        m, f = row["measured"], row["formula"]
        print(f"   {row['policy']:18s} gradients identical to none: {row['gradients_identical']}; device-resident "
              f"{m['device_resident']} ({f['device_resident']}), copied to host {m['to_host']} ({f['to_host']}), "
              f"back {m['to_device']} ({f['to_device']})")
    print(f"   a layer's copy (16-bit, CUDA) at {off['pcie_bytes_per_s'] / 1e9:g} GB/s against its forward at "
          f"{off['flops_per_s'] / 1e12:g} TFLOP/s (--pcie-gbps, --gpu-tflops):")
    for name, case in off["timing"].items():
        for row in case["rows"]:
            print(f"   {name:10s} {row['policy']:18s} {row['layer_bytes']:10d} bytes: "
                  f"copy {row['copy_s'] * 1e3:.4g} ms, forward {row['forward_s'] * 1e3:.4g} ms, "
                  f"wait {row['wait_s'] * 1e3:.4g} ms: {row['verdict']} "
                  f"(free from {row['free_from_bytes_per_s'] / 1e9:.0f} GB/s)")


def print_report(r):
    """The demo: `report`'s measurements, the chapter's claims first, each beside its formula."""
    show_kept_bytes_and_flops(r)
    show_per_layer_terms_against_the_paper(r)
    show_peak_is_kept_plus_working_set_plus_transient(r)
    show_kept_bytes_against_layers(r)
    show_where_sqrt_lowers_the_peak(r)
    show_offload_against_recomputation(r)


def main(argv=None):
    ap = argparse.ArgumentParser(description="Measure activation recomputation policies against the formulas.")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--long", action="store_true",
                    help="also the L sweep (--sweep, default 4 16 64) and the crossover measurement (some seconds)")
    ap.add_argument("--sweep", type=int, nargs="+", default=None, help="layer counts of the L sweep (implies it)")
    ap.add_argument("--no-crossover", action="store_true",
                    help="with --long, skip measuring full and sqrt at the first L where sqrt's peak is lower")
    ap.add_argument("--pcie-gbps", type=float, default=25.0, help="host-device bandwidth that offloading uses")
    ap.add_argument("--gpu-tflops", type=float, default=400.0, help="the GPU's matmul rate it is weighed against")
    args = ap.parse_args(argv)
    sweep = tuple(args.sweep) if args.sweep is not None else (4, 16, 64) if args.long else None
    try:
        result = report(args.layers, args.batch, args.seq, args.hidden, args.heads, sweep=sweep,
                        crossover=args.long and not args.no_crossover, pcie_bytes_per_s=args.pcie_gbps * 1e9,
                        flops_per_s=args.gpu_tflops * 1e12)
    except ValueError as e:  # a shape that cannot work: one line and the usage-error code
        ap.exit(2, f"checkpointing.py: error: {e}\n")
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_report(result)


if __name__ == "__main__":
    torch.set_num_threads(1)  # tiny tensors: more threads only contend on a busy machine
    main()
