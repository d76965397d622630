"""Mixed precision: number formats, FP32 master weights and main grads, ZeRO-1, FP16 loss scaling, FP8.

A floating-point format spends its bits on an exponent (range) and a mantissa (precision). Every figure
below comes from `torch.finfo`, run `python mixed_precision.py` to print the table:

    format  bits  exp  mant  max        min normal  eps (spacing at 1.0)  used for
    FP32    32    8    23    3.4e38     1.2e-38     1.2e-7                master weights, optimizer states
    FP16    16    5    10    65504      6.1e-5      9.8e-4                legacy; overflows, needs loss scaling
    BF16    16    8    7     3.4e38     1.2e-38     7.8e-3                training: FP32's range, less precision
    E4M3    8     4    3     448        1.6e-2      0.125                 FP8 forward (weights, activations)
    E5M2    8     5    2     57344      6.1e-5      0.25                  FP8 gradients (range over precision)

BF16 with FP32 master weights. Parameters, activations and gradients are BF16 (half the bytes, tensor-core
speed), but the optimizer updates an FP32 copy of every parameter. The reason is the update size: near
1.0, BF16 values are 2^-7 = 0.0078 apart, so a weight of 1.0 receiving an update of 1e-3 rounds back to
1.0, every step, forever; the FP32 master accumulates the updates and the BF16 weight is re-rounded from
it after each step. The autocast flow keeps FP32 parameters (4 + 4 + 8 = 16 bytes) and casts them to BF16
inside each op; autocast caches every cast until its region exits, so at the end of the forward all of
them are alive together: +2 bytes/param transient (`transient_bytes`, measured by `ParameterCopyTracker`).

FP32 gradient accumulation ("main grads", Megatron-LM). With m micro-batches per step, summing the BF16
gradients in a BF16 .grad rounds m times to 8 significant bits (measured: 16 micro-batches land 1e-2 of
the sum's size away from the exact sum). `MixedPrecisionOptimizer` gives every parameter a persistent
`main_grad` in the master dtype, a view of one flat buffer, and a gradient hook adds each backward's p.grad
into it and frees p.grad: one FP32 rounding per micro-batch (measured 1e-8). A parameter already in the
master dtype needs no copy: its .grad IS its main_grad view, and autograd accumulates into the flat buffer
in place (DDP's gradient_as_bucket_view); its hook only copies back a .grad that replaced the view (autograd
sums out of place under create_graph=True). Data-parallel reductions run on these FP32
buffers, so the sum over ranks does not round in BF16 either. Per parameter with Adam: 2 (BF16 weight)
+ 4 (FP32 main grad) + 4 (FP32 master) + 8 (Adam moments) = 18 bytes; the ZeRO paper's 16 keeps BF16
gradients. A parameter already in the master dtype (FP32, or float64 for tests) has no separate master:
the optimizer updates its own storage, 4 + 4 + 8 = 16 bytes.

The distributed optimizer (ZeRO-1, Megatron-LM's DistributedOptimizer), zero=1. Each shard-group entry
(dense weights over DP x CP, expert weights over EDP) lays its parameters and main grads out in flat
buffers padded to a multiple of the group size d; rank r owns the r-th 1/d of them. A step then is:
reduce-scatter (SUM) of the main grads, so each rank receives the sum of its shard only; the inner
optimizer steps the pieces of the parameters that fall in the shard (their FP32 masters, or the
parameters' own storage); each rank rounds its updated shard into the parameter buffer; one all-gather
rebuilds the full parameters everywhere. Each rank sends (d-1)/d x (4 + e) bytes per parameter (FP32 gradients
scattered, parameters of e bytes gathered): for FP32 parameters the 2 (d-1)/d x 4 of the all-reduce without
ZeRO (a reduce-scatter and an all-gather are its two halves), for BF16 ones 3/4 of it. Masters and optimizer
states shrink by d:

    bytes per parameter, Adam        zero=0            zero=1 over d ranks    (ZeRO, Rajbhandari et al. 2020)
    FP32 params, FP32 grads          4 + 4 + 8 = 16    8 + 8/d
    BF16 params, FP32 main grads     2 + 4 + 12 = 18   6 + 12/d

measured from the live tensors by `memory_bytes()` and printed by the demo (d = 2 and 3, forked ranks).

One step, in order: reduce (SUM over each entry's group; nothing here averages, the caller passes
grad_scale = 1 / tokens), multiply by grad_scale / loss_scale, the global gradient norm over the
gradients this rank owns (its shard; under zero=0 group rank 0 of each entry), summed over `norm_group`
in the same 2-element all-reduce that carries the loss scaler's overflow probe (one collective, one host
sync), skip on overflow, clip as `clip_grad_norm_`, inner step, publish the parameters, zero the main
grads. Checkpoints: `owned_state(p)` hands out this rank's piece of p's master and optimizer states as the
live tensors and the range of p they cover, for a checkpoint that writes each shard where it lies
(train_gpt.py's); `full_state(p)` gathers them as full tensors (12 bytes per parameter for Adam, so for small
models), so a run saved under one layout (zero=0 on 2 ranks) resumes under another (zero=1 on 3 ranks, or one
process).

FP16 dynamic loss scaling. FP16 has 5 exponent bits: gradients below 6e-8 (its smallest subnormal) flush
to zero. Multiplying the loss by S (2^16 to start) shifts every gradient up by S; before the step the
FP32 gradients are divided by S. If any gradient overflowed to inf/NaN the step is skipped and S halved
on every rank whose gradients are part of the step, or ranks would diverge (`unscale_and_check`
MAX-reduces its flag; `MixedPrecisionOptimizer.step` reads it from the gradient-norm all-reduce); after
`growth_interval` clean steps S doubles again. `DynamicLossScaler` reproduces `torch.amp.GradScaler`.

FP8 with per-tensor dynamic scaling. E4M3 reaches only 448, so each tensor is scaled into range first:
`scale = fp8_max / max(amax, eps)`, `x_fp8 = clamp(x * scale, +-fp8_max).to(fp8)`, and `x ~= x_fp8 / scale`.
The clamp is explicit because casts differ (torch 2.13 saturates E4M3 but turns E5M2 overflow into inf).
`fp8_linear` (and the module `FP8Linear`) multiplies the E4M3 input and weight with `torch._scaled_mm`
(Hopper/Ada GPUs, and CPU in torch 2.13, for dimensions that are multiples of 16; otherwise an emulation
with the same arithmetic) accumulating in FP32, and computes its backward in BF16 from the saved
high-precision tensors. A per-tensor scale belongs to the whole tensor: under tensor parallelism the
amaxes of the input and the weight are MAX-reduced over the TP group (`amax_group`, one 2-element
all-reduce per GEMM) so that every shard of a column- or row-parallel weight, and every shard of a
row-parallel input, is quantised on the grid of the full tensor, as on one GPU. `fp8_log["gemm:count"]`
counts the FP8 forward GEMMs. Its FP8 weight copies are transient and live one GEMM at a time: the
weight's FP32 staging copy (scaled and clamped in place) and its FP8 copy, 4 + 1 = 5 bytes per element of
the largest weight at the peak, not a cost per parameter (`transient_bytes`, measured).
Relative rounding error is at most eps/2: 6.25% for E4M3 (about 31 dB SQNR on Gaussian data), 12.5% for
E5M2. Delayed scaling (Transformer Engine) takes the scale from the amax history of earlier steps, so it
needs no extra pass over the tensor, at the risk of saturating a sudden outlier. Here it does not combine
with activation checkpointing: recomputation reruns the forward, which appends its amax to the history a
second time and takes its scale from a history the first run already changed, so the backward works on
activations the forward never produced (Transformer Engine saves the forward's scales for its recompute
phase). Current scaling, the default, is a function of the tensors alone and recomputes exactly. Real
FP8 training adds: E5M2 gradients in the backward GEMMs, per-block scaling (MXFP8, DeepSeek-V3's 1x128 /
128x128 tiles) so an outlier spoils only its block, FP8 weight caches and FP8 all-gathers.
"""
import math
from typing import NamedTuple
import multiprocessing
import numbers
import os
import tempfile
from collections import Counter
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# ----------------------------------------------------------------------------------------------------
# The formats
# ----------------------------------------------------------------------------------------------------

FORMATS = [
    ("FP32", torch.float32, "master weights and optimizer states"),
    ("FP16", torch.float16, "legacy mixed precision; overflows above 65504, needs loss scaling"),
    ("BF16", torch.bfloat16, "preferred for training: FP32's range with 8 bits of precision"),
    ("FP8 E4M3", torch.float8_e4m3fn, "H100 forward: weights and activations (precision over range)"),
    ("FP8 E5M2", torch.float8_e5m2, "H100 backward: gradients (range over precision)"),
]


def dtype_table():
    """One dict per format; every number from torch.finfo and the bit layout (eps = 2^-mantissa_bits)."""
    rows = []
    for name, dtype, use in FORMATS:
        fi = torch.finfo(dtype)
        mantissa = round(-math.log2(fi.eps))
        rows.append({"name": name, "dtype": str(dtype).replace("torch.", ""), "bits": fi.bits,
                     "exponent_bits": fi.bits - 1 - mantissa, "mantissa_bits": mantissa, "max": fi.max,
                     "min_normal": fi.smallest_normal, "min_subnormal": fi.smallest_normal * fi.eps,
                     "eps": fi.eps, "use": use})
    return rows


# ----------------------------------------------------------------------------------------------------
# FP16 dynamic loss scaling (the torch.amp.GradScaler algorithm)
# ----------------------------------------------------------------------------------------------------

class DynamicLossScaler:
    """Scale the loss up, unscale the gradients, skip the step and back off on inf/NaN, grow when clean."""

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self._set(init_scale, growth_factor, backoff_factor, growth_interval, growth_tracker=0)

    def _set(self, init_scale, growth_factor, backoff_factor, growth_interval, growth_tracker):
        """Check everything, then assign: a bad value (a constructor's or a checkpoint's) changes nothing."""
        # GradScaler checks only growth_factor > 1 and backoff_factor < 1; the rest would fail silently: a
        # scale of 0 turns every gradient into NaN after unscaling (0 * 1/0) and steps on it, an infinite or NaN
        # scale overflows every step and skips them all forever, a fractional interval never grows
        scale = torch.tensor(init_scale, dtype=torch.float32)  # FP32, as GradScaler keeps it
        if not (torch.isfinite(scale) and scale > 0):
            raise ValueError(f"init_scale={init_scale!r} must be finite and > 0 in FP32 (2.0 ** 16 is usual)")
        if not (math.isfinite(growth_factor) and growth_factor > 1.0):
            raise ValueError(f"growth_factor={growth_factor!r} must be finite and > 1 (2.0 is usual)")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor={backoff_factor!r} must be in (0, 1) (0.5 is usual)")
        if not isinstance(growth_interval, numbers.Integral) or growth_interval < 1:
            raise ValueError(f"growth_interval={growth_interval!r} must be an int >= 1 (2000 is usual)")
        if not isinstance(growth_tracker, numbers.Integral) or not 0 <= growth_tracker < growth_interval:
            raise ValueError(f"_growth_tracker={growth_tracker!r} must be an int in [0, growth_interval="
                             f"{growth_interval}): the clean steps since the last change of scale")
        self._scale = scale
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self._growth_tracker = growth_tracker

    @property
    def scale(self):
        return self._scale.item()

    def scale_loss(self, loss):
        return loss * self._scale.to(loss.device)

    def unscale_and_check(self, params, group=None):
        """Divide every gradient by the scale in place; True if any gradient anywhere in `group` is inf/NaN."""
        group_size = _group_size(group, "unscale_and_check's group")
        grads = [p.grad for p in params if p.grad is not None]
        if any(g.dtype == torch.float16 for g in grads):  # on every rank alike, before the all-reduce
            # divided in FP16, the small gradients that the scale lifted above FP16's smallest value fall back
            # to 0 (GradScaler refuses them likewise)
            raise ValueError("params: an FP16 gradient cannot be unscaled in FP16; keep FP32 gradients (e.g. the "
                             "FP32 main grads of MixedPrecisionOptimizer, which unscales them itself)")
        device = grads[0].device if grads else _collective_device(group if group_size > 1 else None)
        inv_scale = self._scale.double().reciprocal().float().to(device)  # as GradScaler: one rounding of 1/S
        found = torch.zeros(1, device=device)
        for g in grads:  # no host sync per tensor: the flag stays on the device until the end
            found = torch.maximum(found, (~torch.isfinite(g)).any().float())
            g.mul_(inv_scale)
        if group_size > 1:
            # every rank must skip together, or their weights diverge
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return bool(found.item())

    def update(self, found_inf):
        if found_inf:
            self._scale = torch.tensor(self.scale * self.backoff_factor, dtype=torch.float32)
            self._growth_tracker = 0
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            grown = torch.tensor(self.scale * self.growth_factor, dtype=torch.float32)
            if torch.isfinite(grown):  # never grow to infinity
                self._scale = grown
            self._growth_tracker = 0

    def state_dict(self):
        return {"scale": self.scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state):
        """Checked as the constructor checks, so a corrupt checkpoint (a scale of 0 or inf) stops here instead of
        stepping on NaN or skipping every step."""
        self._set(state["scale"], state["growth_factor"], state["backoff_factor"], state["growth_interval"],
                  state["_growth_tracker"])


# ----------------------------------------------------------------------------------------------------
# The optimizer wrapper: FP32 main grads, master weights, ZeRO-1 (Megatron-LM's distributed optimizer)
# ----------------------------------------------------------------------------------------------------

_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Bytes this rank sends in the buckets' collectives, as a ring sends them: an all-reduce 2 (d-1)/d of its buffer,
# a reduce-scatter (d-1)/d of its input, an all-gather (d-1)/d of its output (the demo reads it)
comm_bytes = Counter()


def _count_sent(kind, tensor, d, factor):
    comm_bytes[kind] += factor * (d - 1) / d * tensor.numel() * tensor.element_size()
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _collective_device(group):
    """Where a tensor must live to take part in `group`'s collectives: this process's GPU under NCCL (which
    takes no CPU tensors), else the CPU. For a rank that has no tensor of its own to take the device from."""
    if group is not None and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _group_size(group, name="group"):
    """1 for None (no communication). A group without this rank is refused: torch answers -1 for its size and
    its collectives return at once there, so this rank would silently leave the sum (and clip, or skip,
    alone)."""
    if group is None:
        return 1
    size = dist.get_world_size(group)
    if size < 0:
        raise ValueError(f"{name}: this rank is not a member of the group; pass a group that contains this rank "
                         "(or None for no communication)")
    return size


def _accumulate_main_grad(p):
    """Gradient hook, after autograd has written p.grad: add it to the persistent main grad (in the master
    dtype, so that m micro-batches cost one rounding each in FP32, not m roundings in BF16), free p.grad."""
    with torch.no_grad():  # a gradient with a graph (create_graph=True) joins as a value
        p.main_grad.add_(p.grad.detach())
    p.grad = None


def _grad_is_main_grad(p):
    """A parameter already in the master dtype has p.grad = p.main_grad: autograd accumulates in place into
    the flat buffer (DDP's gradient_as_bucket_view), with no copy."""
    return p.grad is not None and p.grad.data_ptr() == p.main_grad.data_ptr()


def _adopt_grad(p):
    """Gradient hook of a parameter already in the master dtype. Its p.grad is its gradient, as torch defines
    it: when something replaced the main_grad view (autograd accumulates out of place, main_grad + new, under
    create_graph=True; a user writes p.grad = p.grad * 2 or p.grad = g), the new tensor is the whole gradient.
    It is COPIED into main_grad, not added (adding would count main_grad's content twice), and p.grad points
    at main_grad again."""
    if p.grad is None or _grad_is_main_grad(p):
        return
    with torch.no_grad():
        p.main_grad.copy_(p.grad.detach())
    p.grad = p.main_grad


class _Bucket:
    """The parameters of one shard-group entry that share a dtype and a device, laid out in flat buffers.

    params      param dtype, padded length N: every parameter's .data becomes a view of its range
    main grads  master dtype, length N: every parameter's .main_grad is a view of its range
    master      master dtype, this rank's shard only, and only when the param dtype is narrower; otherwise
                the shard of the parameter buffer itself is what the optimizer updates

    Sharding (zero=1): N is padded to a multiple of the group size d and rank r owns [r N/d, (r+1) N/d) of
    every buffer. With zero=0 there is one shard, the whole unpadded buffer, on every rank. Each parameter
    contributes the piece of it that falls into the shard (possibly empty): the pieces are the inner
    optimizer's parameters, so per-group options (weight decay) apply per parameter, and every rank holds
    a state entry for every parameter (full_state relies on it)."""

    def __init__(self, params, group, zero, master_dtype):
        self.params, self.group, self.zero = params, group, zero
        self.group_size = _group_size(group)
        self.group_rank = 0 if group is None else dist.get_rank(group)
        shards = self.group_size if zero == 1 else 1
        numel = sum(p.numel() for p in params)
        padded = math.ceil(numel / shards) * shards
        self.padding = padded - numel
        shard = padded // shards
        self.lo = shard * (self.group_rank if zero == 1 else 0)
        self.hi = self.lo + shard
        dtype, device = params[0].dtype, params[0].device
        self.param_flat = torch.zeros(padded, dtype=dtype, device=device)
        self.grad_flat = torch.zeros(padded, dtype=master_dtype, device=device)
        self.starts, start = [], 0
        with torch.no_grad():
            for p in params:
                view = self.param_flat[start:start + p.numel()].view(p.shape)
                view.copy_(p)
                p.data = view  # the same Parameter object: the model keeps working, now on the flat buffer
                p.main_grad = self.grad_flat[start:start + p.numel()].view(p.shape)
                self.starts.append(start)
                start += p.numel()
        owned = self.param_flat[self.lo:self.hi]
        self.separate_master = dtype != master_dtype
        self.master_flat = owned.to(master_dtype) if self.separate_master else owned  # .to copies
        self.pieces = [self._piece(p, start) for p, start in zip(params, self.starts)]

    def _piece(self, p, start):
        a = min(max(start, self.lo), self.hi)  # the intersection of [start, start + numel) with the shard
        b = min(max(start + p.numel(), self.lo), self.hi)
        piece, grad = self.master_flat[a - self.lo:b - self.lo], self.grad_flat[a:b]
        if self.zero == 0:  # whole parameters: keep their shapes (shape-aware optimizers work unsharded)
            piece, grad = piece.view(p.shape), grad.view(p.shape)
        piece.grad = grad  # a persistent view: the optimizer reads the reduced main grads in place
        piece.range = (a - start, b - start) if b > a else (0, 0)  # its elements of p.view(-1)
        return piece

    @property
    def sharded(self):
        return self.zero == 1 and self.group_size > 1

    def owned_grads(self):
        return self.grad_flat[self.lo:self.hi]

    def counts_in_norm(self):
        """Sharded: each rank counts its shard. Replicated (zero=0): only group rank 0 counts the reduced
        gradient, which every rank of the group holds identically."""
        return self.zero == 1 or self.group_rank == 0

    def reduce_grads(self):
        """SUM over the group: all-reduce of the whole buffer, or reduce-scatter into this rank's shard."""
        if self.group_size == 1:
            return
        if self.zero == 1:
            _count_sent("reduce_scatter", self.grad_flat, self.group_size, 1)
            _reduce_scatter_flat(self.grad_flat[self.lo:self.hi], self.grad_flat, group=self.group)
        else:
            _count_sent("all_reduce", self.grad_flat, self.group_size, 2)
            dist.all_reduce(self.grad_flat, group=self.group)

    def publish_params(self):
        """Round the updated master shard into the parameter buffer, then all-gather the shards."""
        with torch.no_grad():
            if self.separate_master:
                self.param_flat[self.lo:self.hi].copy_(self.master_flat)
            if self.sharded:
                _count_sent("all_gather", self.param_flat, self.group_size, 1)
                _all_gather_flat(self.param_flat, self.param_flat[self.lo:self.hi], group=self.group)


class StepResult(NamedTuple):
    """What step() did: `stepped` (False when the loss scaler skipped an overflowing step) and the global
    gradient norm. True as a boolean exactly when the step was taken."""
    stepped: bool
    grad_norm: float

    def __bool__(self):
        return self.stepped


class MixedPrecisionOptimizer:
    """Any torch.optim optimizer stepping master weights of the parameters, with FP32 gradient accumulation,
    data-parallel gradient reduction (SUM), optional ZeRO-1 sharding, global-norm clipping and loss scaling.

        opt = MixedPrecisionOptimizer(
            [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
            torch.optim.AdamW, shard_groups=[(dense, dp_cp_group), (experts, edp_group)], zero=1, lr=3e-4)
        for micro_batch in ...: loss.backward()      # hooks add every p.grad into p.main_grad (FP32)
        opt.all_reduce_grads([tied_embedding], embedding_group)   # extra sums the caller needs, if any
        stepped, grad_norm = opt.step(grad_scale=1 / tokens, max_norm=1.0, norm_group=world)

    shard_groups: (params, group) entries; a parameter's main grad is SUMMED over its entry's group, and with
    zero=1 its master weight and optimizer state are sharded over that group. A parameter in no entry, or in
    an entry with group None, has no data-parallel communication. Nothing averages: the caller normalises
    (grad_scale). master_dtype: the dtype of main grads, masters and the inner optimizer's state; a
    parameter already in master_dtype has no separate master (the optimizer updates its own storage).
    Under zero=1 the inner optimizer sees 1-D pieces of parameters, so it must act elementwise (Adam, SGD:
    as in Megatron-LM); under zero=0 it sees whole parameters of their shapes.

    The parameters become views of flat buffers (one per entry, dtype and device), and each gets a gradient
    hook (in the master dtype also a .grad that is its main_grad view: leave it, zero_grad() keeps it; a
    p.grad that replaces it is taken as the whole gradient, as in torch):
    build the optimizer once the model has its final dtype and device, before anything else takes views of
    the parameters' storage, and only one optimizer per parameter.
    """

    def __init__(self, params_or_param_groups, optimizer_class, *, shard_groups=None, zero=0, loss_scaler=None,
                 master_dtype=torch.float32, **optimizer_defaults):
        groups = self._param_groups(params_or_param_groups)
        self.params = [p for g in groups for p in g["params"]]
        entries = self._check_arguments(self.params, shard_groups, zero, master_dtype, optimizer_defaults)
        # the inner optimizer's own checks (a bad lr, say) run on stand-ins, before any parameter is touched
        optimizer_class([{**{k: v for k, v in g.items() if k != "params"},
                          "params": [torch.zeros(1, dtype=master_dtype, requires_grad=True)]} for g in groups],
                        **optimizer_defaults)
        self.zero, self.master_dtype, self.loss_scaler = zero, master_dtype, loss_scaler
        self._buckets, self._where = [], {}  # id(param) -> (bucket, index in the bucket)
        for entry_params, group in entries:
            by_kind = {}  # one buffer per (dtype, device): a flat buffer holds one dtype
            for p in entry_params:
                by_kind.setdefault((p.dtype, p.device), []).append(p)
            for kind_params in by_kind.values():
                bucket = _Bucket(kind_params, group, zero, master_dtype)
                self._buckets.append(bucket)
                for i, p in enumerate(kind_params):
                    self._where[id(p)] = (bucket, i)
        for p in self.params:
            if p.dtype == master_dtype:
                p.grad = p.main_grad
                p.register_post_accumulate_grad_hook(_adopt_grad)
            else:
                p.register_post_accumulate_grad_hook(_accumulate_main_grad)
        self.optimizer = optimizer_class(
            [{**{k: v for k, v in g.items() if k != "params"}, "params": [self._piece(p) for p in g["params"]]}
             for g in groups], **optimizer_defaults)

    # ---- construction ----

    @staticmethod
    def _param_groups(params_or_param_groups):
        items = list(params_or_param_groups)
        if not (items and isinstance(items[0], dict)):
            items = [{"params": items}]  # a plain iterable of parameters: one group
        groups = []
        for g in items:  # as torch.optim: a group's params may be one tensor; frozen ones are left out
            params = [g["params"]] if torch.is_tensor(g["params"]) else list(g["params"])
            groups.append({**g, "params": [p for p in params if p.requires_grad]})
        if not any(g["params"] for g in groups):
            raise ValueError("params_or_param_groups holds no parameter that requires grad: pass the model's "
                             "parameters (or a list of dicts with a 'params' key)")
        return groups

    @staticmethod
    def _check_arguments(params, shard_groups, zero, master_dtype, optimizer_defaults):
        """Every impossible argument raises here, on every rank, before any buffer or collective."""
        def name(p):
            i = next(i for i, q in enumerate(params) if q is p)
            return f"parameter {i} (shape {tuple(p.shape)}, {p.dtype})"

        if "dp_group" in optimizer_defaults:
            raise ValueError("dp_group was replaced by shard_groups=[(params, group)]; gradients are now "
                             "SUMMED over the group (pass grad_scale to step() to normalise)")
        if zero not in (0, 1):
            raise ValueError(f"zero={zero!r}: use 0 (replicated optimizer state) or 1 (sharded over each "
                             "shard group, ZeRO-1)")
        if not master_dtype.is_floating_point:
            raise ValueError(f"master_dtype={master_dtype} must be a floating-point dtype (float32 or float64)")
        seen = set()
        for p in params:
            if id(p) in seen:
                raise ValueError(f"{name(p)} appears twice in params_or_param_groups: pass each parameter once")
            seen.add(id(p))
            if hasattr(p, "main_grad"):
                raise ValueError(f"{name(p)} already belongs to a MixedPrecisionOptimizer (it has a main_grad "
                                 "and a gradient hook): build one optimizer per parameter")
            if not p.dtype.is_floating_point:
                raise ValueError(f"{name(p)} is not floating point: only floating-point parameters train")
            narrower = master_dtype != p.dtype and torch.finfo(master_dtype).bits <= torch.finfo(p.dtype).bits
            if narrower:
                raise ValueError(f"master_dtype={master_dtype} is narrower than {name(p)}: use master_dtype="
                                 f"{p.dtype} or wider (a master must hold its parameter exactly)")
        entries, owner = [], {}
        for k, (entry_params, group) in enumerate(shard_groups or []):
            entry_params = [p for p in ([entry_params] if torch.is_tensor(entry_params) else entry_params)
                            if p.requires_grad]
            for p in entry_params:
                if id(p) not in seen:
                    raise ValueError(f"shard_groups[{k}] holds a parameter (shape {tuple(p.shape)}) that is not in "
                                     "params_or_param_groups: every sharded parameter must be optimised")
                if id(p) in owner:
                    raise ValueError(f"{name(p)} is in shard_groups[{owner[id(p)]}] and shard_groups[{k}]: a "
                                     "parameter's gradient is reduced over one group only")
                owner[id(p)] = k
            if group is not None and dist.get_rank(group) < 0:
                raise ValueError(f"shard_groups[{k}]: this rank is not a member of the group; pass the group "
                                 "that contains this rank (or None)")
            entries.append((entry_params, group))
        unassigned = [p for p in params if id(p) not in owner]
        if unassigned:
            entries.append((unassigned, None))  # no data-parallel communication
        return entries

    def _piece(self, p):
        bucket, i = self._where[id(p)]
        return bucket.pieces[i]

    def _managed(self, p, caller):
        """(bucket, piece) of one of this optimizer's parameters; any other tensor is refused here, before the
        all-reduces of full_state (a KeyError on one rank would leave the others waiting in them)."""
        if id(p) not in self._where:
            raise ValueError(f"{caller}: a parameter (shape {tuple(p.shape)}) is not managed by this optimizer; "
                             "pass one of the parameters it was built over")
        bucket, i = self._where[id(p)]
        return bucket, bucket.pieces[i]

    @property
    def param_groups(self):
        """The inner optimizer's groups (same order and options as given): set the learning rate here."""
        return self.optimizer.param_groups

    # ---- the step ----

    def _fold_stray_grads(self):
        """A gradient written to p.grad directly, not by backward (which the hooks catch), joins the sum: added
        to the main grad of a narrower parameter (whose p.grad holds only what came since the last hook),
        copied into that of a parameter in the master dtype (whose p.grad is the whole gradient)."""
        for p in self.params:
            if p.dtype == self.master_dtype:
                _adopt_grad(p)
            elif p.grad is not None:
                _accumulate_main_grad(p)

    def all_reduce_grads(self, params, group):
        """SUM the main grads of `params` over `group` in one flat all-reduce (None or size 1: nothing). For
        gradients that need a sum outside the shard groups: the tied embedding over the embedding group, the
        parameters replicated across TP under sequence parallelism over the TP group. Call before step()."""
        params = list(params)
        for p in params:
            self._managed(p, "all_reduce_grads")
        group_size = _group_size(group, "all_reduce_grads' group")
        self._fold_stray_grads()
        if group_size == 1 or not params:
            return
        flat = torch.cat([p.main_grad.reshape(-1) for p in params])
        dist.all_reduce(flat, group=group)
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.main_grad.copy_(g.view(p.shape))

    def step(self, grad_scale=1.0, max_norm=0.0, norm_group=None, norm_params=None):
        """Reduce, scale, measure, clip, update. Returns StepResult(stepped, grad_norm), true if stepped.

        1. every shard-group entry's main grads are SUMMED over its group (all-reduce, or reduce-scatter
           under zero=1);
        2. multiplied by grad_scale / loss_scale (one multiply; loss_scale = 1 without a loss scaler);
        3. the global gradient norm, in master_dtype, over the gradients this rank owns (its shard under
           zero=1; under zero=0 only group rank 0 of each entry counts the replicated reduced gradient),
           restricted to `norm_params` (None: all; the caller leaves out copies that another rank already
           counts: TP-replicated parameters, the tied embedding's second copy). The sums of squares are
           all-reduced (SUM) over `norm_group` (None: no communication). That same 2-element all-reduce
           carries the loss scaler's overflow probe (the sum of squares of every owned gradient, counted or
           not): found_inf = the reduced probe is not finite. So the overflow check costs no extra
           collective, and there is one host sync per step. (A finite gradient whose squares overflow the
           master dtype, a norm above 1.8e19 in FP32, also counts as an overflow.) norm_group must contain
           every shard group when clipping or a loss scaler acts on the norm, or ranks would disagree
           (a norm_group of None with a shard group of several ranks is refused); without either, a norm_group of
           None returns this rank's part of the norm.
           Without a loss scaler, a non-finite norm is returned and the step is taken, as torch would.
        4. with a loss scaler: scaler.update(found_inf); on overflow the grads are zeroed and the step is
           skipped, on every rank of norm_group alike, since they all see the same reduced value;
        5. clipping when max_norm > 0: grads *= min(1, max_norm / (norm + 1e-6)) (clip_grad_norm_'s rule);
        6. the inner optimizer steps the masters (or shards); the parameters are refreshed from them
           (zero=1: each rank writes its shard, then one all-gather per buffer);
        7. the main grads are zeroed.
        """
        counted = None if norm_params is None else {id(p) for p in norm_params}
        if counted is not None and not counted <= set(self._where):
            raise ValueError("norm_params holds a parameter that this optimizer does not manage")
        if not max_norm >= 0 or not math.isfinite(grad_scale):  # `not >=`: NaN fails it too
            raise ValueError(f"need max_norm >= 0 (0 disables clipping) and a finite grad_scale, got "
                             f"max_norm={max_norm}, grad_scale={grad_scale}")
        norm_group_size = _group_size(norm_group, "norm_group")
        if (max_norm > 0 or self.loss_scaler is not None) and norm_group_size == 1 and any(
                b.group_size > 1 for b in self._buckets):
            raise ValueError("norm_group is None but gradients are reduced over groups of more than one rank: "
                             "each rank then holds only part of the norm, and clipping or skipping would differ "
                             "between ranks; pass a norm_group that contains every shard group (the world)")
        if (max_norm > 0 or self.loss_scaler is not None) and norm_group_size > 1:
            self._check_norm_group_covers_shards(norm_group)
        self._fold_stray_grads()
        for bucket in self._buckets:
            bucket.reduce_grads()
        scale = grad_scale / (self.loss_scaler.scale if self.loss_scaler is not None else 1.0)
        if scale != 1.0:
            for bucket in self._buckets:
                bucket.owned_grads().mul_(scale)
        norm, found_inf = self._global_norm(counted, norm_group)
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf)
            if found_inf:
                self.zero_grad()
                return StepResult(False, norm)
        if max_norm > 0:
            clip = max_norm / (norm + 1e-6)
            if clip < 1.0:
                for bucket in self._buckets:
                    bucket.owned_grads().mul_(clip)
        self.optimizer.step()
        for bucket in self._buckets:
            bucket.publish_params()
        self.zero_grad()
        return StepResult(True, norm)

    def _check_norm_group_covers_shards(self, norm_group):
        """Every shard group's ranks in norm_group (rank lists, no communication): a norm summed over a part of
        a shard group misses the other ranks' shards, and the ranks of that group clip or skip differently.
        Groups never change: a norm_group found to cover them once is not checked again at the next step."""
        if norm_group is getattr(self, "_covering_norm_group", None):
            return
        covered = set(dist.get_process_group_ranks(norm_group))
        for bucket in self._buckets:
            if bucket.group_size > 1 and not set(dist.get_process_group_ranks(bucket.group)) <= covered:
                raise ValueError(f"norm_group holds ranks {sorted(covered)}, which miss part of a shard group "
                                 f"({sorted(dist.get_process_group_ranks(bucket.group))}): pass a norm_group that "
                                 "contains every shard group (the world)")
        self._covering_norm_group = norm_group

    def _global_norm(self, counted, norm_group):
        """(norm, found_inf) from one all-reduce of [sum of squares counted, sum of squares owned]."""
        device = self._buckets[0].grad_flat.device
        sums = torch.zeros(2, dtype=self.master_dtype, device=device)
        for bucket in self._buckets:
            owned = bucket.owned_grads()
            owned_sq = torch.dot(owned, owned).to(device)
            sums[1] += owned_sq
            if not bucket.counts_in_norm():
                continue
            if counted is None:
                sums[0] += owned_sq
            else:
                for p, piece in zip(bucket.params, bucket.pieces):
                    if id(p) in counted:
                        g = piece.grad.reshape(-1)
                        sums[0] += torch.dot(g, g).to(device)
        if _group_size(norm_group) > 1:
            dist.all_reduce(sums, group=norm_group)
        counted_sq, owned_sq = sums.tolist()  # the one host sync of the step
        return math.sqrt(counted_sq), not math.isfinite(owned_sq)

    def zero_grad(self):
        for bucket in self._buckets:
            bucket.grad_flat.zero_()
        for p in self.params:
            p.grad = p.main_grad if p.dtype == self.master_dtype else None

    # ---- memory ----

    def memory_bytes(self):
        """This rank's bytes, from the live tensors: the parameter buffers, the main-grad buffers, and the
        separate master copies plus every optimizer state tensor with dim > 0 (Adam's moments; the 0-dim
        step counters are not per-parameter). master_bytes is the masters' part of optimizer_bytes."""
        size = lambda ts: sum(t.numel() * t.element_size() for t in ts)
        masters = size(b.master_flat for b in self._buckets if b.separate_master)
        states = size(t for s in self.optimizer.state.values() for t in s.values()
                      if torch.is_tensor(t) and t.dim() > 0)
        return {"param_bytes": size(b.param_flat for b in self._buckets),
                "grad_bytes": size(b.grad_flat for b in self._buckets),
                "optimizer_bytes": masters + states, "master_bytes": masters}

    # ---- checkpoints ----

    def full_state(self, p):
        """{"master": p's master weight, then every optimizer state (exp_avg, exp_avg_sq, step, ...)}, each a
        FULL tensor of p's shape (0-dim states as they are), in master/state dtype. Under zero=1 the pieces
        are gathered over p's shard group (an all-reduce SUM of zero-filled full tensors, each element owned
        by exactly one rank, so exact): every rank of the group calls it for the same params in order."""
        bucket, piece = self._managed(p, "full_state")
        full = {"master": self._gather(bucket, piece, piece.range, p)}
        state = self.optimizer.state.get(piece, {})
        for key in sorted(state):  # the same keys in the same order on every rank: the pieces step alike
            value = state[key]
            if torch.is_tensor(value):
                full[key] = value.detach().clone() if value.dim() == 0 else \
                    self._gather(bucket, value, piece.range, p)
        return full

    @staticmethod
    def _gather(bucket, local, piece_range, p):
        if not bucket.sharded:
            return local.detach().reshape(p.shape).clone()
        a, b = piece_range
        full = torch.zeros(p.numel(), dtype=local.dtype, device=local.device)
        full[a:b] = local.detach().reshape(-1)
        dist.all_reduce(full, group=bucket.group)
        return full.view(p.shape)

    def load_full_state(self, p, state):
        """Inverse of full_state, whatever the layout that saved it: p takes the master rounded to its dtype,
        this rank keeps the piece of the master and of every state tensor in its shard, in the piece's dtype
        and device (a checkpoint saved with another master dtype loads: the inner optimizer wants its states
        in the dtype of its parameters). No communication."""
        _, piece = self._managed(p, "load_full_state")
        a, b = piece.range
        cut = lambda t: t.detach().reshape(-1)[a:b].reshape(piece.shape).to(piece.device, piece.dtype, copy=True)
        with torch.no_grad():
            p.copy_(state["master"].reshape(p.shape))
            piece.copy_(cut(state["master"]))
        # 0-dim states (Adam's step) stay where they were saved: torch keeps them on the CPU unless the
        # optimizer is fused or capturable
        self.optimizer.state[piece] = {k: (v.detach().clone() if v.dim() == 0 else cut(v))
                                       for k, v in state.items() if k != "master"}

    def owned_state(self, p, like=None):
        """This rank's piece of p's master weight and optimizer states: the live tensors themselves, no copy and
        no communication. Returns ((a, b), {"master": ..., "exp_avg": ..., "step": ...}): every tensor that is
        not 0-dim holds the elements [a, b) of p.view(-1), in order (zero=0: all of p, in p's shape; zero=1: a
        1-D piece, possibly empty). A sharded checkpoint writes these from where they lie, so saving gathers
        nothing (full_state would hold the whole of every parameter's state at once: 12 bytes per parameter for
        Adam, what ZeRO-1 saved); loading writes into them in place. `like`, {state name: (ndim, dtype)}, creates the
        states missing before the first step, zero-filled: 0-dim ones in that dtype on the CPU, as torch.optim
        keeps them, the others like the piece (in the master dtype, whatever a checkpoint saved them in)."""
        _, piece = self._managed(p, "owned_state")
        state = self.optimizer.state[piece]
        for key, (ndim, dtype) in (like or {}).items():
            if key not in state and key != "master":
                state[key] = torch.zeros((), dtype=dtype) if ndim == 0 else torch.zeros_like(piece)
        owned = {"master": piece}
        owned.update((key, state[key]) for key in sorted(state) if torch.is_tensor(state[key]))
        return piece.range, owned

    def scalar_state(self):
        """The non-tensor part: hyperparameters of each group, the loss scaler (the tensors: full_state)."""
        return {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict()}

    def state_dict(self):
        """Everything, unsharded: the scalar state and every parameter's full_state, in parameter order
        (collective under zero=1: every rank of each shard group calls it)."""
        return {"scalars": self.scalar_state(), "params": [self.full_state(p) for p in self.params]}

    def load_state_dict(self, state):
        """Inverse of state_dict, at any zero setting and shard-group size. Everything is checked before
        anything is overwritten, so a refused state leaves the optimizer and the model as they were."""
        if len(state["params"]) != len(self.params):
            raise ValueError(f"state_dict holds {len(state['params'])} parameters, this optimizer "
                             f"{len(self.params)}: build it over the same parameters")
        for i, (p, full) in enumerate(zip(self.params, state["params"])):
            # the states may differ between param groups (momentum or amsgrad in one group only): only the
            # master is required, and every state tensor must match its parameter
            if "master" not in full:
                raise ValueError(f"state_dict's parameter {i} holds {sorted(full)} but no 'master': pass a "
                                 "state_dict written by MixedPrecisionOptimizer.state_dict")
            for key, value in full.items():
                if value.dim() > 0 and value.numel() != p.numel():
                    raise ValueError(f"state_dict's parameter {i} has {value.numel()} elements in {key!r}, this "
                                     f"optimizer's {p.numel()} (shape {tuple(p.shape)}): build it over the same "
                                     "parameters")
        self._check_param_groups(state["scalars"])
        if self.loss_scaler is not None and state["scalars"]["loss_scaler"] is not None:
            DynamicLossScaler().load_state_dict(state["scalars"]["loss_scaler"])  # checked on a throwaway
        for p, full in zip(self.params, state["params"]):
            self.load_full_state(p, full)
        self.load_scalar_state(state["scalars"])

    def _check_param_groups(self, state):
        if len(state["param_groups"]) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(state['param_groups'])} param groups, this optimizer "
                             f"{len(self.param_groups)}: build it with the same groups")

    def load_scalar_state(self, state):
        self._check_param_groups(state)
        for group, saved in zip(self.param_groups, state["param_groups"]):
            group.update(saved)
        if self.loss_scaler is not None and state["loss_scaler"] is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])


# ----------------------------------------------------------------------------------------------------
# FP8: per-tensor scaling, a linear layer with an FP8 forward and a BF16 backward
# ----------------------------------------------------------------------------------------------------

AMAX_EPS = 1e-12  # an all-zero tensor gets a finite scale (fp8_max / 1e-12 is far below FP32's max)

fp8_log = Counter()  # "gemm:count": FP8 forward GEMMs run; "gemm:scaled_mm" / "gemm:emulated": which path;
#                      "amax:all_reduce": amax agreements over a group. The trainer's tests read it.


def fp8_scale(amax, dtype=torch.float8_e4m3fn):
    return torch.finfo(dtype).max / torch.clamp(amax.float(), min=AMAX_EPS)


def quantize_fp8(x, dtype=torch.float8_e4m3fn, scale=None):
    """Per-tensor scaling: returns (x_fp8, scale) with x ~= x_fp8.float() / scale.

    scale defaults to the dynamic fp8_max / amax(x); a given scale (delayed scaling) may push values past
    the format's range, and they saturate at +-max rather than becoming inf or NaN.
    """
    if scale is None:
        scale = fp8_scale(amax_of(x), dtype)
    fp8_max = torch.finfo(dtype).max
    # one FP32 staging copy, scaled and clamped in place: 4 + 1 bytes per element alive at once, not 4 + 4
    # (an explicit copy, since .float() of an FP32 tensor is the tensor itself)
    x_fp8 = x.to(torch.float32, copy=True).mul_(scale).clamp_(-fp8_max, fp8_max).to(dtype)
    return x_fp8, scale


def dequantize_fp8(x_fp8, scale):
    return x_fp8.float() / scale


def amax_of(t):
    """max |t| in FP32; 0 for an empty tensor (an expert that received no token still joins the all-reduce)."""
    t = t.detach()
    return t.abs().max().float() if t.numel() else torch.zeros((), device=t.device)


def agreed_amax(x, weight, amax_group=None):
    """[amax(x), amax(weight)], MAX-reduced over amax_group in one all-reduce of 2 elements.

    A per-tensor scale belongs to the whole tensor: when a weight is split over the TP ranks (column- or
    row-parallel), or a row-parallel input is split along its last dimension, every rank must quantise its
    shard with the scale of the full tensor, or the shards are rounded on different grids and the layer
    is no longer the same function as on one GPU. The MAX of the shards' amaxes is the full tensor's amax.
    For a tensor that is replicated over the group the reduction changes nothing."""
    group_size = _group_size(amax_group, "amax_group")
    amax = torch.stack([amax_of(x), amax_of(weight)])
    if group_size > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=amax_group)
        fp8_log["amax:all_reduce"] += 1
    return amax


_SCALED_MM_ON_CPU = None


def scaled_mm_available(device):
    """torch._scaled_mm needs FP8 tensor cores (compute capability 8.9+) on CUDA; on CPU, probe once."""
    global _SCALED_MM_ON_CPU
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    if device.type == "cpu":
        if _SCALED_MM_ON_CPU is None:
            try:
                a = torch.ones(16, 16).to(torch.float8_e4m3fn)
                one = torch.tensor(1.0)
                torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
                _SCALED_MM_ON_CPU = True
            except (RuntimeError, NotImplementedError):
                _SCALED_MM_ON_CPU = False
        return _SCALED_MM_ON_CPU
    return False


def fp8_matmul(a_fp8, a_scale, b_fp8, b_scale, out_dtype, use_scaled_mm=True):
    """(a / a_scale) @ (b / b_scale)^T with FP32 accumulation. b is (out, in) row-major, so b.t() is the
    column-major operand that _scaled_mm wants (which also needs every dimension a multiple of 16). The
    emulation is the same arithmetic: FP8 values are exact in FP32, products are accumulated in FP32 and
    scaled once."""
    inv_a, inv_b = a_scale.reciprocal().float(), b_scale.reciprocal().float()
    shapes_ok = a_fp8.shape[0] % 16 == 0 and a_fp8.shape[1] % 16 == 0 and b_fp8.shape[0] % 16 == 0
    if use_scaled_mm and shapes_ok and scaled_mm_available(a_fp8.device):
        fp8_log["gemm:scaled_mm"] += 1
        return torch._scaled_mm(a_fp8, b_fp8.t(), scale_a=inv_a, scale_b=inv_b, out_dtype=out_dtype)
    fp8_log["gemm:emulated"] += 1
    return ((a_fp8.float() @ b_fp8.float().t()) * (inv_a * inv_b)).to(out_dtype)


class _FP8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, x_scale, w_scale, use_scaled_mm):
        ctx.save_for_backward(x, weight)  # high precision: the backward does not see the FP8 rounding
        x2 = x.reshape(-1, x.shape[-1])
        x_fp8, _ = quantize_fp8(x2, scale=x_scale)
        w_fp8, _ = quantize_fp8(weight, scale=w_scale)
        y = fp8_matmul(x_fp8, x_scale, w_fp8, w_scale, x.dtype, use_scaled_mm)
        fp8_log["gemm:count"] += 1
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        g = grad_out.reshape(-1, weight.shape[0]).to(torch.bfloat16)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ weight.to(torch.bfloat16)).reshape(x.shape).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (g.t() @ x.reshape(-1, x.shape[-1]).to(torch.bfloat16)).to(weight.dtype)
        return grad_x, grad_w, None, None, None


def fp8_linear(x, weight, bias=None, amax_group=None, use_scaled_mm=True):
    """y = x @ weight^T + bias with the GEMM in FP8 E4M3 under per-tensor dynamic scaling and a BF16
    backward. x has any leading shape. The amaxes of x and weight are MAX-reduced over amax_group first
    (one 2-element all-reduce; see agreed_amax): pass the TP group for a TP-sharded weight or input."""
    amax = agreed_amax(x, weight, amax_group)
    y = _FP8LinearFunction.apply(x, weight, fp8_scale(amax[0]), fp8_scale(amax[1]), use_scaled_mm)
    return y if bias is None else y + bias.to(y.dtype)


class FP8Linear(nn.Module):
    """nn.Linear whose forward GEMM runs in FP8 E4M3 with per-tensor scales; backward in BF16.

    amax_group: the group whose ranks hold shards of this weight or of its input (see agreed_amax).
    delayed_scaling=True takes each scale from the largest amax of the last `amax_history_len` steps
    (Transformer Engine's recipe) instead of the current tensor; the history records the agreed amax, so it
    is identical on every rank of amax_group. Every training forward records one entry, so do not use it
    under activation checkpointing: the recomputed forward records a second entry and quantises with a scale
    from the changed history, not the one the forward used (Transformer Engine keeps the forward's scales for
    its recompute; this layer does not). Current scaling (the default) recomputes identically."""

    def __init__(self, in_features, out_features, bias=True, delayed_scaling=False, amax_history_len=16,
                 use_scaled_mm=True, amax_group=None, device=None, dtype=None):
        super().__init__()
        if not isinstance(amax_history_len, numbers.Integral) or amax_history_len < 1:
            raise ValueError(f"amax_history_len={amax_history_len!r} must be an int >= 1 (the steps whose amaxes "
                             "delayed scaling takes the max of; 16 is usual)")
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.delayed_scaling, self.use_scaled_mm, self.amax_group = delayed_scaling, use_scaled_mm, amax_group
        self.register_buffer("amax_history", torch.zeros(2, amax_history_len, device=device))  # input, weight
        self.reset_parameters()

    def reset_parameters(self):
        ref = nn.Linear(self.weight.shape[1], self.weight.shape[0], bias=self.bias is not None)
        with torch.no_grad():  # the same initialisation as nn.Linear
            self.weight.copy_(ref.weight)
            if self.bias is not None:
                self.bias.copy_(ref.bias)

    def forward(self, x):
        if not self.delayed_scaling:
            return fp8_linear(x, self.weight, self.bias, self.amax_group, self.use_scaled_mm)
        amax = agreed_amax(x, self.weight, self.amax_group)
        history = self.amax_history.max(dim=1).values
        # first step: no history yet, fall back to the current amax (torch.where: no host sync)
        scales = fp8_scale(torch.where(history > 0, history, amax))
        if self.training:
            self.amax_history.copy_(torch.roll(self.amax_history, 1, dims=1))
            self.amax_history[:, 0] = amax
        y = _FP8LinearFunction.apply(x, self.weight, scales[0], scales[1], self.use_scaled_mm)
        return y if self.bias is None else y + self.bias.to(y.dtype)


# ----------------------------------------------------------------------------------------------------
# Memory accounting: bytes per parameter, by formula and measured on live tensors
# ----------------------------------------------------------------------------------------------------

# The persistent bytes; Adam's two moments are kept in the master dtype. The transient copies made inside
# forward and backward do not scale with the parameter count alike in every mode: transient_bytes.
BYTES_PER_PARAM = {
    "fp32":                    {"weights": 4, "grads": 4, "master": 0, "optimizer": 8},
    "bf16_autocast":           {"weights": 4, "grads": 4, "master": 0, "optimizer": 8},
    "bf16_master":             {"weights": 2, "grads": 4, "master": 4, "optimizer": 8},
    "bf16_master_16bit_grads": {"weights": 2, "grads": 2, "master": 4, "optimizer": 8},
    "fp16_master_scaler":      {"weights": 2, "grads": 4, "master": 4, "optimizer": 8},
    "fp8_compute":             {"weights": 2, "grads": 4, "master": 4, "optimizer": 8},
    "bf16_pure":               {"weights": 2, "grads": 2, "master": 0, "optimizer": 4},
}
MODE_NOTES = {
    "fp32": "no mixed precision",
    "bf16_autocast": "FP32 params, BF16 casts inside autocast",
    "bf16_master": "Megatron-LM: FP32 main grads, 2 + 4 + 12",
    "bf16_master_16bit_grads": "ZeRO paper 2 + 2 + 12 (formula only)",
    "fp16_master_scaler": "plus one FP32 scale",
    "fp8_compute": "FP8 copies of W and x per GEMM",
    "bf16_pure": "loses small updates",
}
FORMULA_ONLY = ("bf16_master_16bit_grads",)  # this file accumulates 16-bit gradients in FP32

# ZeRO-1 (Megatron-LM's distributed optimizer; Rajbhandari et al. 2020): per parameter, the unsharded part (parameters
# and main grads) and the part sharded over d ranks (FP32 master where separate, Adam's two moments)
ZERO_BYTES_PER_PARAM = {
    torch.float32: {"unsharded": 4 + 4, "sharded": 8},       # 16 -> 8 + 8/d
    torch.bfloat16: {"unsharded": 2 + 4, "sharded": 4 + 8},  # 18 -> 6 + 12/d
}


def persistent_bytes(mode):
    row = BYTES_PER_PARAM[mode]
    return row["weights"] + row["grads"] + row["master"] + row["optimizer"]


def zero_bytes_formula(dtype, d, zero=1):
    row = ZERO_BYTES_PER_PARAM[dtype]
    return row["unsharded"] + row["sharded"] / (d if zero == 1 else 1)


TRANSIENT_RULES = {
    "bf16_autocast": "2 x every parameter: autocast caches each BF16 cast until the region exits",
    "fp8_compute": "5 x the largest weight: FP32 staging (4) + FP8 copy (1), one GEMM at a time",
}


def transient_bytes(mode, model):
    """The most bytes of parameter copies alive at once during one forward and backward (formula).

    bf16_autocast: autocast casts every FP32 parameter (weights and biases) to BF16 and keeps each cast in
    its cache until the autocast region exits, so when the forward ends all of them are alive together:
    2 bytes per parameter. fp8_compute: each GEMM quantises its weight through one FP32 staging copy
    (4 bytes/element) into an FP8 copy (1 byte/element); both die when the GEMM returns (the backward uses
    the saved BF16 weight), so only one layer's copies are alive at a time, the largest weight's at the peak:
    5 bytes per element of the largest weight, not per parameter. Every other mode computes with the
    parameters as they are stored: 0."""
    if mode == "bf16_autocast":
        return 2 * sum(p.numel() for p in model.parameters())
    if mode == "fp8_compute":
        weights = [m.weight.numel() for m in model.modules() if isinstance(m, FP8Linear)]
        if not weights:
            raise ValueError("transient_bytes('fp8_compute', model): the model has no FP8Linear layer; build it "
                             "with linear=FP8Linear (as build() does)")
        return 5 * max(weights)
    return 0


class ParameterCopyTracker(TorchDispatchMode):
    """While active, the peak bytes of copies of the given parameters alive at once (`self.peak`).

    A copy is a new storage made from one parameter element for element: the output of an op whose tensor
    inputs are all parameters, copies or 0-dim tensors (a scale), at least one of them not 0-dim, and with
    that input's number of elements. Casts, scalings, clamps and FP8 casts qualify; a GEMM (it mixes in the
    activations) or a gradient does not, and views (t(), detach()) share their input's storage, so they add
    no bytes. A copy counts while its storage lives (a weak reference to the storage, so a copy held only
    by the autocast cache or saved for backward counts too). The sum is taken as each op returns, while its
    inputs are still referenced: the moment an op's inputs and its output coexist."""

    def __init__(self, params):
        super().__init__()
        self.sources = {p.untyped_storage().data_ptr() for p in params}
        self.copies = {}  # storage address -> (weak reference to the storage, its bytes)
        self.peak = 0

    def _from_parameter(self, t):
        address = t.untyped_storage().data_ptr()
        return address in self.sources or address in self.copies

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # forget the copies that died, before their addresses can be reused by other tensors
        self.copies = {a: c for a, c in self.copies.items() if not c[0].expired()}
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        sources = [t for t in inputs if t.dim() > 0 and self._from_parameter(t)]
        if (sources and isinstance(out, torch.Tensor) and out.numel() == sources[0].numel() > 0
                and all(t.dim() == 0 or self._from_parameter(t) for t in inputs)
                and not self._from_parameter(out)):
            storage = out.untyped_storage()
            self.copies[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, sum(nbytes for _, nbytes in self.copies.values()))
        return out


class MLP(nn.Module):
    def __init__(self, dim=32, hidden=64, depth=2, linear=nn.Linear, out=1):
        super().__init__()
        dims = [dim] + [hidden] * depth + [out]
        self.layers = nn.ModuleList(linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x


def build(mode, model_fn=MLP, lr=1e-3, seed=0):
    """Model and optimizer of one precision mode; returns (model, step_fn(x, y) -> (loss, stepped), opt)."""
    torch.manual_seed(seed)
    model = model_fn(linear=FP8Linear) if mode == "fp8_compute" else model_fn()
    dtype = {"bf16_master": torch.bfloat16, "bf16_pure": torch.bfloat16, "fp8_compute": torch.bfloat16,
             "fp16_master_scaler": torch.float16}.get(mode, torch.float32)
    model.to(dtype)
    scaler = DynamicLossScaler() if mode == "fp16_master_scaler" else None
    if mode in ("bf16_master", "fp8_compute", "fp16_master_scaler"):
        opt = MixedPrecisionOptimizer(model.parameters(), torch.optim.Adam, loss_scaler=scaler, lr=lr)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=lr)

    def step(x, y, take_step=True):
        if mode == "bf16_autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
        else:
            out = model(x.to(dtype))
        loss = F.mse_loss(out.float(), y)
        (scaler.scale_loss(loss) if scaler else loss).backward()
        if not take_step:
            return loss.item(), None
        stepped = opt.step().stepped if isinstance(opt, MixedPrecisionOptimizer) else opt.step()
        opt.zero_grad()
        return loss.item(), stepped

    return model, step, opt


def measure_bytes_per_parameter(mode, model_fn=MLP):
    """Bytes per parameter of the live tensors after a backward (gradients present, optimizer state built),
    and "transient": the peak bytes of parameter copies alive during that forward and backward (per
    parameter, like the rest; "transient_bytes" is the total, "transient_formula" its formula)."""
    model, step, opt = build(mode, model_fn)
    x, y = torch.randn(8, 32), torch.randn(8, 1)
    step(x, y)                    # one full step: the optimizer state now exists
    with ParameterCopyTracker(model.parameters()) as tracker:
        step(x, y, take_step=False)   # a forward and a backward: gradients are alive
    n = sum(p.numel() for p in model.parameters())
    transient = {"transient": tracker.peak / n, "transient_bytes": tracker.peak,
                 "transient_formula": transient_bytes(mode, model), "n_params": n}
    if isinstance(opt, MixedPrecisionOptimizer):
        m = opt.memory_bytes()
        return {"weights": m["param_bytes"] / n, "grads": m["grad_bytes"] / n, "master": m["master_bytes"] / n,
                "optimizer": (m["optimizer_bytes"] - m["master_bytes"]) / n, **transient}
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts)
    # Adam's state: exp_avg and exp_avg_sq per parameter; the 0-dim "step" counters are not per-parameter
    states = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    return {"weights": size(model.parameters()) / n,
            "grads": size(p.grad for p in model.parameters() if p.grad is not None) / n,
            "master": 0.0, "optimizer": size(states) / n, **transient}


def zero_bytes_per_parameter(dtype, zero, group=None, out=2):
    """This rank's bytes per parameter under ZeRO-`zero` over `group`, measured after one Adam step on the
    MLP. out=2 gives 6402 parameters, divisible by 2 and by 3: the flat buffers need no padding, so the
    figures are exactly the formula; other sizes add padding / n (reported)."""
    torch.manual_seed(0)
    model = MLP(out=out).to(dtype)
    opt = MixedPrecisionOptimizer(model.parameters(), torch.optim.Adam, shard_groups=[(model.parameters(), group)],
                                  zero=zero, lr=1e-3)
    model(torch.randn(8, 32).to(dtype)).float().pow(2).mean().backward()
    comm_bytes.clear()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    m = opt.memory_bytes()
    return {"n_params": n, "padding": sum(b.padding for b in opt._buckets), "bytes": m,
            "per_param": {k: v / n for k, v in m.items()}, "sent_per_param": sum(comm_bytes.values()) / n}


def zero_sent_formula(dtype, d, zero=1):
    """Bytes a rank sends per parameter and step: 2 (d-1)/d x 4 (an all-reduce of FP32 main grads), or with
    ZeRO-1 (d-1)/d x (4 + e) (a reduce-scatter of them and an all-gather of the e-byte parameters)."""
    e = torch.empty(0, dtype=dtype).element_size()
    return (d - 1) / d * (4 + e if zero == 1 else 8)


def accumulation_errors(m=16, seed=0):
    """m micro-batches of BF16 gradients of one BF16 linear layer, summed (a) into the optimizer's FP32 main
    grad by the hook and (b) in BF16 by autograd (the old behaviour). Returns the max abs error of each
    against the float64 sum of the same BF16 micro-batch gradients, relative to the sum's max abs value."""
    gen = torch.Generator().manual_seed(seed)
    fp32_layer, bf16_layer = nn.Linear(64, 64, bias=False).bfloat16(), nn.Linear(64, 64, bias=False).bfloat16()
    with torch.no_grad():
        fp32_layer.weight.copy_(torch.randn(64, 64, generator=gen))
        bf16_layer.weight.copy_(fp32_layer.weight)
    MixedPrecisionOptimizer(fp32_layer.parameters(), torch.optim.SGD, lr=0.1)  # gives the layer its main_grad
    exact = torch.zeros(64, 64, dtype=torch.float64)
    for _ in range(m):
        x, w = torch.randn(32, 64, generator=gen).bfloat16(), torch.randn(32, 64, generator=gen).bfloat16()
        g, = torch.autograd.grad((fp32_layer(x) * w).sum(), fp32_layer.weight)  # this micro-batch, BF16
        exact += g.double()
        (fp32_layer(x) * w).sum().backward()   # into the FP32 main grad
        (bf16_layer(x) * w).sum().backward()   # into a BF16 .grad: one BF16 rounding per micro-batch
    scale = exact.abs().max().item()
    return {"fp32_main_grad": (fp32_layer.weight.main_grad.double() - exact).abs().max().item() / scale,
            "bf16_grad": (bf16_layer.weight.grad.double() - exact).abs().max().item() / scale,
            "fp32_eps": torch.finfo(torch.float32).eps, "bf16_eps": torch.finfo(torch.bfloat16).eps, "m": m}


# ----------------------------------------------------------------------------------------------------
# The demo
# ----------------------------------------------------------------------------------------------------

def sqnr_db(x, x_hat):
    return 10 * math.log10((x.double() ** 2).sum().item() / ((x.double() - x_hat.double()) ** 2).sum().item())


def train_small_model(mode, steps=300, seed=0):
    """A 2-hidden-layer MLP regressing a fixed random teacher; returns the mean loss of the last 20 steps."""
    torch.manual_seed(123)
    teacher = MLP()
    model, step, _ = build(mode, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    losses, skipped = [], 0
    for _ in range(steps):
        x = torch.randn(64, 32, generator=gen)
        with torch.no_grad():
            y = teacher(x)
        loss, stepped = step(x, y)
        skipped += stepped is False
        losses.append(loss)
    return float(np.mean(losses[-20:])), skipped


def _rank_entry(fn, rank, world, store_path, queue, args):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        queue.put((rank, fn(*args, group=dist.group.WORLD)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # the parent must not wait forever for a rank that failed
        queue.put((rank, e))


def on_forked_ranks(fn, world, *args):
    """fn(*args, group=WORLD) on `world` forked gloo ranks of this machine; the results by rank."""
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        queue = ctx.SimpleQueue()
        procs = [ctx.Process(target=_rank_entry, args=(fn, r, world, os.path.join(tmp, "store"), queue, args))
                 for r in range(world)]
        for p in procs:
            p.start()
        results = dict(queue.get() for _ in procs)
        for p in procs:
            p.join()
    for r in range(world):
        if isinstance(results[r], BaseException):
            raise RuntimeError(f"rank {r} failed") from results[r]
    return [results[r] for r in range(world)]


def demo():
    print("== formats (from torch.finfo)")
    print(f"{'name':10s} {'bits':>4s} {'exp':>4s} {'mant':>4s} {'max':>10s} {'min normal':>11s} {'eps':>9s}  use")
    for r in dtype_table():
        print(f"{r['name']:10s} {r['bits']:4d} {r['exponent_bits']:4d} {r['mantissa_bits']:4d} {r['max']:10.4g} "
              f"{r['min_normal']:11.3g} {r['eps']:9.3g}  {r['use']}")

    print("\n== why master weights: a weight of 1.0 receives +1e-3 a hundred times")
    w_bf16, w_fp32 = torch.tensor(1.0, dtype=torch.bfloat16), torch.tensor(1.0, dtype=torch.float32)
    for _ in range(100):
        w_bf16 += 1e-3
        w_fp32 += 1e-3
    print(f"   BF16 weight: {w_bf16.item():.4f} (spacing at 1.0 is {torch.finfo(torch.bfloat16).eps}, the update "
          f"rounds away); FP32 master: {w_fp32.item():.4f}")

    e = accumulation_errors()
    print(f"\n== why FP32 main grads: {e['m']} micro-batches of BF16 gradients, error of the sum vs float64 "
          f"(relative to its max)")
    print(f"   summed in the FP32 main grad: {e['fp32_main_grad']:.2e} (FP32 eps {e['fp32_eps']:.1e}); "
          f"summed in BF16 .grad: {e['bf16_grad']:.2e} (BF16 eps {e['bf16_eps']:.1e})")

    print("\n== FP16 underflow and loss scaling: 1e5 gradients log-uniform in [1e-10, 1e-2]")
    g = torch.exp(torch.empty(100_000).uniform_(math.log(1e-10), math.log(1e-2)))
    lost = (g.half() == 0).float().mean().item()
    scale = 2.0 ** 16
    rescued = ((g * scale).half().float() / scale)
    lost_scaled = (rescued == 0).float().mean().item()
    print(f"   flushed to zero in FP16: {lost:.1%} unscaled, {lost_scaled:.1%} with the loss scaled by 2^16 "
          f"(FP16 min subnormal {torch.finfo(torch.float16).smallest_normal * torch.finfo(torch.float16).eps:.2e})")

    print("\n== FP8 quantisation error, per-tensor dynamic scaling, 1e6 Gaussian values")
    x = torch.randn(1_000_000)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        q, s = quantize_fp8(x, dtype)
        print(f"   {str(dtype):22s} SQNR {sqnr_db(x, dequantize_fp8(q, s)):5.1f} dB; max relative error of "
              f"normal values <= eps/2 = {torch.finfo(dtype).eps / 2}")
    print(f"   torch._scaled_mm on this CPU: {scaled_mm_available(torch.device('cpu'))}")

    print("\n== a small MLP trained 300 steps with Adam (final loss = mean of the last 20 steps)")
    for mode in ("fp32", "bf16_autocast", "bf16_master", "fp16_master_scaler", "fp8_compute", "bf16_pure"):
        loss, skipped = train_small_model(mode)
        print(f"   {mode:20s} loss {loss:.5f}" + (f"  ({skipped} steps skipped by the loss scaler)" if skipped else ""))
    print(f"   FP8 forward GEMMs run: {fp8_log['gemm:count']} "
          f"(torch._scaled_mm {fp8_log['gemm:scaled_mm']}, emulated {fp8_log['gemm:emulated']})")

    print("\n== bytes per parameter with Adam: formula | measured on the live tensors of the MLP; transient: the")
    print("   peak bytes of parameter copies alive at once in one forward and backward, formula | measured")
    print(f"   {'mode':24s} {'weights':>8s} {'grads':>6s} {'master':>7s} {'adam':>5s} {'total':>6s} "
          f"| {'measured':>8s} | {'transient':>9s} | {'measured':>8s}  note")
    for mode, row in BYTES_PER_PARAM.items():
        measured = transient = transient_measured = ""
        if mode not in FORMULA_ONLY:
            m = measure_bytes_per_parameter(mode)
            measured = f"{m['weights'] + m['grads'] + m['master'] + m['optimizer']:8.1f}"
            transient = f"{m['transient_formula'] / m['n_params']:9.3f}"
            transient_measured = f"{m['transient']:8.3f}"
        print(f"   {mode:24s} {row['weights']:8d} {row['grads']:6d} {row['master']:7d} {row['optimizer']:5d} "
              f"{persistent_bytes(mode):6d} | {measured:>8s} | {transient:>9s} | {transient_measured:>8s}  "
              f"{MODE_NOTES[mode]}")
    largest = max(layer.weight.numel() for layer in MLP().layers)
    print(f"   ({m['n_params']} parameters, the largest weight {largest}; transient per parameter = rule / "
          f"{m['n_params']})")
    for mode, rule in TRANSIENT_RULES.items():
        print(f"   transient of {mode}: {rule}")

    print("\n== ZeRO-1 (distributed optimizer): bytes per parameter on each of d forked gloo ranks, Adam; sent: the")
    print("   bytes a rank sends per parameter in one step's gradient and parameter collectives (ring algorithms)")
    print(f"   {'params':6s} {'zero':>4s} {'d':>2s} {'formula':>9s} {'=':>6s} | {'measured':>8s} = {'params':>6s} + "
          f"{'grads':>5s} + {'optimizer':>9s}  padding | {'sent':>4s} formula")
    for dtype, name, form in ((torch.float32, "fp32", "8 + 8/d"), (torch.bfloat16, "bf16", "6 + 12/d")):
        for zero, d in ((0, 2), (1, 2), (1, 3)):
            r = on_forked_ranks(zero_bytes_per_parameter, d, dtype, zero)[0]  # rank 0's figures
            b = r["per_param"]
            total = b["param_bytes"] + b["grad_bytes"] + b["optimizer_bytes"]
            label = form if zero else str(round(zero_bytes_formula(dtype, d, 0)))
            print(f"   {name:6s} {zero:4d} {d:2d} {label:>9s} {zero_bytes_formula(dtype, d, zero):6.2f} | "
                  f"{total:8.2f} = {b['param_bytes']:6.2f} + {b['grad_bytes']:5.2f} + {b['optimizer_bytes']:9.2f}"
                  f"  {r['padding']:7d} | {r['sent_per_param']:4.2f} {zero_sent_formula(dtype, d, zero):7.2f}")
    print(f"   ({r['n_params']} parameters, divisible by 2 and 3: no padding; other sizes pad each flat buffer "
          "to a multiple of d)")

if __name__ == "__main__":
    demo()
