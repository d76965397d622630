"""Mixed precision: number formats, BF16 with FP32 master weights and main grads, FP16 loss scaling, ZeRO-1, FP8.

A floating-point format spends its bits on an exponent (range) and a mantissa (precision). `dtype_table()`
reads every figure from torch.finfo (eps, the spacing at 1.0, is 2^-mantissa bits; rounding to nearest errs by
at most eps/2 of a normal value):

    format  bits  exp  mant  max      min normal  eps     used for
    FP32    32    8    23    3.4e38   1.2e-38     1.2e-7  master weights, main grads, optimizer states
    FP16    16    5    10    65504    6.1e-5      9.8e-4  legacy: a small range, needs loss scaling
    BF16    16    8    7     3.4e38   1.2e-38     7.8e-3  training: FP32's range, 8 significant bits
    E4M3    8     4    3     448      1.6e-2      0.125   FP8 forward (weights, activations)
    E5M2    8     5    2     57344    6.1e-5      0.25    FP8 gradients (range over precision)

BF16 compute, FP32 master weights. Forward and backward run on BF16 parameters (half the bytes, tensor-core
speed); the optimizer steps an FP32 copy of each. Near 1.0 BF16 values lie 2^-7 apart: an update of 1e-3 is
below half that spacing and rounds away, every step. The FP32 master accumulates the updates; the BF16 weight
is rounded from it after each step (`copy_masters_to_params`: the FP32 masters copied back to the 16-bit weights).

FP32 main grads. Over m micro-batches a BF16 .grad would round the running sum m times to 8 bits. Each
parameter gets a persistent FP32 `main_grad`, a view of one flat buffer per dtype and device (`_FlatBuffer`:
the whole buffer, not DDP's 25 MB buckets); a hook adds each backward's p.grad into it and frees p.grad. The
data-parallel SUM is one FP32 all-reduce per flat buffer. A parameter in the master dtype is its own master;
its .grad IS the main_grad view. Bytes per parameter, Adam:

    2 (BF16 weight) + 4 (FP32 main grad) + 4 (FP32 master) + 8 (two FP32 moments) = 18    (FP32 weights: 16)

ZeRO-1, Megatron-LM's distributed optimizer (zero=1): rank r of the d data-parallel ranks owns the r-th 1/d of
each flat buffer (padded to a multiple of d), and keeps masters and moments for it alone. The all-reduce becomes
a reduce-scatter (each rank receives the sum of its 1/d), each rank steps its 1/d, and an all-gather rebuilds
the 16-bit weights: the all-reduce's own two halves, so no byte more is sent. Per parameter: 6 + 12/d (FP32: 8 + 8/d).

One step of `MixedPrecisionOptimizer`: SUM each main-grad buffer over its group (ZeRO-1: reduce-scatter);
g *= grad_multiplier / loss_scale; ||g|| = sqrt(sum g^2) in one 2-element all-reduce that also carries the
overflow probe; skip on overflow; clip, g *= min(1, max_norm / (||g|| + 1e-6)); the inner optimizer steps the
masters; the copy back (ZeRO-1: then the all-gather); zero main grads.

FP16 loss scaling. FP16's smallest subnormal is 2^-24 = 6e-8: smaller gradients flush to zero. The loss is
multiplied by the loss scale S (2^16 to start), lifting every gradient by S; the FP32 main grads are divided by
S. An inf or NaN (also a norm past FP32's range, sum g^2 > 3.4e38: ||g|| > 1.8e19) means S was too large: every
rank skips the step and S *= 1/2; after growth_interval (2000) clean steps S *= 2 (`DynamicLossScaler`,
torch.amp.GradScaler's rule; `unscale_and_check` with a torch.optim).

FP8 with per-tensor scaling. E4M3 reaches only 448, so each tensor is scaled into range before the cast:

    scale = fp8_max / max(amax, eps),  amax = max |x|,  x_fp8 = clamp(x scale, +-fp8_max),  x ~= x_fp8 / scale

and a GEMM multiplies the FP8 operands exactly, accumulates in FP32 and divides by both scales, y = x W^T =
(x_fp8 W_fp8^T) / (s_x s_W) (torch._scaled_mm, or an emulation with the same arithmetic). Current scaling
("tensorwise") takes amax from the tensor itself, one extra pass. Delayed scaling (Transformer Engine) scales by
the largest amax of the last L steps, known before the tensor is seen (the current amax is still measured and
agreed, to join the history): an outlier beyond the history saturates, and a recomputed forward records its
amax twice (so not with full or sqrt recomputation; selective redoes no linear). Under
tensor parallelism the amaxes are MAX-reduced over the TP group, so every shard is rounded on the full tensor's
grid. `FP8Linear` computes its backward in BF16 from the saved high-precision tensors.
"""
import math
import numbers
from collections import Counter
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

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
        rows.append({"name": name, "dtype": str(dtype).replace("torch.", ""), "bits": fi.bits, "exponent_bits":
                     fi.bits - 1 - mantissa, "mantissa_bits": mantissa, "max": fi.max, "min_normal": fi.smallest_normal,
                     "min_subnormal": fi.smallest_normal * fi.eps, "eps": fi.eps, "use": use})
    return rows


def _group_size(group, name="group"):
    """1 for None (no communication); a group without this rank (size -1: it would leave the sum) is refused."""
    if group is None:
        return 1
    size = dist.get_world_size(group)
    if size < 0:
        raise ValueError(f"{name}: this rank is not a member of the group; pass a group that contains this rank "
                         "(or None for no communication)")
    return size


def _collective_device(group):
    """Where a tensor must live to take part in `group`'s collectives: this process's GPU under NCCL, else CPU."""
    if group is not None and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# Bytes this rank sends in the flat buffers' collectives, as a ring sends them: an all-reduce 2 (d-1)/d of its
# buffer, a reduce-scatter (d-1)/d of its input, an all-gather (d-1)/d of its output
comm_bytes = Counter()


def _count_sent(kind, tensor, d, factor):
    comm_bytes[kind] += factor * (d - 1) / d * tensor.numel() * tensor.element_size()


# ----------------------------------------------------------------------------------------------------
# FP16 dynamic loss scaling (the torch.amp.GradScaler algorithm)
# ----------------------------------------------------------------------------------------------------

class DynamicLossScaler:
    """Scale the loss up, unscale the gradients, skip the step and back off on inf/NaN, grow when clean. With a
    plain torch.optim optimizer: scale_loss(loss).backward(); if not unscale_and_check(params): opt.step();
    update(found_inf). MixedPrecisionOptimizer(loss_scaler=...) unscales its FP32 main grads itself."""

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self._set(init_scale, growth_factor, backoff_factor, growth_interval, growth_tracker=0)

    def _set(self, init_scale, growth_factor, backoff_factor, growth_interval, growth_tracker):
        """Check, then assign (a bad value changes nothing); a scale of 0 would step on NaN, an inf one skip all."""
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
        """Divide every gradient by the scale in place; True if any gradient anywhere in `group` is inf/NaN (each
        tensor is tested for non-finite values, so a large finite gradient never counts as an overflow)."""
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
        """Checked as the constructor checks: a corrupt checkpoint (a scale of 0 or inf) stops here."""
        self._set(state["scale"], state["growth_factor"], state["backoff_factor"], state["growth_interval"],
                  state["_growth_tracker"])


# ----------------------------------------------------------------------------------------------------
# The optimizer: FP32 main grads in flat buffers, one reduction, the norm, clipping, the step, the copy back
# ----------------------------------------------------------------------------------------------------

_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _accumulate_main_grad(p):
    """Gradient hook after autograd wrote p.grad: add it into the FP32 main grad, free p.grad (None: nothing)."""
    if p.grad is None:
        return
    with torch.no_grad():  # a gradient with a graph (create_graph=True) joins as a value
        p.main_grad.add_(p.grad.detach())
    p.grad = None


def _adopt_grad(p):
    """A master-dtype parameter whose p.grad replaced the main_grad view (create_graph=True, p.grad = g): that is
    the whole gradient, COPIED into main_grad (adding would count it twice); p.grad is the view again."""
    if p.grad is None or p.grad.data_ptr() == p.main_grad.data_ptr():  # None, or already the view
        return
    with torch.no_grad():
        p.main_grad.copy_(p.grad.detach())
    p.grad = p.main_grad


class _FlatBuffer:
    """The parameters of one dtype and device back to back, each tensor kind in one flat buffer (the whole
    buffer, not DDP's 25 MB buckets): p.data views `param_flat`, p.main_grad views `grad_flat` (master dtype),
    and `master_flat` holds the masters (param_flat itself when the dtypes agree).

    shard_states (ZeRO-1) over the group's k ranks: the buffers are padded to a multiple of k and this rank owns
    [lo, hi) = [r N/k, (r+1) N/k): masters and optimizer states exist for that range only. Otherwise [lo, hi)
    is the whole buffer. A "piece" is a parameter's part of [lo, hi): what the inner optimizer steps (its .grad
    a persistent view of the reduced main grads); unsharded, the whole parameter in its own shape."""

    def __init__(self, params, group, master_dtype, shard_states=False):
        self.params, self.group, self.master_dtype, self.shard_states = params, group, master_dtype, shard_states
        self.group_size = _group_size(group)
        self.group_rank = 0 if group is None else dist.get_rank(group)
        self.starts, self.padded, self.lo, self.hi = self._layout()
        dtype, device = params[0].dtype, params[0].device
        self.param_flat = torch.zeros(self.padded, dtype=dtype, device=device)
        with torch.no_grad():
            for p, start in zip(params, self.starts):
                view = self.param_flat[start:start + p.numel()].view(p.shape)
                view.copy_(p)
                p.data = view  # the same Parameter object: the model keeps working, now on the flat buffer
            self._make_main_grads()
            self.param_shard = self._owned_params()
            self.separate_master = dtype != master_dtype
            self.master_flat = self.param_shard.to(master_dtype) if self.separate_master else self.param_shard
        self.pieces = [self._piece(p, start) for p, start in zip(params, self.starts)]

    @property
    def sharded(self):  # states cut over more than one rank
        return self.shard_states and self.group_size > 1

    def _layout(self):  # overridden by ShardedOptimizer's buffers (the FP8 gather aligns parameters to 32)
        """(starts, N, lo, hi): the parameters back to back, N padded to a multiple of the shard count."""
        shards = self.group_size if self.shard_states else 1
        starts, numel = [], 0
        for p in self.params:
            starts.append(numel)
            numel += p.numel()
        padded = math.ceil(numel / shards) * shards
        lo = padded // shards * (self.group_rank if self.shard_states else 0)
        return starts, padded, lo, lo + padded // shards

    def _make_main_grads(self):  # overridden by ZeRO-2/3 units (ShardedOptimizer): a main-grad shard only
        self.grad_flat = torch.zeros(self.padded, dtype=self.master_dtype, device=self.param_flat.device)
        for p, start in zip(self.params, self.starts):
            p.main_grad = self.grad_flat[start:start + p.numel()].view(p.shape)
        self.grad_shard = self.grad_flat[self.lo:self.hi]

    def _owned_params(self):  # overridden by ZeRO-3 units (ShardedOptimizer): their own copy, the full one freed
        return self.param_flat[self.lo:self.hi]

    def _piece(self, p, start):
        a = min(max(start, self.lo), self.hi)  # [start, start + numel) within the shard
        b = min(max(start + p.numel(), self.lo), self.hi)
        piece, grad = self.master_flat[a - self.lo:b - self.lo], self.grad_shard[a - self.lo:b - self.lo]
        if not self.shard_states:  # whole parameters: keep their shapes (shape-aware optimizers work unsharded)
            piece, grad = piece.view(p.shape), grad.view(p.shape)
        piece.grad = grad  # a persistent view: the optimizer reads the reduced main grads in place
        piece.range = (a - start, b - start) if b > a else (0, 0)  # its elements of p.view(-1)
        piece.shard_range = (a - self.lo, b - self.lo)  # and of the shard buffers
        return piece

    def route_grads(self):
        """Where each gradient goes: a master-dtype parameter's .grad IS its main_grad view (autograd adds into it
        in place); a narrower one's p.grad is added into main_grad by the hook."""
        for p in self.params:
            if p.dtype == self.master_dtype:
                p.grad = p.main_grad
            else:
                p.register_post_accumulate_grad_hook(_accumulate_main_grad)

    def fold_stray_grads(self):
        """A p.grad written directly joins the main grad: added (narrower dtype), copied (the master dtype)."""
        for p in self.params:
            if p.dtype == self.master_dtype:
                _adopt_grad(p)
            elif p.grad is not None:
                _accumulate_main_grad(p)

    def groups(self):  # the groups this buffer's gradients are summed over
        return (self.group,)

    def counts_in_norm(self):
        """Sharded, each rank counts its own shard; unsharded, every rank holds the same reduced gradient and
        group rank 0 counts it."""
        return self.shard_states or self.group_rank == 0

    def reduce_grads(self):
        """At step: SUM the main grads over the group in one collective: an all-reduce of the whole buffer, or
        (ZeRO-1) a reduce-scatter, this rank receiving the sum of its shard."""
        if self.group_size == 1:
            return
        if self.shard_states:
            _count_sent("reduce_scatter", self.grad_flat, self.group_size, 1)
            _reduce_scatter_flat(self.grad_shard, self.grad_flat, group=self.group)
        else:
            _count_sent("all_reduce", self.grad_flat, self.group_size, 2)
            dist.all_reduce(self.grad_flat, group=self.group)

    def copy_masters_to_params(self):
        """The copy back: round the updated masters into this rank's parameters; ZeRO-1 then all-gathers the
        shards, so every rank holds every updated 16-bit weight."""
        with torch.no_grad():
            if self.separate_master:
                self.param_shard.copy_(self.master_flat)
            if self.sharded:
                _count_sent("all_gather", self.param_flat, self.group_size, 1)
                _all_gather_flat(self.param_flat, self.param_shard, group=self.group)

    def zero_grads(self):
        """Zero the main grads; a master-dtype parameter gets its main_grad view back as p.grad."""
        self.grad_buffer().zero_()
        for p in self.params:
            p.grad = p.main_grad if p.dtype == self.master_dtype else None

    def grad_buffer(self):  # the main-grad storage this rank keeps
        return self.grad_flat

    def param_buffers(self):  # the parameter storage this rank keeps at rest
        return [self.param_flat]


def _param_groups(params_or_param_groups):
    """The torch.optim param groups: a plain iterable of parameters is one group; frozen ones are left out."""
    items = list(params_or_param_groups)
    if not (items and isinstance(items[0], dict)):
        items = [{"params": items}]
    groups = [{**g, "params": [p for p in ([g["params"]] if torch.is_tensor(g["params"]) else g["params"])
                               if p.requires_grad]} for g in items]  # as torch.optim: params may be one tensor
    if not any(g["params"] for g in groups):
        raise ValueError("params_or_param_groups holds no parameter that requires grad: pass the model's "
                         "parameters (or a list of dicts with a 'params' key)")
    return groups


def _param_name(params, p):
    i = next(i for i, q in enumerate(params) if q is p)
    return f"parameter {i} (shape {tuple(p.shape)}, {p.dtype})"


class StepResult(NamedTuple):
    """What step() did: stepped (False: skipped on overflow; also the truth value) and the global grad norm."""
    stepped: bool
    grad_norm: float

    def __bool__(self):
        return self.stepped


class MixedPrecisionOptimizer:
    """Any torch.optim optimizer stepping FP32 masters, with FP32 main grads, the data-parallel SUM, clipping and
    loss scaling (the step in the module docstring):
        opt = MixedPrecisionOptimizer(params_or_param_groups, torch.optim.AdamW, shard_groups=[(params, dp_group)],
                                      zero=1, lr=3e-4, loss_scaler=DynamicLossScaler())  # FP16; None for BF16
        for micro_batch in ...: opt.loss_scaler.scale_loss(loss).backward()   # hooks add p.grad into p.main_grad
        opt.all_reduce_grads(tied_params, embedding_group)                     # sums outside the shard groups
        stepped, grad_norm = opt.step(grad_multiplier=1 / tokens, max_norm=1.0, norm_group=world)

    shard_groups: (params, group) entries, main grads SUMMED over the group (none: no communication; the caller
    normalises: grad_multiplier). zero=1 shards each entry's masters and optimizer states over its group (ZeRO-1).
    Build it once the model has its final dtype and device (parameters become views of flat buffers), one per
    parameter. Under zero=1 the inner optimizer sees 1-D pieces, so it must act elementwise (Adam, SGD)."""

    def __init__(self, params_or_param_groups, optimizer_class, *, shard_groups=None, zero=0, loss_scaler=None,
                 master_dtype=torch.float32, **optimizer_defaults):
        groups = _param_groups(params_or_param_groups)
        self.params = [p for g in groups for p in g["params"]]
        self.zero, self.master_dtype, self.loss_scaler = zero, master_dtype, loss_scaler
        self._check_zero_level()
        entries = self._check_arguments(shard_groups)
        # the inner optimizer's own checks (a bad lr, say) run on stand-ins, before any parameter is touched
        stand_ins = [{**{k: v for k, v in g.items() if k != "params"},
                      "params": [torch.zeros(1, dtype=master_dtype, requires_grad=True)]} for g in groups]
        try:
            optimizer_class(stand_ins, **optimizer_defaults)
        except TypeError as e:  # an unknown argument (misspelt, or meant for this class) reached the inner one
            raise ValueError(f"{optimizer_class.__name__} refused {sorted(optimizer_defaults)} ({e}): besides "
                             "the inner optimizer's options, pass only shard_groups=, zero=, loss_scaler= and "
                             "master_dtype=") from e
        self._buffers, self._where = [], {}  # id(param) -> (its flat buffer, index in the buffer)
        self._build_buffers(entries)
        for buffer in self._buffers:
            buffer.route_grads()
        self.optimizer = optimizer_class(
            [{**{k: v for k, v in g.items() if k != "params"}, "params": [self._piece(p) for p in g["params"]]}
             for g in groups], **optimizer_defaults)

    def _check_zero_level(self):  # ShardedOptimizer's takes 2 and 3 too
        if self.zero not in (0, 1):
            raise ValueError(f"zero={self.zero!r}: use 0 (replicated) or 1 (masters and optimizer states sharded "
                             "over each shard group: Megatron-LM's distributed optimizer)")

    def _check_arguments(self, shard_groups):
        """Refuses any impossible argument before any buffer or collective; returns the (params, group) entries."""
        params, master_dtype = self.params, self.master_dtype
        if not master_dtype.is_floating_point:
            raise ValueError(f"master_dtype={master_dtype} must be a floating-point dtype (float32 or float64)")
        seen = set()
        for p in params:
            if id(p) in seen:
                raise ValueError(f"{_param_name(params, p)} appears twice in params_or_param_groups: pass each "
                                 "parameter once")
            seen.add(id(p))
            if hasattr(p, "main_grad"):
                raise ValueError(f"{_param_name(params, p)} already belongs to a MixedPrecisionOptimizer (it has a "
                                 "main_grad): build one optimizer per parameter")
            if not p.dtype.is_floating_point:
                raise ValueError(f"{_param_name(params, p)} is not floating point: only floating-point parameters "
                                 "train")
            if master_dtype != p.dtype and torch.finfo(master_dtype).bits <= torch.finfo(p.dtype).bits:
                raise ValueError(f"master_dtype={master_dtype} is narrower than {_param_name(params, p)}: use "
                                 f"master_dtype={p.dtype} or wider (a master must hold its parameter exactly)")
        entries, owner = [], {}
        for k, entry in enumerate(shard_groups or []):
            if not isinstance(entry, (tuple, list)) or len(entry) != 2:
                raise ValueError(f"shard_groups[{k}] must be (params, group)")
            entry_params, group = entry
            entry_params = [p for p in ([entry_params] if torch.is_tensor(entry_params) else entry_params)
                            if p.requires_grad]
            for p in entry_params:
                if id(p) not in seen:
                    raise ValueError(f"shard_groups[{k}] holds a parameter (shape {tuple(p.shape)}) that is not in "
                                     "params_or_param_groups: every sharded parameter must be optimised")
                if id(p) in owner:
                    raise ValueError(f"{_param_name(params, p)} is in shard_groups[{owner[id(p)]}] and "
                                     f"shard_groups[{k}]: a parameter's gradient is reduced over one group only")
                owner[id(p)] = k
            if group is not None and dist.get_rank(group) < 0:
                raise ValueError(f"shard_groups[{k}]: this rank is not a member of the group; pass the group "
                                 "that contains this rank (or None)")
            entries.append((entry_params, group))
        unassigned = [p for p in params if id(p) not in owner]
        if unassigned:
            entries.append((unassigned, None))  # no data-parallel communication
        return entries

    def _add_buffers(self, params, make_buffer):
        """One flat buffer per (dtype, device) of `params`, in order of first appearance (a buffer has one dtype)."""
        by_kind = {}
        for p in params:
            by_kind.setdefault((p.dtype, p.device), []).append(p)
        made = [make_buffer(kind_params) for kind_params in by_kind.values()]
        for buffer in made:
            for i, p in enumerate(buffer.params):
                self._where[id(p)] = (buffer, i)
        self._buffers.extend(made)
        return made

    def _build_buffers(self, entries):
        for entry_params, group in entries:
            self._add_buffers(entry_params, lambda params, group=group: _FlatBuffer(
                params, group, self.master_dtype, shard_states=self.zero == 1))

    def _piece(self, p):  # what the inner optimizer steps for p
        buffer, i = self._where[id(p)]
        return buffer.pieces[i]

    def _managed(self, p, caller):
        """(buffer, piece) of one of this optimizer's parameters; any other tensor is refused here, before any
        collective (a KeyError on one rank would leave the others waiting in it)."""
        if id(p) not in self._where:
            raise ValueError(f"{caller}: a parameter (shape {tuple(p.shape)}) is not managed by this optimizer; "
                             "pass one of the parameters it was built over")
        buffer, i = self._where[id(p)]
        return buffer, buffer.pieces[i]

    @property
    def param_groups(self):
        """The inner optimizer's groups (same order and options as given): set the learning rate here."""
        return self.optimizer.param_groups

    def _fold_stray_grads(self):
        for buffer in self._buffers:
            buffer.fold_stray_grads()

    def _grad_holder(self, p):  # ShardedOptimizer: a ZeRO-2/3 unit parameter's reduced piece instead
        return p.main_grad

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
        holders = [self._grad_holder(p) for p in params]
        flat = torch.cat([h.reshape(-1) for h in holders])
        dist.all_reduce(flat, group=group)
        for h, g in zip(holders, flat.split([h.numel() for h in holders])):
            h.copy_(g.view(h.shape))

    def step(self, grad_multiplier=1.0, max_norm=0.0, norm_group=None, norm_params=None):
        """Reduce, scale, measure, clip, update, copy back; returns StepResult. grad_multiplier multiplies the summed
        gradients (the caller's normalisation, 1 / tokens, if the loss did not divide by it); the loss scale is
        divided out besides. norm_params: what the norm counts (None: all; leave out copies another rank counts).
        norm_group: every shard group, when clipping or scaling."""
        counted = None if norm_params is None else {id(p) for p in norm_params}
        if counted is not None and not counted <= set(self._where):
            raise ValueError("norm_params holds a parameter that this optimizer does not manage")
        if not max_norm >= 0 or not math.isfinite(grad_multiplier):  # `not >=`: NaN fails it too
            raise ValueError(f"need max_norm >= 0 (0 disables clipping) and a finite grad_multiplier, got "
                             f"max_norm={max_norm}, grad_multiplier={grad_multiplier}")
        norm_group_size = _group_size(norm_group, "norm_group")
        if max_norm > 0 or self.loss_scaler is not None:  # every rank must clip and skip alike
            self._check_norm_group_covers_shards(norm_group, norm_group_size)
        self._fold_stray_grads()
        for buffer in self._buffers:  # 1. SUM over the data-parallel group
            buffer.reduce_grads()
        multiplier = grad_multiplier / (self.loss_scaler.scale if self.loss_scaler is not None else 1.0)
        if multiplier != 1.0:  # 2. one multiply: the caller's normalisation and the loss scale's inverse
            for buffer in self._buffers:
                buffer.grad_shard.mul_(multiplier)
        norm, found_inf = self._global_norm(counted, norm_group)  # 3. one all-reduce: norm and overflow
        if self.loss_scaler is not None:  # 4. skip on overflow, on every rank alike
            self.loss_scaler.update(found_inf)
            if found_inf:
                self.zero_grad()
                return StepResult(False, norm)
        if max_norm > 0:  # 5. clip as clip_grad_norm_
            clip = max_norm / (norm + 1e-6)
            if clip < 1.0:
                for buffer in self._buffers:
                    buffer.grad_shard.mul_(clip)
        self.optimizer.step()  # 6. the inner optimizer steps the masters
        self.copy_masters_to_params()  # 7. the copy back
        self.zero_grad()
        return StepResult(True, norm)

    def copy_masters_to_params(self):
        """Copy the FP32 masters back to the 16-bit weights (step() ends with it; after loading masters in place,
        call it to rebuild the weights)."""
        for buffer in self._buffers:
            buffer.copy_masters_to_params()

    def _check_norm_group_covers_shards(self, norm_group, norm_group_size):
        """Every shard group's ranks in norm_group (rank lists, no communication; checked once per norm_group)."""
        if norm_group_size == 1 and any(_group_size(g) > 1 for b in self._buffers for g in b.groups()):
            raise ValueError("norm_group is None but gradients are reduced over groups of more than one rank: "
                             "each rank then holds only part of the norm, and clipping or skipping would differ "
                             "between ranks; pass a norm_group that contains every shard group (the world)")
        if norm_group_size == 1 or norm_group is getattr(self, "_covering_norm_group", None):
            return
        covered = set(dist.get_process_group_ranks(norm_group))
        for buffer in self._buffers:
            for group in buffer.groups():
                if _group_size(group) > 1 and not set(dist.get_process_group_ranks(group)) <= covered:
                    raise ValueError(f"norm_group holds ranks {sorted(covered)}, which miss part of a shard group "
                                     f"({sorted(dist.get_process_group_ranks(group))}): pass a norm_group that "
                                     "contains every shard group and replicate group (the world)")
        self._covering_norm_group = norm_group

    def _global_norm(self, counted, norm_group):
        """(norm, found_inf) from one all-reduce of [sum of squares counted, sum of squares owned]."""
        device = self._buffers[0].grad_shard.device
        sums = torch.zeros(2, dtype=self.master_dtype, device=device)
        for buffer in self._buffers:
            owned = buffer.grad_shard
            owned_sq = torch.dot(owned, owned).to(device)
            sums[1] += owned_sq
            if not buffer.counts_in_norm():
                continue
            if counted is None or all(id(p) in counted for p in buffer.params):
                sums[0] += owned_sq  # the whole buffer counts: no second pass over it, piece by piece
            else:
                for p, piece in zip(buffer.params, buffer.pieces):
                    if id(p) in counted:
                        g = piece.grad.reshape(-1)
                        sums[0] += torch.dot(g, g).to(device)
        if _group_size(norm_group) > 1:
            dist.all_reduce(sums, group=norm_group)
        counted_sq, owned_sq = sums.tolist()  # the one host sync of the step
        # the overflow probe: an inf or NaN anywhere makes the sum non-finite, and so does a finite sum of squares
        # past FP32's max 3.4e38 (FP32 masters), a gradient norm above ~1.8e19: skipped as an overflow too
        return math.sqrt(counted_sq), not math.isfinite(owned_sq)

    def zero_grad(self):
        for buffer in self._buffers:
            buffer.zero_grads()

    def memory_bytes(self):
        """This rank's bytes at rest, from the live tensors: parameters, main grads, and the separate masters plus
        the optimizer states with dim > 0 (Adam's moments); master_bytes is the masters' part of optimizer_bytes."""
        size = lambda ts: sum(t.numel() * t.element_size() for t in ts)
        masters = size(b.master_flat for b in self._buffers if b.separate_master)
        states = size(t for s in self.optimizer.state.values() for t in s.values()
                      if torch.is_tensor(t) and t.dim() > 0)
        return {"param_bytes": size(t for b in self._buffers for t in b.param_buffers()),
                "grad_bytes": size(b.grad_buffer() for b in self._buffers),
                "optimizer_bytes": masters + states, "master_bytes": masters}


# ----------------------------------------------------------------------------------------------------
# FP8, per-tensor scaling: the tensorwise (current) and delayed recipes, a BF16 backward
# ----------------------------------------------------------------------------------------------------

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
AMAX_EPS = 1e-12  # an all-zero tensor gets a finite scale (fp8_max / 1e-12 is far below FP32's max)
PER_TENSOR_RECIPES = ("tensorwise", "delayed")

# what ran: gemm:count (forward GEMMs), gemm:backward (FP8 backward GEMMs), gemm:scaled_mm / gemm:emulated (how),
# amax:all_reduce (scale agreements over TP)
fp8_log = Counter()


def fp8_scale(amax, dtype=E4M3):
    """Current scaling, fp8_max / max(amax, eps), one rounded division (`number / tensor` would round twice)."""
    amax = torch.clamp(amax.float(), min=AMAX_EPS)
    return torch.full_like(amax, torch.finfo(dtype).max) / amax


def quantize_fp8(x, dtype=E4M3, scale=None):
    """(x_fp8, scale), x ~= x_fp8.float() / scale; scale defaults to fp8_scale(amax(x)). Values a given scale pushes
    past the range saturate at +-max (explicitly: torch turns E5M2 overflow into inf)."""
    if scale is None:
        scale = fp8_scale(amax_of(x), dtype)
    fp8_max = torch.finfo(dtype).max
    # one FP32 staging copy (explicit: .float() of FP32 is x itself), scaled and clamped in place: 4 + 1 bytes
    x_fp8 = x.to(torch.float32, copy=True).mul_(scale).clamp_(-fp8_max, fp8_max).to(dtype)
    return x_fp8, scale


def dequantize_fp8(x_fp8, scale):
    return x_fp8.float() / scale


def delayed_scale(amax_history, amax, dtype=E4M3):
    """fp8_max / the largest amax of a (..., L) history; the current amax where the history is still zeros."""
    history = amax_history.max(dim=-1).values
    return fp8_scale(torch.where(history > 0, history, amax), dtype)  # torch.where: no host sync


def push_amax(amax_history, amax):
    """Shift the (..., L) history by one step and write this step's amax in front."""
    amax_history.copy_(torch.roll(amax_history, 1, dims=-1))
    amax_history[..., 0] = amax


def amax_of(t):
    """max |t| in FP32; 0 for an empty tensor (an expert that received no token still joins the all-reduce)."""
    t = t.detach()
    return t.abs().max().float() if t.numel() else torch.zeros((), device=t.device)


def agreed_amax(x, weight, amax_group=None):
    """[amax(x), amax(weight)], MAX-reduced over amax_group (the TP group): the full tensors' amaxes."""
    group_size = _group_size(amax_group, "amax_group")
    amax = torch.stack([amax_of(x), amax_of(weight)])
    if group_size > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=amax_group)
        fp8_log["amax:all_reduce"] += 1
    return amax


_SCALED_MM_ON_CPU = {}  # recipe -> bool, probed once


def scaled_mm_available(device):
    """Per-tensor torch._scaled_mm: compute capability 8.9+ on CUDA; on CPU, probed once by a small call."""
    if device.type != "cpu":
        return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    if "tensorwise" not in _SCALED_MM_ON_CPU:
        try:
            a = torch.ones(128, 128).to(E4M3)
            torch._scaled_mm(a, a.t(), scale_a=torch.tensor(1.0), scale_b=torch.tensor(1.0),
                             out_dtype=torch.bfloat16)
            _SCALED_MM_ON_CPU["tensorwise"] = True
        except (RuntimeError, NotImplementedError, ValueError):
            _SCALED_MM_ON_CPU["tensorwise"] = False
    return _SCALED_MM_ON_CPU["tensorwise"]


def fp8_matmul(a_fp8, a_scale, b_fp8, b_scale, out_dtype, use_scaled_mm=True):
    """(a / a_scale) @ (b / b_scale)^T accumulated in FP32: _scaled_mm (b.t() column-major, dimensions multiples of
    16) or its emulation, the same arithmetic (FP8 values are exact in FP32)."""
    inv_a, inv_b = a_scale.reciprocal().float(), b_scale.reciprocal().float()
    shapes_ok = a_fp8.shape[0] % 16 == 0 and a_fp8.shape[1] % 16 == 0 and b_fp8.shape[0] % 16 == 0
    if use_scaled_mm and shapes_ok and scaled_mm_available(a_fp8.device):
        fp8_log["gemm:scaled_mm"] += 1
        return torch._scaled_mm(a_fp8, b_fp8.t(), scale_a=inv_a, scale_b=inv_b, out_dtype=out_dtype)
    fp8_log["gemm:emulated"] += 1
    return ((a_fp8.float() @ b_fp8.float().t()) * (inv_a * inv_b)).to(out_dtype)


def per_tensor_scales(x, weight, recipe="tensorwise", amax_group=None, amax_history=None, record_amax=True):
    """(x_scale, w_scale) of a per-tensor recipe from the amaxes agreed over amax_group (the TP group). tensorwise:
    current scales; delayed: from amax_history ((2, L): input, weight), which records this call's amaxes when
    record_amax."""
    if recipe not in PER_TENSOR_RECIPES:
        raise ValueError(f"recipe={recipe!r}: use one of {PER_TENSOR_RECIPES}")
    if recipe == "delayed" and (amax_history is None or amax_history.dim() != 2 or amax_history.shape[0] != 2):
        raise ValueError("amax_history: the delayed recipe needs a (2, L) tensor of past amaxes (input, weight), "
                         "e.g. FP8Linear's buffer; or use the tensorwise recipe")
    amax = agreed_amax(x, weight, amax_group)
    if recipe == "tensorwise":
        return fp8_scale(amax[0]), fp8_scale(amax[1])
    x_scale, w_scale = delayed_scale(amax_history, amax)
    if record_amax:
        push_amax(amax_history, amax)
    return x_scale, w_scale


def _per_tensor_product(x2, weight, x_scale, w_scale, use_scaled_mm):
    """The forward GEMM under a per-tensor recipe: both operands quantised with the agreed scales."""
    x_fp8, _ = quantize_fp8(x2, scale=x_scale)
    w_fp8, _ = quantize_fp8(weight, scale=w_scale)
    return fp8_matmul(x_fp8, x_scale, w_fp8, w_scale, x2.dtype, use_scaled_mm)


def _bf16_backward(g, x2, weight, needs):
    """The backward GEMMs in BF16 from the saved high-precision tensors: grad_x = g W, grad_W = g^T x."""
    g = g.to(torch.bfloat16)
    grad_x = (g @ weight.to(torch.bfloat16)).to(x2.dtype) if needs[0] else None
    grad_w = (g.t() @ x2.to(torch.bfloat16)).to(weight.dtype) if needs[1] else None
    return grad_x, grad_w


class _FP8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, x_scale, w_scale, use_scaled_mm):
        ctx.save_for_backward(x, weight)  # high precision: the backward computes in BF16 from them
        y = _per_tensor_product(x.reshape(-1, x.shape[-1]), weight, x_scale, w_scale, use_scaled_mm)
        fp8_log["gemm:count"] += 1
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x, grad_w = _bf16_backward(grad_out.reshape(-1, weight.shape[0]), x.reshape(-1, x.shape[-1]), weight,
                                        ctx.needs_input_grad[:2])
        return None if grad_x is None else grad_x.reshape(x.shape), grad_w, None, None, None


def fp8_linear(x, weight, bias=None, amax_group=None, use_scaled_mm=True, *, recipe="tensorwise", amax_history=None,
               record_amax=True):
    """y = x @ weight^T + bias, the forward GEMM in FP8 E4M3 at per_tensor_scales (tensorwise, or delayed from
    amax_history); the backward in BF16 from the saved tensors."""
    x_scale, w_scale = per_tensor_scales(x, weight, recipe, amax_group, amax_history, record_amax)
    y = _FP8LinearFunction.apply(x, weight, x_scale, w_scale, use_scaled_mm)
    return y if bias is None else y + bias.to(y.dtype)


class FP8Linear(nn.Module):
    """nn.Linear through fp8_linear. recipe="delayed" (or delayed_scaling=True) keeps `amax_history_len` steps of
    amaxes, one per training forward: not under activation checkpointing (a recomputation records twice)."""

    def __init__(self, in_features, out_features, bias=True, delayed_scaling=False, amax_history_len=16,
                 use_scaled_mm=True, amax_group=None, device=None, dtype=None, *, recipe=None):
        super().__init__()
        if not isinstance(amax_history_len, numbers.Integral) or amax_history_len < 1:
            raise ValueError(f"amax_history_len={amax_history_len!r} must be an int >= 1 (the steps whose amaxes "
                             "delayed scaling takes the max of; 16 is usual)")
        if delayed_scaling and recipe not in (None, "delayed"):
            raise ValueError(f"delayed_scaling=True with recipe={recipe!r}: delayed_scaling is recipe='delayed'; "
                             "pass one of them")
        recipe = recipe or ("delayed" if delayed_scaling else "tensorwise")
        if recipe not in PER_TENSOR_RECIPES:
            raise ValueError(f"recipe={recipe!r}: use one of {PER_TENSOR_RECIPES}")
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.recipe, self.delayed_scaling = recipe, recipe == "delayed"
        self.use_scaled_mm, self.amax_group = use_scaled_mm, amax_group
        self.register_buffer("amax_history", torch.zeros(2, amax_history_len, device=device))  # input, weight
        self.reset_parameters()

    def reset_parameters(self):
        ref = nn.Linear(self.weight.shape[1], self.weight.shape[0], bias=self.bias is not None)
        with torch.no_grad():  # the same initialisation as nn.Linear
            self.weight.copy_(ref.weight)
            if self.bias is not None:
                self.bias.copy_(ref.bias)

    def forward(self, x):
        return fp8_linear(x, self.weight, self.bias, self.amax_group, self.use_scaled_mm, recipe=self.recipe,
                          amax_history=self.amax_history if self.delayed_scaling else None, record_amax=self.training)


# BEYOND THE CHAPTER: checkpoint state, ZeRO-2/3 and HSDP, FP8 parameter all-gathers, fine-grained FP8, NVFP4
import io
import multiprocessing
import os
import tempfile
from datetime import timedelta

import numpy as np
import torch.nn.functional as F
from einops import rearrange
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

# ----------------------------------------------------------------------------------------------------
# The optimizer's checkpoint state: this rank's pieces where they lie, one parameter's full state, or everything
# ----------------------------------------------------------------------------------------------------

class CheckpointableOptimizer(MixedPrecisionOptimizer):
    """MixedPrecisionOptimizer (its step, its reductions, its copy back: unchanged) with its checkpoint state:
    this rank's pieces where they lie (owned_state, owned_param), one parameter's full state (full_state,
    load_full_state), or everything unsharded (state_dict, load_state_dict). What train_gpt.py builds, so that
    its checkpoints can save and resume the optimizer; ShardedOptimizer builds on it."""

    def _full_tensor(self, buffer, local, piece_range, p):
        """p's whole master or state from this rank's piece: sharded, the pieces gathered over the group (an
        all-reduce SUM of zero-filled full tensors, each element owned by exactly one rank, so exact): every rank
        of the group calls it for the same params in order."""
        if not buffer.sharded:
            return local.detach().reshape(p.shape).clone()
        a, b = piece_range
        full = torch.zeros(p.numel(), dtype=local.dtype, device=local.device)
        full[a:b] = local.detach().reshape(-1)
        dist.all_reduce(full, group=buffer.group)
        return full.view(p.shape)

    def _load_param(self, buffer, p, piece, master):
        """The working parameter from its loaded master, rounded."""
        p.copy_(master)

    def owned_state(self, p, like=None):
        """((a, b), {"master": ..., "exp_avg": ..., "step": ...}): this rank's live piece of p's master and states,
        elements [a, b) of p.view(-1), for a checkpoint that writes and loads them where they lie. `like`, {name:
        (ndim, dtype)}, creates the states missing before the first step, zero-filled (0-dim ones on the CPU)."""
        _, piece = self._managed(p, "owned_state")
        state = self.optimizer.state[piece]
        for key, (ndim, dtype) in (like or {}).items():
            if key not in state and key != "master":
                state[key] = torch.zeros((), dtype=dtype) if ndim == 0 else torch.zeros_like(piece)
        owned = {"master": piece}
        owned.update((key, state[key]) for key in sorted(state) if torch.is_tensor(state[key]))
        return piece.range, owned

    def owned_param(self, p):
        """((a, b), the live tensor holding the elements [a, b) of p.view(-1) at rest): here all of p."""
        self._managed(p, "owned_param")
        return (0, p.numel()), p.detach().view(-1)

    def full_state(self, p):
        """{"master": p's master, then every optimizer state}, each a FULL tensor of p's shape (0-dim as it is)."""
        buffer, piece = self._managed(p, "full_state")
        full = {"master": self._full_tensor(buffer, piece, piece.range, p)}
        state = self.optimizer.state.get(piece, {})
        for key in sorted(state):  # the same keys in the same order on every rank: the pieces step alike
            value = state[key]
            if torch.is_tensor(value):
                full[key] = value.detach().clone() if value.dim() == 0 else \
                    self._full_tensor(buffer, value, piece.range, p)
        return full

    def load_full_state(self, p, state):
        """Inverse of full_state, whatever the layout that saved it; no communication."""
        buffer, piece = self._managed(p, "load_full_state")
        a, b = piece.range
        cut = lambda t: t.detach().reshape(-1)[a:b].reshape(piece.shape).to(piece.device, piece.dtype, copy=True)
        with torch.no_grad():
            self._load_param(buffer, p, piece, state["master"].reshape(p.shape).to(p.device))
            piece.copy_(cut(state["master"]))
        # 0-dim states (Adam's step) stay where they were saved (torch keeps them on the CPU)
        self.optimizer.state[piece] = {k: (v.detach().clone() if v.dim() == 0 else cut(v))
                                       for k, v in state.items() if k != "master"}

    def scalar_state(self):
        """The non-tensor part: hyperparameters of each group, the loss scaler (the tensors: full_state)."""
        return {"param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict()}

    def state_dict(self):
        """Everything, unsharded: the scalar state and every parameter's full_state, in parameter order."""
        return {"scalars": self.scalar_state(), "params": [self.full_state(p) for p in self.params]}

    def load_state_dict(self, state):
        """Inverse of state_dict; everything is checked before anything is overwritten."""
        if len(state["params"]) != len(self.params):
            raise ValueError(f"state_dict holds {len(state['params'])} parameters, this optimizer "
                             f"{len(self.params)}: build it over the same parameters")
        for i, (p, full) in enumerate(zip(self.params, state["params"])):
            # the states may differ between param groups: only the master is required
            if "master" not in full:
                raise ValueError(f"state_dict's parameter {i} holds {sorted(full)} but no 'master': pass a "
                                 "state_dict written by CheckpointableOptimizer.state_dict")
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
# Sharded data parallelism: ZeRO-2, -3 and HSDP (ShardedOptimizer), built on the chapter's ZeRO-1
# ----------------------------------------------------------------------------------------------------
#
# ZeRO-1, -2, -3 (Rajbhandari et al. 2020; ZeRO-1 is Megatron-LM's distributed optimizer, the chapter's zero=1;
# ZeRO-3 FSDP's design, here with Megatron's flat ranges). Each shard-group entry (dense weights over DP x CP, expert
# weights over EDP) lays its parameters out in flat buffers padded to a multiple of the group size d; rank r
# owns the r-th 1/d of every buffer, a contiguous range [lo, hi) (a parameter may straddle two ranks: each
# optimises its piece). The levels differ in what else the ranges cut:
#
#     zero=1  the FP32 masters and the optimizer states. A step: reduce-scatter (SUM) of the full FP32 main grads,
#             each rank receiving the sum of its shard; the inner optimizer steps the pieces in the shard; each
#             rank rounds its updated shard into the parameter buffer; one all-gather rebuilds the parameters.
#     zero=2  also the gradients of the units (`units=`, one list of parameters per transformer block): they get
#             no full-size main grad; after each backward of a unit `opt.units[i].reduce_grads()` reduce-scatters
#             the full-size p.grad that autograd left (cast to FP32, one flat collective per flat buffer) into this
#             rank's FP32 shard accumulator and frees it. The step has nothing left to reduce for them.
#     zero=3  also the parameters of the units: they live as shards; `gather()` all-gathers a unit's shards into
#             a full flat buffer (the parameters are views of it) just before its forward (the next unit's gather
#             is issued asynchronously while this one computes: the prefetch), `release()` frees that storage
#             after it, and the backward gathers it again (a recomputation runs inside that backward, on the same
#             gather). The step writes each rank's updated shard and gathers nothing: the next forward does.
#
# Parameters in no unit keep ZeRO-1 treatment at zero 2 and 3 (whole parameters and FP32 main grads, sharded
# states): the trainer keeps the embedding, the final norm and the LM head out of the units, since they are used
# at both ends of the step and their gradients arrive through hooks and extra sums (all_reduce_grads over the
# embedding group). Per parameter with Adam, e bytes per parameter element (2 BF16, 4 FP32), 4 of FP32 main
# grad, s of states (two FP32 moments, 8, plus a 4-byte FP32 master where the parameter is narrower); each level
# divides one more part by d:
#
#     bytes per parameter, Adam      zero=0        zero=1         zero=2            zero=3
#                                    e + 4 + s     e + 4 + s/d    e + (4 + s)/d     (e + 4 + s)/d + working set
#     BF16 params, FP32 main grads   18            6 + 12/d       2 + 16/d          18/d
#     FP32 params and grads          16            8 + 8/d        4 + 12/d          16/d
#
# The zero=3 working set: the full parameters of the units gathered at once, two units with a one-unit prefetch
# (`memory_bytes()["peak_gathered_bytes"]`), plus, between a unit's backward and its reduce_grads, its full-size
# p.grad (e per unit parameter). Zero 2 and 3 also hold one unit's reduce-scatter in flight, the FP32 flat copy it
# sends and the shard it receives ((4 + 4/d) per unit parameter): a unit's reduce_grads first finishes the one
# before it, whichever unit that was, so at most one unit's copies live at once (not every unit's until its own
# next reduction, which would keep 4 + 4/d bytes per parameter: zero 1's memory and more). Padding rule: each flat
# buffer (one per entry, dtype and device; at zero 2 and 3 also one per unit) is padded to a multiple of its shard
# count, at most k - 1 elements; the padding is in the parameter, main-grad and master buffers, not in the
# moments (which belong to the pieces).
#
# Bytes sent per parameter and step on a ring (an all-reduce sends 2 (d-1)/d of its buffer, a reduce-scatter
# and an all-gather (d-1)/d of the full buffer), FP32 gradients, m micro-batches per step:
#
#     zero=0  2 (d-1)/d 4            one all-reduce: the micro-batches accumulate into the main grads first
#     zero=1  (d-1)/d (4 + e)        reduce-scatter + all-gather: for e = 4 the all-reduce's two halves
#     zero=2  (d-1)/d (4 m + e)      one reduce-scatter per micro-batch, one all-gather per step
#     zero=3  (d-1)/d m (4 + 2 e)    per micro-batch the forward's and the backward's all-gathers and a
#                                    reduce-scatter; no all-gather after the step
#
# At m = 1: BF16 8, 6, 6, 8 and FP32 8, 8, 8, 12 times (d-1)/d (ZeRO-3 1.5x the all-reduce at e = 4). Several
# micro-batches at zero 2 and 3 cost one reduce-scatter each, because the full-size gradient lives only from a
# unit's backward to its reduce_grads; accumulating full-size gradients over the micro-batches and reducing once
# would keep a full-size FP32 buffer alive all step, 4 bytes per parameter: ZeRO-1's memory, the saving lost.
#
# Hybrid sharding (HSDP), a shard-group entry (params, group, replicate_group): states, gradients and parameters
# sharded over the k ranks of `group` (a node, say), replicated over the r = d / k ranks of `replicate_group`:
# reduce-scatters and all-gathers over k, then one all-reduce (SUM) of the reduced 1/k shard over r, once per
# step at every level (at zero 2 and 3 at step(), on the accumulated shard: a sum, so once suffices); at zero=0
# the all-reduce over k, then over r. Memory as sharding over k; bytes sent per parameter: the table's with
# d -> k, plus 2 (r-1)/r 4 / k (zero=0: 2 (r-1)/r 4), so only the shard crosses nodes.
#
# The norm under sharding: each rank counts the gradients it owns (its shard, once per replica set; under zero=0
# group rank 0 of each entry). Checkpoints: owned_state(p) and owned_param(p) hand out this rank's live pieces
# (under zero=3 the parameter shard), for a checkpoint that writes each shard where it lies and loads into it in
# place (then copy_masters_to_params()); full_state(p) gathers them as full tensors (12 bytes per parameter for Adam, so
# for small models), so a run saved under one layout (zero=3 on 2 ranks) resumes under another.
#
# FP8 parameter all-gather (`fp8_param_gather`: ZeRO-1 and 2 at the step, ZeRO-3 at every gather of a unit): each
# rank publishes its updated master shard in MXFP8 (E4M3 + one E8M0 byte per 32), so the all-gather sends
# (d-1)/d x (1 + 1/32) bytes per parameter instead of (d-1)/d x 2 (BF16): 0.516 of them (a little more with the
# padding that aligns each parameter to 32). The working weights become FP8-rounded (within E4M3's eps/2 of the
# masters); masters and moments stay FP32, so updates below the FP8 spacing still accumulate in the master.

FP8_GATHER_BLOCK = 32  # fp8_param_gather: one E8M0 scale per 32 elements, MXFP8's block


def fp8_param_round(flat):
    """The working weights under fp8_param_gather: a 1-D tensor (a parameter from its start, or a shard of
    whole 32-element blocks) rounded to MXFP8 (quantize_mxfp8: E4M3 elements, one power-of-two scale per 32
    elements) and back, in its own dtype: exact in BF16."""
    return dequantize_blocks(quantize_mxfp8(flat.reshape(1, -1))).view(-1).to(flat.dtype)


class _ShardedFlatBuffer(_FlatBuffer):
    """The chapter's _FlatBuffer at ZeRO level `level` (0 to 3: a parameter in no unit gets 1 at zero 2 and 3)
    over `group`'s k ranks, and replicated over `replicate_group` (HSDP).

    params      param dtype, padded length N. Level 3 keeps only `param_shard` (its own storage) at rest: the
                full buffer's storage is freed and gather() rebuilds it (the views stay views of the same storage)
    main grads  master dtype. Levels 0 and 1: length N, every parameter's .main_grad is a view of its range.
                Levels 2 and 3: `grad_shard` only, this rank's range, summed into by reduce_unit_grads()
    master      master dtype, this rank's shard only, and only when the param dtype is narrower; otherwise
                the shard of the parameters itself (param_shard) is what the optimizer updates

    Sharding (level >= 1) is the chapter's ZeRO-1 layout: N padded to a multiple of k, rank r owning [lo, hi) =
    [r N/k, (r+1) N/k) of every buffer, and each parameter's piece in the shard (possibly empty) stepped by the
    inner optimizer, so per-group options (weight decay) apply per parameter, and every rank holds a state
    entry for every parameter (full_state relies on it). With fp8_param_gather every parameter starts at a
    multiple of 32 and N is a multiple of 32 k, so the 32-element FP8 blocks of a shard are blocks of one
    parameter each, the same at every k. HSDP: the shard is replicated over `replicate_group`, whose all-reduce
    of the reduced shard completes the sum over all d = k r data-parallel ranks."""

    def __init__(self, params, group, level, master_dtype, fp8_param_gather=False, replicate_group=None):
        self.level, self.fp8_param_gather = level, fp8_param_gather
        self.replicate_group = replicate_group if _group_size(replicate_group) > 1 else None
        self.replicate_size = _group_size(self.replicate_group)
        self.replicate_rank = 0 if self.replicate_group is None else dist.get_rank(self.replicate_group)
        self.gathered = level < 3
        super().__init__(params, group, master_dtype, shard_states=level >= 1)
        self._finish_init()

    def _layout(self):
        shards = self.group_size if self.level >= 1 else 1
        align = FP8_GATHER_BLOCK if self.fp8_param_gather else 1
        starts, numel = [], 0
        for p in self.params:
            starts.append(numel)
            numel += math.ceil(p.numel() / align) * align
        padded = math.ceil(numel / (shards * align)) * shards * align
        lo = padded // shards * (self.group_rank if self.level >= 1 else 0)
        return starts, padded, lo, lo + padded // shards

    def _make_main_grads(self):
        if self.level <= 1:
            return super()._make_main_grads()
        self.grad_flat = None  # no full-size gradient buffer: reduce_unit_grads sums into the shard
        self.grad_shard = torch.zeros(self.hi - self.lo, dtype=self.master_dtype, device=self.param_flat.device)

    def _owned_params(self):
        owned = super()._owned_params()
        return owned.clone() if self.level == 3 else owned

    def _finish_init(self):  # the working weights rounded (fp8_param_gather) or freed (level 3)
        with torch.no_grad():
            if self.fp8_param_gather:  # the working weights are FP8-rounded from the start (the same on every rank)
                self.param_flat.copy_(fp8_param_round(self.param_flat))
                if self.level == 3:  # what every gather sends: the shard's MXFP8 bytes, kept between steps (local)
                    self._publish_fp8()
        if self.level == 3:
            self.param_flat.untyped_storage().resize_(0)  # at rest only the shard lives

    def route_grads(self):
        """Levels 2 and 3: the unit parameters keep no full-size gradient buffer and have no hook; reduce_grads
        takes their p.grad."""
        if self.level <= 1:
            return super().route_grads()
        for p in self.params:
            p._zero_unit_level = self.level  # marks it as managed (it has no main_grad to tell)
            p.grad = None

    def fold_stray_grads(self):
        if self.level <= 1:  # levels 2 and 3: reduce_unit_grads takes each p.grad (step() refuses one left over)
            super().fold_stray_grads()

    def groups(self):
        return (self.group, self.replicate_group)

    def counts_in_norm(self):
        """Sharded: each rank counts its shard once per replica set (replicate rank 0). Level 0: only group rank
        0 of replicate rank 0 counts the reduced gradient, which every rank holds identically."""
        return super().counts_in_norm() and self.replicate_rank == 0

    def reduce_grads(self):
        """At step: the chapter's SUM over the group at levels 0 and 1 (levels 2 and 3 were reduced by
        reduce_unit_grads), then, under HSDP, all-reduce of the shard over the replicate group (once per step at
        every level: a sum, so once suffices)."""
        self.finish_reduce()
        if self.level <= 1:
            super().reduce_grads()
        if self.replicate_group is not None:
            _count_sent("replicate_all_reduce", self.grad_shard, self.replicate_size, 2)
            dist.all_reduce(self.grad_shard, group=self.replicate_group)

    def reduce_unit_grads(self, async_op=False):
        """Levels 2 and 3, after a backward: the parameters' full-size p.grad (the param dtype, as autograd left
        them; None counts as zeros), cast to the master dtype in one flat buffer, reduce-scattered (SUM) over the
        group and added into this rank's grad_shard; p.grad is freed. One collective per call; with async_op it
        is left running while the backward goes on (the rest of the model's backward overlaps it) and its sum is
        added by finish_reduce(), at this buffer's next reduction, in all_reduce_grads or at the step: in the order
        the collectives were issued either way."""
        self.finish_reduce()  # at most one in flight per buffer (ShardedUnit: per optimizer): its copy freed by then
        flat = torch.zeros(self.padded, dtype=self.grad_shard.dtype, device=self.grad_shard.device)
        with torch.no_grad():
            for p, start in zip(self.params, self.starts):
                if p.grad is not None:
                    flat[start:start + p.numel()].copy_(p.grad.detach().reshape(-1))
                p.grad = None
            if self.group_size > 1:
                reduced = torch.empty_like(self.grad_shard)
                _count_sent("reduce_scatter", flat, self.group_size, 1)
                work = _reduce_scatter_flat(reduced, flat, group=self.group, async_op=True)
                self.in_flight = (work, reduced, flat)  # the collective reads `flat` until it completes
                if not async_op:
                    self.finish_reduce()
            else:
                self.grad_shard.add_(flat)

    def finish_reduce(self):
        """Wait for the reduce-scatter reduce_unit_grads left running and add its sum into grad_shard."""
        if getattr(self, "in_flight", None) is not None:
            work, reduced, _ = self.in_flight
            work.wait()
            with torch.no_grad():
                self.grad_shard.add_(reduced)
            self.in_flight = None

    def gather(self, async_op=False):
        """Level 3: give the full buffer its storage back and all-gather the shards into it; returns the work
        handle (async_op) or None. Autograd's saved-tensor check must not see this write: a forward saved these
        parameters, release() freed them, and this refills them for the backward with the same values."""
        self.param_flat.untyped_storage().resize_(self.padded * self.param_flat.element_size())
        self.gathered = True
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.param_flat):
            if self.group_size == 1:
                self.param_flat.copy_(self.param_shard)
                return None
            if self.fp8_param_gather:  # FP8 bytes and scales travel; the BF16 values are written once they are in
                gathered, work = self._all_gather_fp8(self.packed, async_op)
                done = _AfterWork(work, lambda: self._unpack_gathered(gathered))
                return done if async_op else done.wait()
            _count_sent("all_gather", self.param_flat, self.group_size, 1)
            return _all_gather_flat(self.param_flat, self.param_shard, group=self.group, async_op=async_op)

    def release(self):
        self.param_flat.untyped_storage().resize_(0)
        self.gathered = False

    def copy_masters_to_params(self):
        """The copy back into this rank's parameter shard (or its FP8 rounding); levels 1 and 2 then all-gather
        the shards as the chapter's ZeRO-1 does; level 3 does not (the next forward gathers)."""
        with torch.no_grad():
            if self.fp8_param_gather:
                self._publish_fp8()
            elif self.level <= 2:
                super().copy_masters_to_params()
            elif self.separate_master:
                self.param_shard.copy_(self.master_flat)

    def _publish_fp8(self):
        """fp8_param_gather: this rank's master shard in MXFP8 (E4M3 elements, one E8M0 scale per 32), packed
        as bytes (shard + shard / 32). Levels 1 and 2 all-gather it at once, in one collective instead of the
        2 x shard bytes of BF16; level 3 keeps it, and every gather of the unit sends it. Every rank, the owner
        included, writes the dequantised values (exact in BF16: 4 significant bits times a power of two), so
        the replicas stay identical and the owner's shard is what the others receive."""
        packed = self._pack_fp8()
        if self.level == 3:
            self.packed = packed
            self._unpack_fp8(packed, self.param_shard)
        elif self.sharded:
            gathered, _ = self._all_gather_fp8(packed)
            self._unpack_fp8(gathered, self.param_flat)
        else:
            self._unpack_fp8(packed, self.param_flat[self.lo:self.hi])

    def _pack_fp8(self):
        q = quantize_mxfp8(self.master_flat.view(1, -1))
        return torch.cat([q.data.view(torch.uint8).view(-1),
                          q.scale.reciprocal().to(torch.float8_e8m0fnu).view(torch.uint8).view(-1)])

    def _all_gather_fp8(self, packed, async_op=False):
        gathered = torch.empty(self.group_size * packed.numel(), dtype=torch.uint8, device=packed.device)
        _count_sent("all_gather", gathered, self.group_size, 1)
        return gathered, _all_gather_flat(gathered, packed, group=self.group, async_op=async_op)

    def _unpack_fp8(self, packed, target):
        """The dequantised values of packed shards (one row per shard, in rank order) written into target."""
        shard = self.hi - self.lo
        packed = packed.view(-1, shard + shard // FP8_GATHER_BLOCK)
        data = packed[:, :shard].contiguous().view(E4M3).float().view(-1, FP8_GATHER_BLOCK)
        scales = packed[:, shard:].contiguous().view(torch.float8_e8m0fnu).float().view(-1, 1)  # 2^e
        target.copy_((data * scales).view(-1))

    def _unpack_gathered(self, gathered):
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.param_flat):
            self._unpack_fp8(gathered, self.param_flat)

    def zero_grads(self):
        self.finish_reduce()  # a reduce-scatter still in flight would add into the zeroed shard later
        if self.level <= 1:
            return super().zero_grads()
        self.grad_shard.zero_()
        for p in self.params:
            p.grad = None

    def grad_buffer(self):
        return self.grad_shard if self.grad_flat is None else self.grad_flat

    def param_buffers(self):
        """Level 3: the shard only, and under fp8_param_gather also its MXFP8 bytes."""
        if self.level < 3:
            return super().param_buffers()
        return [self.param_shard] + ([self.packed] if self.fp8_param_gather else [])

    def load_param(self, p, piece, master):
        """The working parameter from its loaded master: level 3 into its shard (the full view only while
        gathered); under fp8_param_gather the master's FP8 rounding, as a step publishes it."""
        if self.level == 3:
            a, b = piece.range
            lo, hi = piece.shard_range
            self.param_shard[lo:hi].copy_(master.reshape(-1)[a:b])
        if self.gathered:
            p.copy_(fp8_param_round(master.reshape(-1)).view(p.shape) if self.fp8_param_gather else master)


class _AfterWork:
    """A collective's work handle with a step to run once it completes: wait() waits, then runs `then`."""

    def __init__(self, work, then):
        self.work, self.then = work, then

    def wait(self):
        if self.work is not None:
            self.work.wait()
        self.then()


class _GatherMeter:
    """The unit parameter bytes gathered now, and the most at once since the last read (memory_bytes)."""

    def __init__(self):
        self.now = self.peak = 0

    def add(self, nbytes):
        self.now += nbytes
        self.peak = max(self.peak, self.now)


class ShardedUnit:
    """One unit of parameters (a transformer block) that zero 2 and 3 shard deeper: one _ShardedFlatBuffer per
    (shard-group entry, dtype, device) of its parameters, so each gather or reduce is one collective per flat buffer.
    `opt.units[i]`, in the order given. At zero < 3 gather, wait and release do nothing (the parameters are
    whole), at zero < 2 reduce_grads does nothing (the hooks accumulate main grads; the step reduces).

    Several micro-batches at zero 2 and 3 cost one reduce-scatter per micro-batch: 4 (k-1)/k bytes per parameter
    each, m times per step, against once for full-size gradients accumulated over the micro-batches, which
    would keep a full-size FP32 buffer (4 bytes per parameter) alive for the whole step and lose what zero 2
    saves (the demo measures both)."""

    def __init__(self, params, buffers, zero, meter, reducing=None):
        self.params, self.buffers, self.zero, self._meter = params, buffers, zero, meter
        self._works, self._gathered = [], False
        # the flat buffers whose reduce-scatter is in flight, shared by the units of one optimizer
        self._reducing = [] if reducing is None else reducing

    @property
    def gathered(self):
        """True when the unit's full parameters are materialised (always at zero < 3)."""
        return self.zero < 3 or self._gathered

    def gather(self, async_op=False):
        """Zero 3: all-gather every flat buffer's parameter shards into its full flat buffer (the parameters are views
        of it). async_op=True returns at once with the work kept inside (wait() completes it); a gathered unit
        is not gathered again (async_op=False still waits for a gather in flight)."""
        if self.zero < 3:
            return
        if not self._gathered:
            self._works = [w for w in (b.gather(async_op) for b in self.buffers) if w is not None]
            self._gathered = True
            self._meter.add(self.param_bytes())
        if not async_op:
            self.wait()

    def wait(self):
        for work in self._works:
            work.wait()
        self._works = []

    def release(self):
        """Zero 3: free the full buffers' storage (untyped_storage().resize_(0)), keeping only the shards. A
        gather in flight is completed first."""
        if self.zero < 3 or not self._gathered:
            return
        self.wait()
        self._meter.now -= self.param_bytes()
        for buffer in self.buffers:
            buffer.release()
        self._gathered = False

    def reduce_grads(self, async_op=False):
        """Zero 2 and 3, after each backward of the unit (once per micro-batch, after the W step under a
        zero-bubble schedule): every parameter's full-size p.grad is reduce-scattered (flat, in the master
        dtype) over its flat buffer's group into this rank's shard accumulator, summed over calls, and set to None.
        Under HSDP the replicate all-reduce of the accumulated shard runs once, at step(). With async_op the
        reduce-scatters run on while the caller goes on (the optimizer waits for them where it needs them, and the
        next unit's reduce_grads for the unit before it: one unit's in flight at a time)."""
        if self.zero < 2:
            return
        for buffer in self._reducing:  # the unit before, whichever it was: at most one unit's copies in flight
            buffer.finish_reduce()
        self._reducing[:] = self.buffers
        for buffer in self.buffers:
            buffer.reduce_unit_grads(async_op)

    def param_bytes(self):
        """Bytes of the unit's full parameters alive now: the gathered buffers (padding included) at zero 3,
        the parameters themselves below."""
        if self.zero < 3:
            return sum(p.numel() * p.element_size() for p in self.params)
        return sum(b.param_flat.numel() * b.param_flat.element_size() for b in self.buffers if b.gathered)



def _check_replicate_group(k, group, replicate_group):
    """HSDP: the replicate group holds this rank and meets the shard group in this rank only (rank lists, no
    communication): the shard of one rank is summed with the same shard of the other replicas."""
    if replicate_group is None:
        return
    if dist.get_rank(replicate_group) < 0:
        raise ValueError(f"shard_groups[{k}]: this rank is not a member of the replicate group; pass the group "
                         "of the ranks that hold the same shard as this one (or None)")
    if group is not None:
        common = set(dist.get_process_group_ranks(group)) & set(dist.get_process_group_ranks(replicate_group))
        if common != {dist.get_rank()}:
            raise ValueError(f"shard_groups[{k}]: the shard group and the replicate group share ranks "
                             f"{sorted(common)}; they must meet in this rank only (shard over [0, 1] and [2, 3], "
                             "replicate over [0, 2] and [1, 3], say)")


def _check_units(units, optimised, name):
    """Each unit a list of optimised parameters, no parameter in two units (or twice in one)."""
    unit_lists, unit_of = [], {}
    for u, unit in enumerate(units or []):
        unit_params = [unit] if torch.is_tensor(unit) else list(unit)
        for p in unit_params:
            if id(p) not in optimised:
                raise ValueError(f"units[{u}] holds a parameter (shape {tuple(p.shape)}) that is not optimised "
                                 "(frozen, or not in params_or_param_groups): put only optimised parameters "
                                 "in units")
            if id(p) in unit_of:
                raise ValueError(f"{name(p)} is in units[{unit_of[id(p)]}] and units[{u}]: a parameter belongs "
                                 "to one unit at most")
            unit_of[id(p)] = u
        unit_lists.append(unit_params)
    return unit_lists


class ShardedOptimizer(CheckpointableOptimizer):
    """The chapter's optimizer (CheckpointableOptimizer: MixedPrecisionOptimizer with its checkpoint state) with
    ZeRO-2 and -3 over units, hybrid sharding (HSDP) and the FP8 parameter all-gather; zero 0 and 1 as the
    chapter's. The step is the chapter's; what changes is the flat buffers (_ShardedFlatBuffer: the units'
    gradients reduce-scattered after each backward, their parameters gathered around each use, the replicate
    all-reduce, the FP8 all-gather of the copy back) and the units.

    shard_groups: (params, group) as the chapter's, or (params, group, replicate_group): hybrid sharding, sharded
    over group, the reduced shards then SUMMED over replicate_group (None or one rank: plain sharding).

    units (zero 2 and 3; accepted and ignored below): one list of parameters per transformer block; they get
    the deeper sharding, every other parameter ZeRO-1's. `opt.units` (ShardedUnit, in the order given) are
    called by the trainer around each block, for every micro-batch:

        forward of block i:   units[i].gather(); units[i + 1].gather(async_op=True)  # the prefetch
                              y = block_i(x); units[i].release()
        backward of block i:  units[i].gather(); units[i - 1].gather(async_op=True)
                              backward through block i (the recomputation first, under checkpointing)
                              units[i].release(); units[i].reduce_grads()
        opt.step(...)         # no reduce for the units; zero=3 copies the masters into the shards only

    (sharded_micro_batch is this loop.) Under a zero-bubble schedule whose weight gradients come later, in a
    separate W step, call reduce_grads after W (a W step that reads only the saved input and output gradient, as
    a linear's weight gradient does, needs no gather: release may then come right after B). reduce_grads must
    run on every rank of the unit's groups alike, one call per unit per micro-batch; step() refuses a unit
    parameter that still holds a p.grad, and releases every gathered unit (its full parameters would be stale).
    A zero-3 unit's parameters have no storage until gathered.

    fp8_param_gather (zero 1 to 3, parameters narrower than master_dtype): each rank quantises its updated master
    shard to MXFP8 (E4M3, one power-of-two scale per 32 elements) and the shards are all-gathered as FP8 bytes plus
    scales: (d-1)/d x (1 + 1/32) bytes per parameter sent instead of (d-1)/d x 2 for BF16, once per step at zero 1
    and 2, at every gather of a zero-3 unit (forward and backward), which keeps its packed shard between steps ((1 +
    1/32)/d bytes per parameter more at rest). The working weights (forward and backward) become FP8-rounded,
    |w - master| <= 2^-4 |w| for normal values (E4M3's eps/2), from construction on.
    """

    def __init__(self, params_or_param_groups, optimizer_class, *, zero=0, fp8_param_gather=False, units=None,
                 **kwargs):
        self.fp8_param_gather, self._units_given = fp8_param_gather, units
        super().__init__(params_or_param_groups, optimizer_class, zero=zero, **kwargs)

    def _check_zero_level(self):
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero={self.zero!r}: use 0 (replicated), 1 (optimizer states sharded over each shard "
                             "group), 2 (and the gradients of the units) or 3 (and the parameters of the units)")

    def _check_arguments(self, shard_groups):
        zero, fp8_param_gather = self.zero, self.fp8_param_gather
        if fp8_param_gather not in (False, True):
            raise ValueError(f"fp8_param_gather={fp8_param_gather!r}: pass True or False")
        if fp8_param_gather and zero == 0:
            raise ValueError(f"fp8_param_gather=True with zero={zero}: ZeRO-0 gathers no parameters; pass zero=1, "
                             "2 or 3")
        replicate_groups = []
        for k, entry in enumerate(shard_groups or []):
            if not isinstance(entry, (tuple, list)) or len(entry) not in (2, 3):
                raise ValueError(f"shard_groups[{k}] must be (params, group) or, for hybrid sharding, (params, "
                                 "group, replicate_group)")
            replicate_groups.append(entry[2] if len(entry) == 3 else None)
        name = lambda p: _param_name(self.params, p)
        for p in self.params:
            if hasattr(p, "_zero_unit_level"):
                raise ValueError(f"{name(p)} already belongs to a ShardedOptimizer's unit: build one optimizer "
                                 "per parameter")
        entries = super()._check_arguments([tuple(entry[:2]) for entry in shard_groups or []])
        entries = [(params, group, replicate) for (params, group), replicate
                   in zip(entries, replicate_groups + [None])]  # the unassigned entry last: no replicas
        for k, (_, group, replicate_group) in enumerate(entries):
            _check_replicate_group(k, group, replicate_group)
        for p in self.params:
            if fp8_param_gather and p.dtype == self.master_dtype:
                raise ValueError(f"fp8_param_gather=True with {name(p)} in the master dtype: such a parameter is "
                                 "its own master and FP8 rounding would destroy it; keep parameters narrower than "
                                 "master_dtype (BF16 with FP32 masters) or pass fp8_param_gather=False")
        self._unit_lists = _check_units(self._units_given, {id(p) for p in self.params}, name)
        return entries

    def _build_buffers(self, entries):
        """One _ShardedFlatBuffer per (entry, dtype, device). At zero 2 and 3 each unit gets its own buffers per
        (entry, dtype, device), at that level, and the parameters in no unit level-1 buffers."""
        units, zero = self._unit_lists, self.zero
        unit_of = {id(p): u for u, unit in enumerate(units) for p in unit} if zero >= 2 else {}
        make = lambda group, replicate_group, level: lambda params: _ShardedFlatBuffer(
            params, group, level, self.master_dtype, self.fp8_param_gather, replicate_group)
        for entry_params, group, replicate_group in entries:  # outside the units: ZeRO-1 at zero 2 and 3
            self._add_buffers([p for p in entry_params if id(p) not in unit_of],
                              make(group, replicate_group, min(zero, 1)))
        unit_buffers = [[] for _ in units]
        for u in range(len(units) if zero >= 2 else 0):
            for entry_params, group, replicate_group in entries:
                unit_buffers[u] += self._add_buffers([p for p in entry_params if unit_of.get(id(p)) == u],
                                                     make(group, replicate_group, zero))
        self._meter, reducing = _GatherMeter(), []
        self.units = [ShardedUnit(params, buffers, zero, self._meter, reducing)
                      for params, buffers in zip(units, unit_buffers)]

    def _grad_holder(self, p):
        """A unit parameter at zero 2 and 3 has no full gradient: its reduced piece in this rank's shard is summed
        instead (every rank of the group must lay the parameter out alike, as TP replicas are: the same shapes in
        the same order, so each owns the same range), after the units' last reduce_grads."""
        return p.main_grad if hasattr(p, "main_grad") else self._piece(p).grad

    def all_reduce_grads(self, params, group):
        params = list(params)
        for p in params:
            self._managed(p, "all_reduce_grads")
        if _group_size(group, "all_reduce_grads' group") > 1 and params:
            for buffer in self._buffers:  # the units' reduce-scatters still in flight, summed into their shards
                buffer.finish_reduce()
        super().all_reduce_grads(params, group)

    def step(self, *args, **kwargs):
        """The chapter's step, once every unit's gradients are reduced; gathered units are released first (their
        full parameters would be stale after it)."""
        pending = [i for i, p in enumerate(self.params) if hasattr(p, "_zero_unit_level") and p.grad is not None]
        if pending:
            raise ValueError(f"step(): unit parameters {pending} still hold a p.grad at zero={self.zero}: call "
                             "opt.units[i].reduce_grads() after each backward of the unit (after its W step under "
                             "a zero-bubble schedule)")
        for unit in self.units:
            unit.release()
        return super().step(*args, **kwargs)

    def copy_masters_to_params(self):
        """zero 1 and 2 (and parameters in no unit) round each rank's master shard into the parameter buffer and
        all-gather it; zero 3 rounds the master shard into the parameter shard, nothing more (the next forward
        gathers), and releases any gathered unit."""
        for unit in self.units:
            unit.release()
        super().copy_masters_to_params()

    def memory_bytes(self):
        """The chapter's figures (zero 3 units: the shards at rest, and under fp8_param_gather also their MXFP8
        bytes; zero 2 and 3 units: the shard accumulators) and peak_gathered_bytes: the most zero-3 unit parameter
        bytes gathered at once (the full buffers, padding included) since the previous call (reading it starts a
        new window); 0 at zero < 3, where the parameters are whole in param_bytes."""
        peak, self._meter.peak = self._meter.peak, self._meter.now
        return {**super().memory_bytes(), "peak_gathered_bytes": peak}

    def owned_param(self, p):
        """Zero 3 units: this rank's range (as owned_state's) and a view of the parameter shard. Under zero 3 a
        parameter in the master dtype is its own master: this tensor and owned_state's "master" are the same
        elements."""
        buffer, piece = self._managed(p, "owned_param")
        if buffer.level < 3:
            return super().owned_param(p)
        lo, hi = piece.shard_range
        return piece.range, buffer.param_shard[lo:hi]

    def _load_param(self, buffer, p, piece, master):
        buffer.load_param(p, piece, master)

    def load_state_dict(self, state):
        super().load_state_dict(state)
        for buffer in self._buffers:  # zero 3 under fp8_param_gather: its FP8 shard, made from the loaded masters
            if buffer.level == 3 and buffer.fp8_param_gather:
                buffer.copy_masters_to_params()  # at level 3 local: no communication


# ----------------------------------------------------------------------------------------------------
# FP8, fine-grained scaling: the rowwise, blockwise (DeepSeek-V3) and MXFP8 recipes
# ----------------------------------------------------------------------------------------------------
#
# FP8 recipes (`recipe=` of fp8_linear and FP8Linear). In y = x W^T both operands are (rows, K) with K the
# reduced dimension; a recipe gives each block of an operand its own scale, and the GEMM sums each K block's
# exact FP8 products in FP32, times its two scales: y_mn = sum_j (sum_{k in j} qx_mk qw_nk) / (sx_mj sw_nj).
#
#     recipe      activation block   weight block   scale           scale bits / element   used by
#     tensorwise  whole tensor       whole tensor   FP32            ~0                     the default here
#     delayed     whole tensor       whole tensor   FP32, history   ~0                     Transformer Engine
#     rowwise     1 x K (a token)    1 x K (a row)  FP32            32 / K                 torchtitan
#     blockwise   1 x 128            128 x 128      FP32            32/128 (W: 32/128^2)   DeepSeek-V3, Megatron
#     mxfp8       1 x 32             1 x 32         E8M0 = 2^e      8/32                   OCP MX, Blackwell
#
# A partial block at the end of a dimension holds what is left (as if zero-padded). torch._scaled_mm runs
# rowwise on CPU and Ada/Hopper, blockwise on Hopper only (cuBLASLt 12.9), MXFP8 on Blackwell only; elsewhere
# the emulation runs the same arithmetic. Why fine-grained: E4M3 keeps 4 significant bits across a normal range
# of 448 / 2^-6 = 28672, so a per-tensor scale set by an outlier m times the rest costs the rest nothing while
# it stays in that range; beyond it the rest falls into subnormals and zero, while a fine-grained scale confines
# the outlier to its row, tile or block (the demo's outlier sweep, `--all`, measures it). Which to choose:
# tensorwise where tensors are well behaved (cheapest; one all-reduce per GEMM under TP); rowwise for outlier
# tokens at 32/K bits; blockwise for outlier channels as well, the Hopper recipe; MXFP8 on Blackwell (native
# scales, exact power-of-two dequantisation); delayed only where the extra amax pass matters and no recomputation
# runs. backward="fp8" quantises the gradient to E5M2 (range over precision) for both backward GEMMs (dgrad
# reduces over N, wgrad over the tokens M), each operand blocked along its GEMM's reduced dimension in the
# recipe's granularity; "bf16" keeps the chapter's BF16 backward.
#
# FP8 under TP, per recipe. A block lying on one rank is local; a block whose elements sit on several ranks is
# MAX-agreed over them. Column-parallel (split="column"): K is whole on every rank, so all forward scales are
# local (no communication); row-parallel (split="row"): K is cut, so rowwise rows are always agreed (one
# all-reduce per operand), blockwise tiles and blocks only where K_local is not a multiple of 128, MXFP8 blocks
# only where it is not a multiple of 32. The FP8 backward's dgrad reduces over N, which a column-parallel layer
# cuts: there the same rule applies along N.

FINE_GRAINED = ("rowwise", "blockwise", "mxfp8")


class FP8Blocks(NamedTuple):
    """A 2-D tensor (rows, K) in FP8 with one scale per block: t ~= data / scale (of the element's block).

    K is the dimension the GEMM reduces over. `block` = (rows, K elements) per block, as used (a whole
    dimension resolved to its length; for a K split over ranks, the full K). `scale` (row blocks, K blocks
    this rank touches) holds FP32 multipliers (x * scale went into FP8). `phase`: where this rank's column 0
    sits inside its K block (0 unless a K split over ranks cuts blocks)."""
    data: torch.Tensor
    scale: torch.Tensor
    block: tuple
    phase: int = 0


def _k_blocks(t, bk, phase):
    """(rows, k) -> (rows, n, w): column j at slot phase + j of n blocks of bk, zero-padded at both ends (zeros
    change no amax and add nothing to a dot product). A t inside one block is that block, unpadded."""
    rows, k = t.shape
    n = -(-(phase + k) // bk)
    if n == 1:
        return t.reshape(rows, 1, k)
    if phase == 0 and k % bk == 0:
        return t.reshape(rows, n, bk)
    return F.pad(t, (phase, n * bk - phase - k)).view(rows, n, bk)


def _from_k_blocks(tb, k, phase):
    rows, n = tb.shape[:2]
    return tb.reshape(rows, k) if n == 1 else tb.reshape(rows, n * tb.shape[2])[:, phase:phase + k]


def _row_and_k_blocks(t, br, bk, phase=0):
    """t (rows, K) as one FP32 staging copy viewed (row blocks, br, K blocks, w): _k_blocks along K, and the rows
    zero-padded to a multiple of br."""
    rows = t.shape[0]
    tb = _k_blocks(t.detach().to(torch.float32, copy=True), bk, phase)
    row_blocks = -(-rows // br)
    if row_blocks * br != rows:
        tb = F.pad(tb, (0, 0, 0, 0, 0, row_blocks * br - rows))
    return tb.view(row_blocks, br, *tb.shape[1:])


def _from_row_and_k_blocks(tb, rows, k, phase=0):
    row_blocks, br, n, w = tb.shape
    return _from_k_blocks(tb.view(row_blocks * br, n, w)[:rows], k, phase)


def power_of_two_scale(amax, fp8_max):
    """MX scales: 2^-e with e = ceil(log2(amax / fp8_max)), the smallest X = 2^e with amax / X <= fp8_max, so the
    block's largest element lands in (fp8_max / 2, fp8_max] and none saturates. frexp of the (correctly
    rounded) ratio gives 2^(e-1) <= ratio < 2^e, so e is right or, where the true ratio is at most 2^(e-1) (an
    amax of fp8_max x 2^k), one too large: tested exactly (amax * 2^(1-e) is exact in FP32). Clamped to E8M0's
    exponents [-127, 127]."""
    _, e = torch.frexp(amax / fp8_max)
    e = torch.where(torch.ldexp(amax, 1 - e) <= fp8_max, e - 1, e)
    return torch.ldexp(torch.ones_like(amax), -e.clamp(-127, 127))


def quantize_blocks(t, block, dtype=E4M3, power_of_two=False, k_group=None):
    """t (rows, K) to FP8 with one scale per block of `block` = (rows, K elements) (None: the whole dimension):
    s_B = fp8_max / max_{B} |t| (or the power of two of power_of_two_scale), q = clamp(t s_B) rounded to dtype.

    Padding rule: a dimension that is not a multiple of its block ends in a partial block, whose amax is over
    the elements present: the same as zero-padding to the next multiple (zeros change no amax) and dropping
    the padding afterwards. _scaled_mm's scale tensors count blocks the same way (ceil(K / block)).

    k_group: the ranks holding the other pieces of K, this rank's being the rank-th K/P columns (a row-parallel
    layer's input and weight). A block that lies on one rank is local; when K_local is not a multiple of the
    block (rowwise: always, a row spans all ranks), the blocks that straddle ranks are MAX-agreed over k_group
    in one all-reduce of (row blocks x K blocks) amaxes, so every piece is rounded exactly as one process
    rounds the whole tensor. Every rank must hold the same K_local. Unlike the per-tensor scale (AMAX_EPS) a
    block's amax is floored only where its scale would overflow FP32 (fp8_max / 3.4e38): a block of tiny
    gradients keeps its own scale."""
    if t.dim() != 2:
        raise ValueError(f"t has shape {tuple(t.shape)}: quantize_blocks takes a 2-D (rows, K) tensor; "
                         "reshape it to (-1, K) first")
    rows, k = t.shape
    size = _group_size(k_group, "k_group")
    rank = dist.get_rank(k_group) if size > 1 else 0
    br = max(rows, 1) if block[0] is None else block[0]
    bk = max(k * size, 1) if block[1] is None else block[1]
    offset = rank * k  # this piece's first column in the full K
    phase = offset % bk
    fp8_max = torch.finfo(dtype).max
    tb = _row_and_k_blocks(t, br, bk, phase)
    row_blocks, n = tb.shape[0], tb.shape[2]
    amax = tb.abs().amax(dim=(1, 3))  # (row blocks, K blocks)
    if size > 1 and k % bk:  # blocks shared with other ranks
        first = offset // bk
        full = torch.zeros(row_blocks, -(-k * size // bk), device=t.device)
        full[:, first:first + n] = amax
        dist.all_reduce(full, op=dist.ReduceOp.MAX, group=k_group)
        fp8_log["amax:all_reduce"] += 1
        amax = full[:, first:first + n]
    amax = amax.clamp(min=fp8_max / torch.finfo(torch.float32).max)  # a zero block: the largest finite scale
    scale = power_of_two_scale(amax, fp8_max) if power_of_two else torch.full_like(amax, fp8_max) / amax
    q = tb.mul_(scale[:, None, :, None]).clamp_(-fp8_max, fp8_max).to(dtype)
    return FP8Blocks(_from_row_and_k_blocks(q, rows, k, phase).contiguous(), scale, (br, bk), phase)


def quantize_rowwise(t, dtype=E4M3, k_group=None):
    """The rowwise recipe (torchtitan's): one FP32 scale per row of t, s_i = fp8_max / max_k |t_ik|.

    In y = x W^T both operands are (rows, K) with K reduced, so that is one scale per token of x and one per
    output channel (row) of W, and both factor out of the K-sum:
        y_ij = sum_k (q_ik / s_i)(p_jk / r_j) = (sum_k q_ik p_jk) / (s_i r_j).
    Overhead 32 bits per row (32 / K bits per element). Under a K split (row-parallel) every rank holds a
    piece of every row: the row amaxes are MAX-agreed over k_group (rows elements)."""
    return quantize_blocks(t, (1, None), dtype, k_group=k_group)


def quantize_blockwise(t, block_rows=1, dtype=E4M3, k_group=None):
    """The blockwise recipe (DeepSeek-V3, section 3.3): one FP32 scale per block of block_rows x 128,
        s_(I, b) = fp8_max / max_{i in I, k in [128 b, 128 b + 128)} |t_ik|,
    1 x 128 tiles (block_rows=1) for activations and gradients, 128 x 128 blocks (block_rows=128) for weights
    (square, so W and W^T have the same blocks: the backward's W^T needs no other scales). The scales change
    along K, so the GEMM forms each 128-long slice of the K-sum alone and adds the slices, each times its two
    scales, in FP32: DeepSeek-V3's promotion of the partial sums to FP32 every 128 elements comes with it.
    Overhead: 32 bits per 128 elements (0.25 bits/element); weights 32 / 128^2. Under a K split, K_local a
    multiple of 128 puts every block on one rank (no communication); otherwise the cut blocks are agreed."""
    return quantize_blocks(t, (block_rows, 128), dtype, k_group=k_group)


def quantize_mxfp8(t, dtype=E4M3, k_group=None):
    """The MXFP8 recipe (OCP Microscaling Formats v1.0): blocks of 32 consecutive elements along K share one
    E8M0 scale, a power of two X = 2^e, and t_k ~= X q_k with q_k in E4M3 (E5M2 for gradients). Here
    e = ceil(log2(amax / fp8_max)) (power_of_two_scale: nothing saturates; the rounding-up rule of NVIDIA's
    MXFP8 recipe); the spec's example rule floor(log2 amax) - emax_elem (emax_elem = 8 for E4M3) puts the block
    amax in [256, 512) and saturates what lies past 448. Dividing by a power of two is exact, so the scales
    cost no rounding. Overhead 8 bits per 32 elements (0.25 bits/element). Under a K split, K_local a
    multiple of 32 keeps every block on one rank."""
    return quantize_blocks(t, (1, 32), dtype, power_of_two=True, k_group=k_group)


def quantize_operand(t, recipe, role="activation", dtype=E4M3, k_group=None):
    """t (rows, K) in a fine-grained recipe's granularity for its role in a GEMM that reduces over K: the
    blockwise recipe gives a "weight" 128 x 128 blocks and any other role (activation, gradient) 1 x 128 tiles."""
    if recipe == "rowwise":
        return quantize_rowwise(t, dtype, k_group)
    if recipe == "blockwise":
        return quantize_blockwise(t, 128 if role == "weight" else 1, dtype, k_group)
    if recipe == "mxfp8":
        return quantize_mxfp8(t, dtype, k_group)
    raise ValueError(f"recipe={recipe!r}: quantize_operand takes one of {FINE_GRAINED} (tensorwise and delayed "
                     "scales come from fp8_scale / delayed_scale)")


def block_scales(q):
    """The scale of every element of q.data, as a (rows, K) FP32 tensor."""
    rows, k = q.data.shape
    per_row = q.scale.repeat_interleave(q.block[0], dim=0)[:rows]  # (rows, K blocks)
    n = per_row.shape[1]
    return _from_k_blocks(per_row[:, :, None].expand(rows, n, k if n == 1 else q.block[1]), k, q.phase)


def dequantize_blocks(q):
    return q.data.float() / block_scales(q)
# ----------------------------------------------------------------------------------------------------
# FP8 GEMMs: torch._scaled_mm where torch supports the layout on the device, else the same arithmetic emulated
# ----------------------------------------------------------------------------------------------------

def _swizzle_32_4_4(scales):
    """cuBLAS's layout for 1-D block scales (SWIZZLE_32_4_4): the (rows, K blocks) matrix padded to 128 x 4
    tiles (padding 1.0), tiles in row-major order; inside a tile, row r and column c sit at
    (r % 32) * 16 + (r // 32) * 4 + c."""
    rows, cols = scales.shape
    padded = torch.ones(-(-rows // 128) * 128, -(-cols // 4) * 4, dtype=scales.dtype, device=scales.device)
    padded[:rows, :cols] = scales
    return rearrange(padded, "(rb r4 r32) (cb c4) -> (rb cb r32 r4 c4)", r4=4, r32=32, c4=4).contiguous()


def _scaled_mm_eligible(a, b, recipe):
    """The shapes torch._scaled_mm takes: every dimension a multiple of 16; blocks along K whole (no partial
    block, no K split that cuts a block); the 128 x 128 weight blocks whole along N too."""
    (m, k), n = a.data.shape, b.data.shape[0]
    if m % 16 or k % 16 or n % 16:
        return False
    if recipe == "rowwise":
        return a.block[0] == b.block[0] == 1 and a.scale.shape[1] == b.scale.shape[1] == 1
    return a.phase == 0 and k % a.block[1] == 0 and (b.block[0] == 1 or n % b.block[0] == 0)


def _scaled_mm_blocks(a, b, recipe, out_dtype):
    """a @ b^T through torch._scaled_mm (torch.nn.functional.scaled_mm for the block layouts), with the scale
    layouts that torch 2.13's _meta_registrations.py and ScaledBlas.cpp check; the scales it takes are
    dequantisation factors (1 / ours):
      rowwise    scale_a (M, 1), scale_b (1, N), FP32, contiguous;
      blockwise  a BlockWise1x128: (M, K/128) outer-dim-major (strides (1, M)); a weight b BlockWise128x128:
                 (round_up(K/128, 4), N/128) with strides (1, round_up(K/128, 4)); a 1 x 128 b (the backward's
                 wgrad) BlockWise1x128: (N, K/128) with strides (1, N);
      mxfp8      BlockWise1x32, E8M0 scales in cuBLAS's swizzled layout (SWIZZLE_32_4_4), each matrix's."""
    (m, k), n = a.data.shape, b.data.shape[0]
    mat_b = b.data.t()  # (K, N), column-major
    inv_a, inv_b = a.scale.reciprocal(), b.scale.reciprocal()
    if recipe == "rowwise":
        return torch._scaled_mm(a.data, mat_b, scale_a=inv_a.reshape(m, 1).contiguous(),
                                scale_b=inv_b.reshape(1, n).contiguous(), out_dtype=out_dtype)
    kind, swizzle = F.ScalingType, F.SwizzleType
    if recipe == "blockwise":
        scale_a = inv_a.t().contiguous().t()
        if b.block[0] == 1:
            return F.scaled_mm(a.data, mat_b, scale_a, kind.BlockWise1x128, inv_b.t().contiguous().t(),
                               kind.BlockWise1x128, output_dtype=out_dtype)
        k4 = -(-inv_b.shape[1] // 4) * 4
        scale_b = torch.ones(inv_b.shape[0], k4, device=inv_b.device)
        scale_b[:, :inv_b.shape[1]] = inv_b
        return F.scaled_mm(a.data, mat_b, scale_a, kind.BlockWise1x128, scale_b.t(), kind.BlockWise128x128,
                           output_dtype=out_dtype)
    e8m0 = torch.float8_e8m0fnu  # powers of two: exact
    return F.scaled_mm(a.data, mat_b, _swizzle_32_4_4(inv_a.to(e8m0)), kind.BlockWise1x32,
                       _swizzle_32_4_4(inv_b.to(e8m0)), kind.BlockWise1x32, swizzle.SWIZZLE_32_4_4,
                       swizzle.SWIZZLE_32_4_4, output_dtype=out_dtype)


def fp8_block_matmul(a, b, out_dtype, use_scaled_mm=True, recipe=None):
    """a @ b^T for FP8Blocks a (M, K) and b (N, K) blocked alike along K (the same block length and phase):
        y_mn = sum_j (sum_{k in K block j} qa_mk qb_nk) / (sa_(m, j) sb_(n, j)).
    The emulation forms each block's partial sum of exact FP8 products in FP32, multiplies it by its two
    scales and adds the blocks in FP32 (one K block, the rowwise case: one GEMM and one rescale).
    torch._scaled_mm runs it instead where torch 2.13 supports `recipe`'s layout on the device."""
    if a.block[1] != b.block[1] or a.phase != b.phase or a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"a and b are blocked differently along K (blocks {a.block} and {b.block}, phases "
                         f"{a.phase} and {b.phase}): quantise both with the same recipe and k_group")
    if (use_scaled_mm and recipe in FINE_GRAINED and _scaled_mm_eligible(a, b, recipe)
            and scaled_mm_supports(recipe, a.data.device)):
        fp8_log["gemm:scaled_mm"] += 1
        return _scaled_mm_blocks(a, b, recipe, out_dtype)
    fp8_log["gemm:emulated"] += 1
    return _emulated_block_gemm(a, b, a.scale.reciprocal(), b.scale.reciprocal()).to(out_dtype)


def _emulated_block_gemm(a, b, factor_a, factor_b):
    """sum_j (sum_{k in K block j} a_mk b_nk) fa_(m, j) fb_(n, j) in FP32, for a (M, K) and b (N, K) blocked alike
    along K and factor_* (row blocks, K blocks) the dequantisation factor of each block: each block's partial sum
    of exact products, times its two factors, the blocks added in FP32."""
    (m, k), n = a.data.shape, b.data.shape[0]
    qa, qb = _k_blocks(a.data.float(), a.block[1], a.phase), _k_blocks(b.data.float(), b.block[1], b.phase)
    partial = torch.bmm(qa.transpose(0, 1), qb.permute(1, 2, 0))  # (K blocks, M, N), exact products, FP32 sums
    inv_a = factor_a.repeat_interleave(a.block[0], dim=0)[:m].t()
    inv_b = factor_b.repeat_interleave(b.block[0], dim=0)[:n].t()
    return (partial * inv_a[:, :, None] * inv_b[:, None, :]).sum(0)


def scaled_mm_supports(recipe, device):
    """Whether torch 2.13's _scaled_mm runs this recipe's scale layout on the device. CUDA, from torch 2.13's
    ScaledBlas.cpp: tensorwise and rowwise on compute capability 8.9+ (CUTLASS below 9.0 or cuBLASLt < 12.9);
    blockwise (1x128 / 128x128, "DeepSeek style") on 9.0 only (Hopper), with cuBLASLt >= 12.9; MXFP8 (1x32,
    E8M0) on 10.0+ (Blackwell). CPU: probed once by a small call (torch 2.13's CPU kernel takes tensorwise and
    rowwise scales; it refuses blockwise scales and swizzled MX scales)."""
    recipe = "tensorwise" if recipe == "delayed" else recipe
    if recipe == "tensorwise":
        return scaled_mm_available(device)
    if device.type == "cuda":  # CUDA-only: the device's compute capability
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            return False
        cublas = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
        return {"rowwise": True, "blockwise": capability[0] == 9 and cublas >= (12, 9),
                "mxfp8": capability >= (10, 0) and cublas >= (12, 8)}.get(recipe, False)
    if device.type != "cpu":
        return False
    if recipe not in _SCALED_MM_ON_CPU:
        try:
            ones = torch.ones(128, 128)
            a = quantize_operand(ones, recipe, "activation")
            _scaled_mm_blocks(a, quantize_operand(ones, recipe, "weight"), recipe, torch.float32)
            _SCALED_MM_ON_CPU[recipe] = True
        except (RuntimeError, NotImplementedError, ValueError):
            _SCALED_MM_ON_CPU[recipe] = False
    return _SCALED_MM_ON_CPU[recipe]


# ----------------------------------------------------------------------------------------------------
# The FP8 backward: E5M2 gradients in both backward GEMMs
# ----------------------------------------------------------------------------------------------------

def fp8_backward_scales(grad_out, x, weight, amax_group=None, x_scale=None, w_scale=None):
    """The per-tensor scales of the backward GEMMs (tensorwise, delayed): grad_out's E5M2 scale from its amax,
    MAX-reduced over amax_group (the ranks hold pieces of one gradient, or the same one), and x's and W's E4M3
    scales (the forward's when given, else agreed again). A split backward (zero bubble) takes them in B, so
    that its deferred W-GEMM communicates nothing."""
    amax_g = amax_of(grad_out).reshape(1)
    if _group_size(amax_group, "amax_group") > 1:
        dist.all_reduce(amax_g, op=dist.ReduceOp.MAX, group=amax_group)
        fp8_log["amax:all_reduce"] += 1
    if x_scale is None or w_scale is None:
        amax = agreed_amax(x, weight, amax_group)
        x_scale, w_scale = fp8_scale(amax[0]), fp8_scale(amax[1])
    return fp8_scale(amax_g[0], E5M2), x_scale, w_scale


def fp8_backward_gemms(grad_out, x, weight, recipe="tensorwise", amax_group=None, split=None, use_scaled_mm=True,
                       x_scale=None, w_scale=None, needs=(True, True), scales=None):
    """The two backward GEMMs of y = x W^T in FP8 with E5M2 gradients (range over precision), for a 2-D
    grad_out G (M, N), x (M, K) and weight (N, K); returns (grad_x, grad_w), None where `needs` says so:
        dgrad  grad_x = G W      reduces over N: G (M, N) and W^T (K, N) blocked along N
        wgrad  grad_W = G^T x    reduces over M: G^T (N, M) and x^T (K, M) blocked along M (the tokens)
    Per recipe: tensorwise and delayed quantise G with its current amax (MAX over amax_group) and x, W with the
    forward's scales (x_scale, w_scale; agreed again when None); rowwise scales every row of G, W^T, G^T, x^T;
    blockwise gives G and G^T, x^T 1 x 128 tiles and W^T 128 x 128 blocks (W's own); MXFP8 blocks of 32.
    Under TP, dgrad's N is cut between ranks in a column-parallel layer (split="column": the cut blocks are
    agreed over amax_group); M is never split by TP. x and W are re-quantised from the saved high-precision
    tensors along the new reduction dimension. `scales`: fp8_backward_scales' (g, x, W) scales, taken earlier
    (then this call communicates nothing for a per-tensor recipe; a fine-grained wgrad never does)."""
    g = grad_out
    grad_x = grad_w = None
    if recipe in ("tensorwise", "delayed"):
        g_scale, x_scale, w_scale = scales or fp8_backward_scales(g, x, weight, amax_group, x_scale, w_scale)
        if needs[0]:
            g8, _ = quantize_fp8(g, E5M2, g_scale)
            w_t8, _ = quantize_fp8(weight.t().contiguous(), scale=w_scale)
            grad_x = fp8_matmul(g8, g_scale, w_t8, w_scale, x.dtype, use_scaled_mm)
        if needs[1]:
            g_t8, _ = quantize_fp8(g.t().contiguous(), E5M2, g_scale)
            x_t8, _ = quantize_fp8(x.t().contiguous(), scale=x_scale)
            grad_w = fp8_matmul(g_t8, g_scale, x_t8, x_scale, weight.dtype, use_scaled_mm)
    else:
        n_group = amax_group if split == "column" else None
        if needs[0]:
            grad_x = fp8_block_matmul(quantize_operand(g, recipe, "gradient", E5M2, n_group),
                                      quantize_operand(weight.t().contiguous(), recipe, "weight", E4M3, n_group),
                                      x.dtype, use_scaled_mm, recipe)
        if needs[1]:
            grad_w = fp8_block_matmul(quantize_operand(g.t().contiguous(), recipe, "gradient", E5M2),
                                      quantize_operand(x.t().contiguous(), recipe, "activation", E4M3),
                                      weight.dtype, use_scaled_mm, recipe)
    fp8_log["gemm:backward"] += sum(needs)
    return grad_x, grad_w


# ----------------------------------------------------------------------------------------------------
# The FP8 linear with every recipe: fine-grained scales, the FP8 backward, and what TP's split cuts
# ----------------------------------------------------------------------------------------------------

FP8_RECIPES = PER_TENSOR_RECIPES + FINE_GRAINED  # in the order the trainer's flags list them
FP8_BACKWARDS = ("bf16", "fp8")


class _GemmSpec(NamedTuple):
    recipe: str
    x_scale: torch.Tensor  # per-tensor scales (tensorwise, delayed); None for the fine-grained recipes
    w_scale: torch.Tensor
    use_scaled_mm: bool
    backward: str
    group: object          # the TP group (amax_group)
    split: str             # None, "column" or "row": which dimension of this layer the group splits


def _check_fine_grained_options(recipe, backward, split, amax_group):
    if recipe not in FP8_RECIPES:
        raise ValueError(f"recipe={recipe!r}: use one of {FP8_RECIPES}")
    if backward not in FP8_BACKWARDS:
        raise ValueError(f"backward={backward!r}: use one of {FP8_BACKWARDS} ('bf16': BF16 GEMMs on the saved "
                         "tensors; 'fp8': E5M2 gradients)")
    if split not in (None, "column", "row"):
        raise ValueError(f"split={split!r}: use None, 'column' (the group splits the output rows of W) or 'row' "
                         "(it splits K, the input columns of W and the last dimension of x)")
    if recipe not in PER_TENSOR_RECIPES and split is None and _group_size(amax_group, "amax_group") > 1:
        raise ValueError(f"split=None with an amax_group of several ranks: for the {recipe} recipe say how the "
                         "group splits this layer, split='column' (blocks along K are local) or split='row' "
                         "(blocks along K are cut between ranks and agreed)")


def _block_product(x2, weight, spec):
    """The forward GEMM under a fine-grained recipe; a row-parallel layer cuts K, so its blocks are agreed."""
    k_group = spec.group if spec.split == "row" else None
    return fp8_block_matmul(quantize_operand(x2, spec.recipe, "activation", E4M3, k_group),
                            quantize_operand(weight, spec.recipe, "weight", E4M3, k_group),
                            x2.dtype, spec.use_scaled_mm, spec.recipe)


class _FineGrainedFP8Function(torch.autograd.Function):
    """The chapter's _FP8LinearFunction for every recipe and backward: the forward GEMM per-tensor (the chapter's
    product) or blockwise, the backward GEMMs in BF16 (the chapter's) or FP8 (fp8_backward_gemms)."""

    @staticmethod
    def forward(ctx, x, weight, spec):
        ctx.save_for_backward(x, weight)  # high precision: the backward re-quantises (fp8) or not (bf16)
        ctx.spec = spec
        x2 = x.reshape(-1, x.shape[-1])
        if spec.recipe in PER_TENSOR_RECIPES:
            y = _per_tensor_product(x2, weight, spec.x_scale, spec.w_scale, spec.use_scaled_mm)
        else:
            y = _block_product(x2, weight, spec)
        fp8_log["gemm:count"] += 1
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        spec, needs = ctx.spec, ctx.needs_input_grad[:2]
        g2, x2 = grad_out.reshape(-1, weight.shape[0]), x.reshape(-1, x.shape[-1])
        if spec.backward == "fp8":
            grad_x, grad_w = fp8_backward_gemms(g2, x2, weight, spec.recipe, spec.group, spec.split,
                                                spec.use_scaled_mm, spec.x_scale, spec.w_scale, needs)
        else:
            grad_x, grad_w = _bf16_backward(g2, x2, weight, needs)
        return None if grad_x is None else grad_x.reshape(x.shape), grad_w, None


def fine_grained_fp8_linear(x, weight, bias=None, amax_group=None, use_scaled_mm=True, *, recipe="tensorwise",
                            backward="bf16", split=None, amax_history=None, record_amax=True):
    """fp8_linear for every recipe of FP8_RECIPES and backward of FP8_BACKWARDS: the fine-grained recipes scale
    blocks (rowwise, blockwise, mxfp8), backward="fp8" quantises the gradients to E5M2 for both backward GEMMs.
    `split` (None, "column", "row") says how amax_group (the TP group) cuts this layer, which a block recipe
    under a group needs. The per-tensor recipes with the BF16 backward are the chapter's fp8_linear itself."""
    _check_fine_grained_options(recipe, backward, split, amax_group)
    if recipe in PER_TENSOR_RECIPES and backward == "bf16":
        return fp8_linear(x, weight, bias, amax_group, use_scaled_mm, recipe=recipe, amax_history=amax_history,
                          record_amax=record_amax)
    x_scale = w_scale = None
    if recipe in PER_TENSOR_RECIPES:
        x_scale, w_scale = per_tensor_scales(x, weight, recipe, amax_group, amax_history, record_amax)
    spec = _GemmSpec(recipe, x_scale, w_scale, use_scaled_mm, backward, amax_group, split)
    y = _FineGrainedFP8Function.apply(x, weight, spec)
    return y if bias is None else y + bias.to(y.dtype)


class FineGrainedFP8Linear(FP8Linear):
    """FP8Linear through fine_grained_fp8_linear: any recipe of FP8_RECIPES, backward="bf16" or "fp8", and
    `split` under a TP amax_group."""

    def __init__(self, in_features, out_features, bias=True, delayed_scaling=False, amax_history_len=16,
                 use_scaled_mm=True, amax_group=None, device=None, dtype=None, *, recipe=None, backward="bf16",
                 split=None):
        if delayed_scaling and recipe not in (None, "delayed"):
            raise ValueError(f"delayed_scaling=True with recipe={recipe!r}: delayed_scaling is recipe='delayed'; "
                             "pass one of them")
        recipe = recipe or ("delayed" if delayed_scaling else "tensorwise")
        _check_fine_grained_options(recipe, backward, split, amax_group)
        # the chapter's layer keeps the weights and the amax history (a per-tensor recipe); this one's recipe after
        super().__init__(in_features, out_features, bias, amax_history_len=amax_history_len,
                         use_scaled_mm=use_scaled_mm, amax_group=amax_group, device=device, dtype=dtype,
                         recipe="delayed" if recipe == "delayed" else "tensorwise")
        self.recipe, self.backward, self.split = recipe, backward, split

    def forward(self, x):
        return fine_grained_fp8_linear(x, self.weight, self.bias, self.amax_group, self.use_scaled_mm,
                                       recipe=self.recipe, backward=self.backward, split=self.split,
                                       amax_history=self.amax_history if self.delayed_scaling else None,
                                       record_amax=self.training)


# ----------------------------------------------------------------------------------------------------
# FP8: the accumulation inside the GEMM (why DeepSeek-V3 promotes partial sums to FP32)
# ----------------------------------------------------------------------------------------------------
#
# Hopper's FP8 tensor cores sum the products with about 14 significant bits (DeepSeek-V3 3.3.2): a long K-sum
# grows, its spacing grows with it, and later products lose their low bits. DeepSeek-V3 adds the partial sum
# into FP32 every 128 elements. `limited_precision_sum` emulates both (the demo's `--all` prints the errors).

def round_to_bits(v, bits, rounding="nearest"):
    """v (numpy float64) rounded to `bits` significant bits: to nearest (ties to even), or toward zero."""
    mantissa, exponent = np.frexp(v)
    scaled = mantissa * 2.0 ** bits
    return np.ldexp(np.rint(scaled) if rounding == "nearest" else np.trunc(scaled), exponent - bits)


def limited_precision_sum(products, bits=14, promote_every=None, rounding="nearest"):
    """The sums of the rows of `products` (batch, K), taken one element at a time in an accumulator of `bits`
    significant bits: Hopper's FP8 tensor cores keep about 14 (DeepSeek-V3, section 3.3.2). With
    promote_every=N the accumulator is added into an FP32 total and restarted every N elements (DeepSeek-V3
    promotes every 128 on the CUDA cores). FP8 x FP8 products are exact (8 significant bits), and float64
    holds every intermediate exactly, so the only roundings are the accumulator's (and the FP32 total's)."""
    products = np.asarray(products, dtype=np.float64)
    acc, total = np.zeros(products.shape[0]), np.zeros(products.shape[0], dtype=np.float32)
    for k in range(products.shape[1]):
        acc = round_to_bits(acc + products[:, k], bits, rounding)
        if promote_every and (k + 1) % promote_every == 0:
            total = total + acc.astype(np.float32)  # an FP32 addition
            acc = np.zeros_like(acc)
    return total.astype(np.float64) + acc if promote_every else acc


def fp8_accumulation_errors(ks=(1024, 4096, 16384, 65536), bits=14, promote_every=128, batch=8, seed=0,
                            rounding="nearest"):
    """For each K: the median relative error against float64 of K-long dot products of E4M3 values in [0, 1)
    (positive, as activations after a ReLU-like gate times positive weights: the sum grows with K, the worst
    case for a short accumulator), summed with `bits` bits, without and with promotion to FP32."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for k in ks:
        a, b = (torch.rand(batch, k, generator=gen).to(E4M3).double() for _ in range(2))
        products = (a * b).numpy()
        exact = products.sum(axis=1)
        err = lambda s: float(np.median(np.abs(s - exact) / np.abs(exact)))
        rows.append({"K": k, "plain": err(limited_precision_sum(products, bits, None, rounding)),
                     "promoted": err(limited_precision_sum(products, bits, promote_every, rounding))})
    return rows


# ----------------------------------------------------------------------------------------------------
# FP8: why fine-grained scaling (outliers)
# ----------------------------------------------------------------------------------------------------

def outlier_activations(magnitude, tokens=256, channels=1024, outlier_channels=4, outlier_tokens=8, seed=0):
    """Gaussian activations (tokens, channels) whose `outlier_channels` channels are `magnitude` times larger in
    `outlier_tokens` tokens (the massive activations of Sun et al. 2024 sit in a few fixed channels of a few
    tokens); returns (x, mask of the ordinary elements)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, channels, generator=gen)
    rows = torch.randperm(tokens, generator=gen)[:outlier_tokens]
    cols = torch.randperm(channels, generator=gen)[:outlier_channels]
    x[rows[:, None], cols] *= magnitude
    ordinary = torch.ones_like(x, dtype=torch.bool)
    ordinary[rows[:, None], cols] = False
    return x, ordinary


def recipe_errors(x, weight, recipe, ordinary=None):
    """One recipe on x (activations) and weight: the SQNR of x's quantisation (and of its ordinary elements),
    the mean per-token relative error of the FP8 GEMM x W^T against float64 (each token's output row is
    normalised downstream, so each row's error is what a token sees), and the scales' bits per element of x
    and of the weight (32 per FP32 scale, 8 per E8M0 one)."""
    if recipe == "tensorwise":
        (qx, sx), (qw, sw) = quantize_fp8(x), quantize_fp8(weight)
        x_hat = dequantize_fp8(qx, sx)
        y = fp8_matmul(qx, sx, qw, sw, torch.float32)
        bits = (32 / x.numel(), 32 / weight.numel())
    else:
        qx, qw = quantize_operand(x, recipe, "activation"), quantize_operand(weight, recipe, "weight")
        x_hat = dequantize_blocks(qx)
        y = fp8_block_matmul(qx, qw, torch.float32, recipe=recipe)
        scale_bits = 8 if recipe == "mxfp8" else 32
        bits = (qx.scale.numel() * scale_bits / x.numel(), qw.scale.numel() * scale_bits / weight.numel())
    exact = x.double() @ weight.double().t()
    y = y.double()
    ordinary = torch.ones_like(x, dtype=torch.bool) if ordinary is None else ordinary
    return {"sqnr_db": sqnr_db(x, x_hat), "sqnr_ordinary_db": sqnr_db(x[ordinary], x_hat[ordinary]),
            "gemm_error": ((y - exact).norm(dim=1) / exact.norm(dim=1)).mean().item(), "scale_bits": bits}


def sqnr_db(x, x_hat):
    return 10 * math.log10((x.double() ** 2).sum().item() / ((x.double() - x_hat.double()) ** 2).sum().item())


# ----------------------------------------------------------------------------------------------------
# NVFP4: 4-bit training numerics (E2M1 values, E4M3 scales per 16 elements, an FP32 scale per tensor)
# ----------------------------------------------------------------------------------------------------
#
# The format. An E2M1 number has a sign, 2 exponent bits and 1 mantissa bit: the magnitudes 0, 0.5 (the one
# subnormal), 1, 1.5, 2, 3, 4, 6, so between neighbours the spacing is 0.5 below 2, 1 in [2, 4] and 2 in [4, 6].
# With only 8 magnitudes a scale per tensor cannot serve: every 16 consecutive elements along the GEMM's
# reduced dimension K share one E4M3 scale, and the tensor has one FP32 scale above those, chosen so that the
# block scales fit E4M3's range:
#
#     s_tensor = amax_tensor / (6 * 448),  s_block = E4M3(amax_block / 6 / s_tensor) <= 448,
#     q = E2M1(x / (s_block s_tensor)) (saturating at +-6),  x ~= q s_block s_tensor.
#
# 4 bits per element plus 8 per 16 (4.5 bits; FP8 takes 8.25 with MXFP8's scales). Rounding to nearest (ties
# to the even code) errs by at most half the local spacing times the block's scale: |x - x^| <= S/4 where
# |x| / S < 2, S/2 below 4 and S above (S = s_block s_tensor ~ amax_block / 6), i.e. at most ~amax_block / 6.
# E4M3's rounding of s_block may leave the block's largest element at up to 6 / (1 - 2^-4) = 6.4 before the
# clamp to 6, an error of 0.4 S, inside that bound; a block whose scale falls below E4M3's normal range
# (amax_block < 2^-6 / 448 of the tensor's amax) is rounded more coarsely.
#
# The recipe (NVIDIA's NVFP4 pretraining recipe). Activations and gradients take 1 x 16 blocks along K; weights
# take 16 x 16 blocks, square, so the backward's W^T reuses W's values and scales, transposed (quantising W^T
# anew would round along the other dimension: the forward and backward would see two different weights). The
# weight-gradient GEMM grad_W = G^T x reduces over the tokens, where a few outlier tokens set a block's scale
# and flush its other 15 elements toward zero: both of its operands are multiplied, along the tokens, by a
# 16 x 16 random Hadamard matrix R = D H_16 / 4 (H_16 Sylvester's, D a seeded random sign diagonal, the same on
# every rank), which spreads an outlier over its block; R is orthogonal, so (G^T R)(x^T R)^T = G^T x exactly
# before rounding. Gradients are rounded stochastically: between E2M1 neighbours lo < v < hi, up with
# probability (v - lo) / (hi - lo), so that E[round(v)] = v and the rounding errors average out over the many
# small updates of training instead of adding up with one sign; the draws come from a seeded torch.Generator
# (reproducible; a run seeds one per step so that the steps differ). Everything else rounds to nearest.
# Practitioners keep the last few blocks and the LM head in BF16 (the loss is most sensitive there).
#
# Under tensor parallelism the shards of x, W and G are one tensor each: `amax_group` MAX-agrees each FP32 tensor
# scale (nvfp4_amaxes: one all-reduce in the forward, one in the backward), and where the 16-blocks lie whole on
# each rank the shards then quantise as the whole tensor does. `uniforms` hands the stochastic rounding draws made
# by the caller, who can draw them for the whole tensor and keep its shard: the rounding then ignores the layout.
#
# quantize_nvfp4 returns the E2M1 values as an FP32 tensor holding only E2M1 values (the emulation computes
# with them exactly); pack_e2m1 packs them two to a byte for the FP4 tensor cores (Blackwell, compute capability
# 10.0+), which torch._scaled_mm drives there; everywhere else, the CPU included, nvfp4_matmul emulates the
# same arithmetic: each 16-long block's partial sum of exact E2M1 products (exact in FP32) times the two E4M3
# block scales (their product exact too), the blocks added in FP32, times the two tensor scales. fp8_log counts
# the path each GEMM took under "nvfp4:scaled_mm" and "nvfp4:emulated".

NVFP4_RECIPE = "nvfp4"  # listed beside FP8_RECIPES by a caller; not one of them (fp8_linear does not take it)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes; the index is the 3-bit code
E2M1_MAX, NVFP4_BLOCK = 6.0, 16


class NVFP4(NamedTuple):
    """A 2-D tensor (rows, K) in NVFP4: t ~= data * scale (of the element's block) * tensor_scale.

    data: FP32, every element an E2M1 value; scale: (row blocks, K blocks) E4M3 block scales; block: (1, 16)
    or (16, 16); phase: 0 (the fields FP8Blocks shares, so its helpers read both); tensor_scale: FP32, 0-d."""
    data: torch.Tensor
    scale: torch.Tensor
    block: tuple
    phase: int
    tensor_scale: torch.Tensor


def round_to_e2m1(x, stochastic=False, generator=None, uniforms=None):
    """x rounded to E2M1 (FP32 result), saturating at +-6: to nearest with ties to the even code (0, 1, 2, 4),
    or stochastically, up to the upper neighbour with probability (|x| - lo) / (hi - lo) from `generator` (torch's
    default generator when None), or, given `uniforms` (x's shape, U[0, 1)), where uniforms < that fraction. Both
    are exact: |x| - lo is exact in FP32 (Sterbenz: lo <= |x| <= 2 lo, or lo = 0) and hi - lo is a power of two."""
    grid = torch.tensor(E2M1_VALUES, device=x.device)
    magnitude = x.float().abs().clamp(max=E2M1_MAX).contiguous()  # searchsorted reads it contiguous
    lower = (torch.searchsorted(grid, magnitude, right=True) - 1).clamp(max=len(grid) - 2)
    lo, hi = grid[lower], grid[lower + 1]
    fraction = (magnitude - lo) / (hi - lo)
    if stochastic:
        if uniforms is None:
            uniforms = torch.rand(magnitude.shape, generator=generator, device=x.device)
        up = uniforms < fraction
    else:
        up = (fraction > 0.5) | ((fraction == 0.5) & (lower % 2 == 1))  # a tie goes to the even code, lower + 1
    return torch.where(up, hi, lo).copysign(x.float())


def quantize_nvfp4(t, block=(1, NVFP4_BLOCK), stochastic=False, generator=None, *, tensor_amax=None,
                   uniforms=None):
    """t (rows, K) to NVFP4 with blocks of `block` = (1, 16) (activations, gradients) or (16, 16) (weights),
    anchored at (0, 0); a partial block at the end holds what is left (as if zero-padded, as quantize_blocks).
    stochastic: round the E2M1 values stochastically (gradients), from `generator`, or from `uniforms` (t's shape,
    U[0, 1): drawn by the caller, e.g. for a whole tensor of which t is a shard). tensor_amax: the amax that sets
    the FP32 tensor scale (nvfp4_amaxes: agreed over the ranks holding shards of one tensor); None: t's own."""
    if t.dim() != 2:
        raise ValueError(f"t has shape {tuple(t.shape)}: quantize_nvfp4 takes a 2-D (rows, K) tensor")
    if tuple(block) not in ((1, NVFP4_BLOCK), (NVFP4_BLOCK, NVFP4_BLOCK)):
        raise ValueError(f"block={block!r}: NVFP4 takes (1, 16) (activations, gradients) or (16, 16) (weights)")
    rows, k = t.shape
    tb = _row_and_k_blocks(t.contiguous(), block[0], NVFP4_BLOCK)  # a transpose (W^T, G^T) copied once
    amax = tb.abs().amax(dim=(1, 3))  # (row blocks, K blocks)
    e4m3_max = torch.finfo(E4M3).max
    if tensor_amax is None:
        tensor_amax = amax.max() if amax.numel() else torch.zeros((), device=t.device)
    tensor_scale = tensor_amax.clamp(min=AMAX_EPS) / (E2M1_MAX * e4m3_max)
    scale = (amax / E2M1_MAX / tensor_scale).clamp(max=e4m3_max).to(E4M3)
    decode = (scale.float() * tensor_scale)[:, None, :, None]
    scaled = torch.where(decode > 0, tb / decode, 0.0)  # a block whose scale is 0 in E4M3 holds zeros
    if uniforms is not None:
        uniforms = _row_and_k_blocks(uniforms, block[0], NVFP4_BLOCK)
    q = round_to_e2m1(scaled, stochastic, generator, uniforms)
    return NVFP4(_from_row_and_k_blocks(q, rows, k).contiguous(), scale, tuple(block), 0, tensor_scale)


def dequantize_nvfp4(q):
    """q.data * s_block * s_tensor, each block's factor formed once in FP32 (as quantize_nvfp4 divided by it)."""
    return q.data * block_scales(q._replace(scale=q.scale.float() * q.tensor_scale))


def transpose_nvfp4(q):
    """q^T of a 16 x 16-blocked q: the same values and scales, transposed (the backward's W^T)."""
    if q.block != (NVFP4_BLOCK, NVFP4_BLOCK):
        raise ValueError(f"block {q.block}: only square 16 x 16 blocks transpose into blocks along the new K")
    return q._replace(data=q.data.t(), scale=q.scale.t())


def random_hadamard(n=NVFP4_BLOCK, seed=0, dtype=torch.float32, device=None):
    """R = D H_n / sqrt(n): Sylvester's Hadamard matrix (H_1 = [1], H_2m = [[H, H], [H, -H]]), its rows signed
    by a random +-1 drawn from `seed` (a CPU generator: every rank draws the same). R R^T = I."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"n={n}: Sylvester's construction needs a power of two (16 for NVFP4)")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    signs = torch.randint(0, 2, (n, 1), generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2 - 1
    return (signs * h / math.sqrt(n)).to(dtype=dtype, device=device)


def hadamard_along_k(t, hadamard):
    """t (rows, K) with each n-long block along K multiplied by the n x n `hadamard`: (rows, K rounded up to n),
    zero-padded (both operands of a GEMM padded alike: the padding adds nothing to the sum)."""
    rows, k = t.shape
    n = hadamard.shape[0]
    blocks = F.pad(t, (0, -k % n)).reshape(rows, -1, n)
    return (blocks @ hadamard.to(t.dtype)).reshape(rows, -1)


def pack_e2m1(values):
    """E2M1 values (..., K), K even, to uint8 (..., K/2): code = sign << 3 | index of |v| in E2M1_VALUES, element
    2i in the low nibble and 2i + 1 in the high one (the layout of torch.float4_e2m1fn_x2)."""
    grid = torch.tensor(E2M1_VALUES, device=values.device)
    codes = torch.searchsorted(grid, values.abs().contiguous()).to(torch.uint8)
    codes |= torch.signbit(values).to(torch.uint8) << 3
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def nvfp4_scaled_mm_supported(device):
    """FP4 tensor cores: CUDA compute capability 10.0+ (Blackwell) with CUDA 12.8+. Never probed on the CPU (torch
    2.13 has no CPU kernel for FP4)."""
    if device.type != "cuda" or not hasattr(torch, "float4_e2m1fn_x2"):
        return False
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    return torch.cuda.get_device_capability(device) >= (10, 0) and cuda >= (12, 8)


def _scaled_mm_nvfp4(a, b, out_dtype):
    """a @ b^T on the FP4 tensor cores: the E2M1 values packed (torch.float4_e2m1fn_x2, K/2 bytes a row), the E4M3
    block scales one per row and 16 elements in cuBLAS's swizzled layout (as MXFP8's), the tensor scales applied
    to the FP32 output."""
    def operand(q, rows):
        per_row = q.scale.float().repeat_interleave(q.block[0], dim=0)[:rows]  # (rows, K/16), exact
        return pack_e2m1(q.data).view(torch.float4_e2m1fn_x2), _swizzle_32_4_4(per_row).to(E4M3)
    (a4, sa), (b4, sb) = operand(a, a.data.shape[0]), operand(b, b.data.shape[0])
    y = torch._scaled_mm(a4, b4.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    return (y * (a.tensor_scale * b.tensor_scale)).to(out_dtype)


def nvfp4_matmul(a, b, out_dtype=torch.float32, use_scaled_mm=True):
    """a @ b^T for NVFP4 a (M, K) and b (N, K), both blocked along K in 16s (b may be 16 x 16-blocked):
        y_mn = s_a s_b sum_j (sum_{k in block j} qa_mk qb_nk) sa_(m, j) sb_(n, j),
    in FP32 (emulated: the same arithmetic as fp8_block_matmul's, with E4M3 factors); through torch._scaled_mm
    only where the device has FP4 tensor cores and the shapes fit (M, N multiples of 16, K of 32)."""
    if a.block[1] != NVFP4_BLOCK or b.block[1] != NVFP4_BLOCK or a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"a and b must be NVFP4 blocked along the same K (shapes {tuple(a.data.shape)} and "
                         f"{tuple(b.data.shape)}, blocks {a.block} and {b.block})")
    (m, k), n = a.data.shape, b.data.shape[0]
    if use_scaled_mm and not (m % 16 or n % 16 or k % 32) and nvfp4_scaled_mm_supported(a.data.device):
        fp8_log["nvfp4:scaled_mm"] += 1
        return _scaled_mm_nvfp4(a, b, out_dtype)
    fp8_log["nvfp4:emulated"] += 1
    y = _emulated_block_gemm(a, b, a.scale.float(), b.scale.float())
    return (y * (a.tensor_scale * b.tensor_scale)).to(out_dtype)


class NVFP4Options(NamedTuple):
    generator: object  # torch.Generator for the gradients' stochastic rounding (None: torch's default)
    hadamard: torch.Tensor
    use_scaled_mm: bool
    amax_group: object = None  # the ranks holding shards of one tensor (TP): its tensor scales are MAX-agreed
    uniforms: object = None    # (role, shape) -> U[0, 1) draws of the stochastic rounding; None: `generator`


def nvfp4_amaxes(tensors, group=None):
    """max |t| of each tensor (FP32, stacked), MAX-reduced over `group` in one all-reduce: the ranks of a TP group
    hold shards of one tensor, which takes one FP32 tensor scale (as agreed_amax for FP8)."""
    amax = torch.stack([amax_of(t) for t in tensors])
    if _group_size(group, "amax_group") > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        fp8_log["nvfp4:all_reduce"] += 1
    return amax


def nvfp4_gradient_operands(g, x2, hadamard):
    """The backward's operands before quantisation, FP32: G (rows, N) for the dgrad, and for the wgrad G^T and
    x^T (N or K, tokens) Hadamard-transformed along the tokens."""
    g, x2 = g.float(), x2.float()
    return g, hadamard_along_k(g.t(), hadamard), hadamard_along_k(x2.t(), hadamard)


def nvfp4_backward_gemms(g, x2, qw, options, needs, amaxes=None, operands=None):
    """(grad_x, grad_W) of y = x W^T in NVFP4, each None where `needs` (dgrad, wgrad) says so: G stochastically
    rounded, x^T to nearest, qw the forward's 16 x 16-blocked W. amaxes: the tensor amaxes of
    nvfp4_gradient_operands (None: computed and agreed over options.amax_group here); operands: those operands, if
    the caller has them already. options.uniforms, when set, gives the stochastic rounding's draws:
    uniforms("dgrad", G's shape), uniforms("wgrad", G^T R's shape)."""
    g, g_t, x_t = operands or nvfp4_gradient_operands(g, x2, options.hadamard)
    if amaxes is None:
        amaxes = nvfp4_amaxes([g, g_t, x_t], options.amax_group) if options.amax_group is not None else [None] * 3
    draw = lambda role, t: None if options.uniforms is None else options.uniforms(role, tuple(t.shape))
    grad_x = grad_w = None
    if needs[0]:  # dgrad G W: reduces over N; W^T is W's blocks transposed
        qg = quantize_nvfp4(g, stochastic=True, generator=options.generator, tensor_amax=amaxes[0],
                            uniforms=draw("dgrad", g))
        grad_x = nvfp4_matmul(qg, transpose_nvfp4(qw), x2.dtype, options.use_scaled_mm)
    if needs[1]:  # wgrad G^T x: reduces over the tokens, both operands Hadamard-transformed
        qg_t = quantize_nvfp4(g_t, stochastic=True, generator=options.generator, tensor_amax=amaxes[1],
                              uniforms=draw("wgrad", g_t))
        grad_w = nvfp4_matmul(qg_t, quantize_nvfp4(x_t, tensor_amax=amaxes[2]), torch.float32, options.use_scaled_mm)
    return grad_x, grad_w


def quantize_nvfp4_pair(x2, weight, group=None):
    """The forward's operands: x (rows, K) in 1 x 16 blocks and W in 16 x 16, their tensor scales agreed over
    `group` (one all-reduce; None: each its own)."""
    amax = nvfp4_amaxes([x2, weight], group) if group is not None else [None, None]
    return quantize_nvfp4(x2, tensor_amax=amax[0]), quantize_nvfp4(weight, (NVFP4_BLOCK, NVFP4_BLOCK),
                                                                  tensor_amax=amax[1])


class _NVFP4LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, options):
        x2 = x.reshape(-1, x.shape[-1])
        qx, qw = quantize_nvfp4_pair(x2, weight, options.amax_group)
        y = nvfp4_matmul(qx, qw, x.dtype, options.use_scaled_mm)
        # x in high precision; W as quantised, its E2M1 elements held in one byte each (exact in E4M3, signed zero
        # included), not in their FP32 emulation, which would keep 4 bytes per parameter for every micro-batch
        ctx.save_for_backward(x, qw.data.to(torch.float8_e4m3fn), qw.scale, qw.tensor_scale)
        ctx.options, ctx.weight_dtype = options, weight.dtype
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, *w_fields = ctx.saved_tensors
        qw = NVFP4(w_fields[0].float(), w_fields[1], (NVFP4_BLOCK, NVFP4_BLOCK), 0, w_fields[2])
        grad_x, grad_w = nvfp4_backward_gemms(grad_out.reshape(-1, qw.data.shape[0]), x.reshape(-1, x.shape[-1]),
                                              qw, ctx.options, ctx.needs_input_grad[:2])
        return (None if grad_x is None else grad_x.reshape(x.shape),
                None if grad_w is None else grad_w.to(ctx.weight_dtype), None)


def nvfp4_linear(x, weight, bias=None, generator=None, hadamard_seed=0, use_scaled_mm=True, *, amax_group=None,
                 uniforms=None, hadamard=None):
    """y = x @ weight^T + bias with all three GEMMs in NVFP4 (x has any leading shape):
        forward  y = x W^T      x in 1 x 16 blocks, W in 16 x 16 blocks, both rounded to nearest
        dgrad    grad_x = G W   G in 1 x 16 blocks along N, rounded stochastically; W^T is W's blocks transposed
        wgrad    grad_W = G^T x G^T and x^T Hadamard-transformed along the tokens (random_hadamard(16,
                                hadamard_seed)), in 1 x 16 blocks; G^T stochastically, x^T to nearest
    generator: the torch.Generator of the stochastic rounding (on the gradient's device), seeded per step by the
    caller for reproducible, varying draws; None takes torch's default generator. Under TP, amax_group (the TP
    group) MAX-agrees every tensor scale, since the shards of x, W and G are one tensor each; uniforms(role,
    shape) -> U[0, 1) replaces the generator's draws (role "dgrad" or "wgrad"), so that a caller can draw them
    for the whole tensor and keep its shard (the rounding then does not depend on the layout). hadamard: the
    random_hadamard(16, hadamard_seed) matrix, if the caller made it once (None: made here)."""
    if hadamard is None:
        hadamard = random_hadamard(NVFP4_BLOCK, hadamard_seed, device=x.device)
    options = NVFP4Options(generator, hadamard, use_scaled_mm, amax_group, uniforms)
    y = _NVFP4LinearFunction.apply(x, weight, options)
    return y if bias is None else y + bias.to(y.dtype)


def nvfp4_errors(x, weight, seed=0):
    """NVFP4 on x (activations) and weight: the SQNR of x's quantisation, and the relative error of the GEMM x W^T
    against float64, beside the same for BF16 operands (FP32 accumulation)."""
    qx, qw = quantize_nvfp4(x), quantize_nvfp4(weight, (NVFP4_BLOCK, NVFP4_BLOCK))
    exact = x.double() @ weight.double().t()
    relative = lambda y: ((y.double() - exact).norm() / exact.norm()).item()
    return {"sqnr_db": sqnr_db(x, dequantize_nvfp4(qx)), "gemm_error": relative(nvfp4_matmul(qx, qw)),
            "bf16_gemm_error": relative(x.bfloat16().float() @ weight.bfloat16().float().t())}


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
# and main grads) and the part sharded over d ranks (FP32 master where separate, Adam's two moments); ZeRO-2 shards
# the 4-byte main grads too, ZeRO-3 the parameters as well (zero_bytes_formula)
ZERO_BYTES_PER_PARAM = {
    torch.float32: {"unsharded": 4 + 4, "sharded": 8},       # 16 -> 8 + 8/d
    torch.bfloat16: {"unsharded": 2 + 4, "sharded": 4 + 8},  # 18 -> 6 + 12/d
}


def persistent_bytes(mode):
    row = BYTES_PER_PARAM[mode]
    return row["weights"] + row["grads"] + row["master"] + row["optimizer"]


def zero_bytes_formula(dtype, d, zero=1):
    """Bytes per parameter with Adam at ZeRO-`zero` over d ranks: e (the parameter) + 4 (its FP32 main grad) +
    the states (FP32 master where separate, two moments), zero=1 dividing the states by d, zero=2 the main grads
    too, zero=3 the parameter too: BF16 18, 6 + 12/d, 2 + 16/d, 18/d; FP32 16, 8 + 8/d, 4 + 12/d, 16/d (zero=3
    without the gathered working set)."""
    row = ZERO_BYTES_PER_PARAM[dtype]
    e = torch.empty(0, dtype=dtype).element_size()
    params, grads = e, row["unsharded"] - e
    return (params / (d if zero >= 3 else 1) + grads / (d if zero >= 2 else 1)
            + row["sharded"] / (d if zero >= 1 else 1))


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


def build(mode, model_fn=MLP, lr=1e-3, seed=0, fp8_recipe="tensorwise", fp8_backward="bf16"):
    """Model and optimizer of one precision mode; returns (model, step_fn(x, y) -> (loss, stepped), opt).
    fp8_compute's layers are FP8Linear, or FineGrainedFP8Linear(recipe=fp8_recipe, backward=fp8_backward) beyond
    the per-tensor recipes and the BF16 backward."""
    torch.manual_seed(seed)
    if fp8_recipe in PER_TENSOR_RECIPES and fp8_backward == "bf16":
        fp8 = lambda *args, **kwargs: FP8Linear(*args, recipe=fp8_recipe, **kwargs)
    else:
        fp8 = lambda *args, **kwargs: FineGrainedFP8Linear(*args, recipe=fp8_recipe, backward=fp8_backward, **kwargs)
    model = model_fn(linear=fp8) if mode == "fp8_compute" else model_fn()
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


def _padding(opt):
    """Elements that round the optimizer's flat buffers up to a multiple of their shard count (or of 32 k)."""
    return sum(b.padded - sum(p.numel() for p in b.params) for b in opt._buffers)


def zero_bytes_per_parameter(dtype, zero, group=None, out=2):
    """This rank's bytes per parameter under ZeRO-`zero` over `group`, measured after one Adam step on the
    MLP. out=2 gives 6402 parameters, divisible by 2 and by 3: the flat buffers need no padding, so the
    figures are exactly the formula; other sizes add padding / n (reported)."""
    torch.manual_seed(0)
    model = MLP(out=out).to(dtype)
    optimizer_class = MixedPrecisionOptimizer if zero <= 1 else ShardedOptimizer
    opt = optimizer_class(model.parameters(), torch.optim.Adam, shard_groups=[(model.parameters(), group)],
                          zero=zero, lr=1e-3)
    model(torch.randn(8, 32).to(dtype)).float().pow(2).mean().backward()
    comm_bytes.clear()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    m = opt.memory_bytes()
    return {"n_params": n, "padding": _padding(opt), "bytes": m,
            "per_param": {k: v / n for k, v in m.items()}, "sent_per_param": sum(comm_bytes.values()) / n}


def zero_sent_formula(dtype, d, zero=1, micro_batches=1, shard=None):
    """Bytes a rank sends per parameter and step, FP32 gradients and e-byte parameters, m micro-batches, over k =
    `shard` ranks (None: all d) replicated over r = d / k (HSDP):
        zero=0  2 (k-1)/k 4            an all-reduce of the main grads, accumulated over the micro-batches
        zero=1  (k-1)/k (4 + e)        a reduce-scatter of them, an all-gather of the parameters
        zero=2  (k-1)/k (4 m + e)      a reduce-scatter per micro-batch, one all-gather
        zero=3  (k-1)/k m (4 + 2 e)    per micro-batch an all-gather for the forward and one for the backward, a
                                       reduce-scatter; no all-gather after the step
    plus, when r > 1, one all-reduce across the replicas per step: 2 (r-1)/r 4 of the whole gradient at zero=0,
    of the 1/k shard at zero >= 1."""
    e = torch.empty(0, dtype=dtype).element_size()
    k = d if shard is None else shard
    r, m = d // k, micro_batches
    within = {0: 8, 1: 4 + e, 2: 4 * m + e, 3: m * (4 + 2 * e)}[zero]
    return (k - 1) / k * within + 2 * (r - 1) / r * 4 / (k if zero >= 1 else 1)


# ----------------------------------------------------------------------------------------------------
# ZeRO-2 and ZeRO-3: a model of units, driven block by block as a trainer drives it
# ----------------------------------------------------------------------------------------------------

class Block(nn.Module):
    """x + W2 tanh(W1 layer_norm(x) + b1): 2 f h + f + 2 h parameters (624 for h = 12, f = 24: divisible by 2, 3
    and 4, so that no unit's flat buffer needs padding)."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.norm, self.up = nn.LayerNorm(dim), nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Blocks(nn.Module):
    """A token embedding (vocab x dim, in no unit, as the trainer keeps it: ZeRO-1 treatment) and `depth`
    Blocks, one unit each (`units()`); vocab=0: no embedding, the inputs are the first block's (dim) inputs."""

    def __init__(self, vocab=12, dim=12, hidden=24, depth=3):
        super().__init__()
        self.embed = nn.Parameter(torch.randn(vocab, dim)) if vocab else None
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(depth))

    def units(self):
        return [list(block.parameters()) for block in self.blocks]


# ---- ZeRO-3 inside autograd: a unit's parameters there exactly while it computes, forward and backward ----------

def sharded_call(unit, fn, tensors, next_unit=None, prev_unit=None, reduce_grads=True):
    """fn(*tensors) -> tensors, with `unit`'s parameters gathered while it runs and while its backward runs, and no
    longer: the markers _UnitStart and _UnitEnd around it are autograd functions, so the backward passes them in
    reverse. A rank so holds at most two units' parameters at once, the one computing and the next one, whose
    all-gather is issued before the current one computes (next_unit in the forward, prev_unit in the backward).
    With reduce_grads the unit's gradients are reduce-scattered as soon as its backward is done; a zero-bubble
    schedule, whose weight gradients come later (in W), passes False and calls unit.reduce_grads() after W. Every
    tensor leaving fn passes _UnitEnd, so no gradient enters the unit's backward before its parameters are back.
    Recomputation (torch.utils.checkpoint) runs fn again inside the backward: the markers then neither prefetch
    nor release."""
    tensors = _UnitStart.apply(unit, next_unit, prev_unit, reduce_grads, *tensors)
    return _UnitEnd.apply(unit, *fn(*tensors))


def _recomputing():  # a checkpointed forward run again inside the backward
    return torch._C._current_graph_task_id() != -1


class _UnitStart(torch.autograd.Function):
    """Forward: the unit gathered, the next unit's all-gather started. Backward, once the unit's gradients are all in
    (its first op's backward runs last): their reduce-scatter, the parameters freed, the previous unit's gather."""

    @staticmethod
    def forward(ctx, unit, next_unit, prev_unit, reduce_grads, *tensors):
        ctx.unit, ctx.prev_unit, ctx.reduce_grads = unit, prev_unit, reduce_grads
        unit.gather()
        unit.wait()
        if next_unit is not None and not _recomputing():
            next_unit.gather(async_op=True)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.reduce_grads:  # overlapped with the rest of the backward
            ctx.unit.reduce_grads(async_op=True)
        ctx.unit.release()
        if ctx.prev_unit is not None:
            ctx.prev_unit.gather(async_op=True)
        return (None, None, None, None) + grads


class _UnitEnd(torch.autograd.Function):
    """Forward: the unit's parameters freed (but while recomputing). Backward, before any of the unit's backward:
    the parameters gathered again."""

    @staticmethod
    def forward(ctx, unit, *tensors):
        ctx.unit = unit
        if not _recomputing():
            unit.release()
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.gather()
        ctx.unit.wait()
        return (None,) + grads


def sharded_micro_batch(model, opt, inputs, target, recompute=False, prefetch=True):
    """One micro-batch of `model` (Blocks) through its forward and backward, block by block, as a trainer calls
    the units: forward: gather unit i (the next one's gather issued first, async, when prefetching), run block i
    on a detached input, release unit i; backward, last block first: gather unit i again (prefetching i - 1),
    backward through block i (its recomputation first, under torch.utils.checkpoint), release, reduce_grads.
    The loss is the sum of squared errors (scaled by the optimizer's loss scaler for the backward); returns
    it, unscaled. At zero < 2 the unit calls do nothing and this is a plain forward and backward."""
    units = opt.units
    x0 = F.embedding(inputs, model.embed) if model.embed is not None else inputs
    x, saved = x0, []
    units[0].gather()
    for i, block in enumerate(model.blocks):
        if prefetch and i + 1 < len(units):
            units[i + 1].gather(async_op=True)  # in flight while block i computes
        units[i].gather()  # no-op if gathered; waits for a prefetch in flight
        xi = x.detach().requires_grad_()
        x = checkpoint(block, xi, use_reentrant=False) if recompute else block(xi)
        saved.append((xi, x))
        units[i].release()
    wide = torch.promote_types(x.dtype, torch.float32)  # FP32 for 16-bit models, float64 stays
    loss = ((x.to(wide) - target.to(wide)) ** 2).sum()
    scaled = opt.loss_scaler.scale_loss(loss) if opt.loss_scaler is not None else loss
    grad, = torch.autograd.grad(scaled, x)
    for i in reversed(range(len(units))):
        units[i].gather()
        if prefetch and i > 0:
            units[i - 1].gather(async_op=True)
        xi, out = saved[i]
        out.backward(grad)
        grad = xi.grad
        units[i].release()
        units[i].reduce_grads()  # after the unit's whole backward (after W, under a zero-bubble schedule)
    if x0.requires_grad:
        x0.backward(grad)  # the embedding: into its main grad (a hook adds it, or autograd in place)
    return loss.item()


def sharded_runs(specs, group=None):
    """sharded_run(**spec) for each spec, on this rank (one set of forked ranks for a table of runs)."""
    return [sharded_run(group=group, **spec) for spec in specs]


def sharded_batch(step, rows=36, vocab=12, dim=12):
    """The global batch of a step: token ids (rows), or inputs (rows, dim) for vocab=0, and targets (rows, dim),
    float64 (cast to the model's dtype by the caller)."""
    gen = torch.Generator().manual_seed(1000 + step)
    inputs = torch.randint(vocab, (rows,), generator=gen) if vocab else torch.randn(rows, dim, generator=gen,
                                                                                       dtype=torch.float64)
    return inputs, torch.randn(rows, dim, generator=gen, dtype=torch.float64)


def hsdp_groups(shard):
    """(shard group, replicate group) of this rank in the world: shards of `shard` consecutive ranks ([0, 1],
    [2, 3] for 2 of 4), replicas across them ([0, 2], [1, 3]). Every rank creates every group, in the same order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    shards = [dist.new_group(list(range(s, s + shard))) for s in range(0, world, shard)]
    replicas = [dist.new_group(list(range(r, world, shard))) for r in range(shard)]
    return shards[rank // shard], replicas[rank % shard]


def sharded_run(dtype, zero, micro_batches=1, shard=None, steps=1, vocab=0, hidden=24, depth=3, prefetch=True,
                group=None):
    """`steps` Adam steps of Blocks in `dtype` at ZeRO-`zero` over `group`'s ranks (the world; shard: HSDP with
    shards of that many ranks), each rank taking its 1/d of the global batch in `micro_batches` micro-batches.
    Returns this rank's memory_bytes, the parameter count (in units and in all), the padding, and the bytes
    sent in the last step (its forward and backward gathers and reduce-scatters included) per parameter."""
    d = _group_size(group)
    if 36 % (d * micro_batches):
        raise ValueError(f"micro_batches={micro_batches} on {d} ranks: the 36 rows of a step must split evenly")
    torch.manual_seed(0)
    model = Blocks(vocab=vocab, hidden=hidden, depth=depth).to(dtype)
    rank = dist.get_rank(group) if d > 1 else 0
    shard_group, replicate_group = hsdp_groups(shard) if shard else (group, None)
    opt = ShardedOptimizer(model.parameters(), torch.optim.Adam, zero=zero, units=model.units(), lr=1e-3,
                                  shard_groups=[(list(model.parameters()), shard_group, replicate_group)])
    for step in range(steps):
        inputs, target = (t.chunk(d)[rank] for t in sharded_batch(step, vocab=vocab))
        comm_bytes.clear()
        for xm, ym in zip(inputs.chunk(micro_batches), target.chunk(micro_batches)):
            sharded_micro_batch(model, opt, xm if vocab else xm.to(dtype), ym.to(dtype), prefetch=prefetch)
        opt.step(grad_multiplier=1 / 36)
    n = sum(p.numel() for p in model.parameters())
    n_units = sum(p.numel() for unit in model.units() for p in unit)
    return {"n_params": n, "n_units": n_units, "padding": _padding(opt),
            "unit_bytes": opt.units[0].param_bytes() if zero < 3 else None, "bytes": opt.memory_bytes(),
            "sent_per_param": sum(comm_bytes.values()) / n, "sent": dict(comm_bytes)}


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

def train_small_model(mode, steps=300, seed=0, **fp8_options):
    """A 2-hidden-layer MLP regressing a fixed random teacher; returns the mean loss of the last 20 steps."""
    torch.manual_seed(123)
    teacher = MLP()
    model, step, _ = build(mode, seed=seed, **fp8_options)
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
        # as bytes: a tensor put on a queue travels as a shared-memory handle that dies with this process
        buffer = io.BytesIO()
        torch.save(fn(*args, group=dist.group.WORLD), buffer)
        queue.put((rank, buffer.getvalue()))
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
    return [torch.load(io.BytesIO(results[r]), weights_only=True) for r in range(world)]


def row_parallel_fp8(recipe, m=8, k=384, n=256, seed=0, group=None):
    """y = x W^T in FP8 under `recipe` with K split over `group` (a row-parallel layer: rank r holds columns
    [r K/P, (r+1) K/P) of x and W) and the partial outputs summed over it; group None is the one-process GEMM.
    Column 130 of x and W is 50x the rest, so a block or row that holds it has a larger amax than the same
    block's piece on another rank. Returns this rank's dequantised pieces of x and W, the summed output, and
    the amax all-reduces the GEMM issued (the quantisation's own agreement)."""
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    x[:, 130] *= 50
    w[:, 130] *= 50
    size = _group_size(group)
    rank = dist.get_rank(group) if size > 1 else 0
    own = slice(rank * k // size, (rank + 1) * k // size)
    x, w = x[:, own].contiguous(), w[:, own].contiguous()
    before = fp8_log["amax:all_reduce"]
    y = fine_grained_fp8_linear(x, w, amax_group=group, split="row" if size > 1 else None, recipe=recipe)
    all_reduces = fp8_log["amax:all_reduce"] - before
    if size > 1:
        dist.all_reduce(y, group=group)
    if recipe == "tensorwise":
        amax = agreed_amax(x, w, group)
        pieces = [dequantize_fp8(*quantize_fp8(t, scale=fp8_scale(a))) for t, a in ((x, amax[0]), (w, amax[1]))]
    else:
        pieces = [dequantize_blocks(quantize_operand(t, recipe, role, k_group=group))
                  for t, role in ((x, "activation"), (w, "weight"))]
    return {"x": pieces[0], "w": pieces[1], "y": y, "all_reduces": all_reduces}


def fp8_param_gather_run(fp8_param_gather, steps=2, group=None):
    """A BF16 MLP (6467 parameters, not a multiple of 32) trained `steps` Adam steps under ZeRO-1 over `group`
    on the same batch everywhere, with or without fp8_param_gather. Returns the bytes the last step's
    parameter all-gather sent, the parameter count, the flat buffer's padding, the largest distance of a working
    weight from its FP32 master relative to max(|master|, the smallest normal of its block, 2^-6 / scale)
    (E4M3 bounds it by eps/2 = 2^-4, subnormals included), and the parameters and masters."""
    torch.manual_seed(0)
    model = MLP(out=3).to(torch.bfloat16)
    opt = ShardedOptimizer(model.parameters(), torch.optim.Adam, shard_groups=[(model.parameters(), group)],
                           zero=1, lr=1e-2, fp8_param_gather=fp8_param_gather)
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        model(torch.randn(8, 32, generator=gen).to(torch.bfloat16)).float().pow(2).mean().backward()
        comm_bytes.clear()
        opt.step(grad_multiplier=1 / _group_size(group))
    masters = [opt.full_state(p)["master"] for p in model.parameters()]
    params = [p.detach().clone() for p in model.parameters()]
    smallest_normal = lambda m: torch.finfo(E4M3).smallest_normal / block_scales(quantize_mxfp8(m.reshape(1, -1)))
    distance = max(((p.double() - m.double()).abs().reshape(-1) /
                    torch.maximum(m.double().abs().reshape(-1), smallest_normal(m).double().reshape(-1))).max().item()
                   for p, m in zip(params, masters))
    return {"sent": comm_bytes["all_gather"], "n_params": sum(p.numel() for p in params),
            "padding": _padding(opt), "distance": distance, "params": params,
            "masters": masters}


def fp8_gather_sent_formula(n_padded, d, fp8=True):
    """Bytes a rank sends in the ZeRO-1 parameter all-gather of N (padded) elements: (d-1)/d x N x (1 + 1/32)
    in FP8 with one E8M0 byte per 32, (d-1)/d x 2N in BF16."""
    return (d - 1) / d * n_padded * ((1 + 1 / FP8_GATHER_BLOCK) if fp8 else 2)


# ---- the demo: one function per claim it measures ----

def show_formats():
    print("== formats (from torch.finfo)")
    print(f"{'name':10s} {'bits':>4s} {'exp':>4s} {'mant':>4s} {'max':>10s} {'min normal':>11s} {'eps':>9s}  use")
    for r in dtype_table():
        print(f"{r['name']:10s} {r['bits']:4d} {r['exponent_bits']:4d} {r['mantissa_bits']:4d} {r['max']:10.4g} "
              f"{r['min_normal']:11.3g} {r['eps']:9.3g}  {r['use']}")


def show_master_weights():
    print("\n== why master weights: a weight of 1.0 receives +1e-3 a hundred times")
    w_bf16, w_fp32 = torch.tensor(1.0, dtype=torch.bfloat16), torch.tensor(1.0, dtype=torch.float32)
    for _ in range(100):
        w_bf16 += 1e-3
        w_fp32 += 1e-3
    print(f"   BF16 weight: {w_bf16.item():.4f} (spacing at 1.0 is {torch.finfo(torch.bfloat16).eps}, the update "
          f"rounds away); FP32 master: {w_fp32.item():.4f}")


def show_main_grads():
    e = accumulation_errors()
    print(f"\n== why FP32 main grads: {e['m']} micro-batches of BF16 gradients, error of the sum vs float64 "
          f"(relative to its max)")
    print(f"   summed in the FP32 main grad: {e['fp32_main_grad']:.2e} (FP32 eps {e['fp32_eps']:.1e}); "
          f"summed in BF16 .grad: {e['bf16_grad']:.2e} (BF16 eps {e['bf16_eps']:.1e})")


def show_fp16_underflow():
    print("\n== FP16 underflow and loss scaling: 1e5 gradients log-uniform in [1e-10, 1e-2]")
    g = torch.exp(torch.empty(100_000).uniform_(math.log(1e-10), math.log(1e-2)))
    lost = (g.half() == 0).float().mean().item()
    scale = 2.0 ** 16
    rescued = ((g * scale).half().float() / scale)
    lost_scaled = (rescued == 0).float().mean().item()
    print(f"   flushed to zero in FP16: {lost:.1%} unscaled, {lost_scaled:.1%} with the loss scaled by 2^16 "
          f"(FP16 min subnormal {torch.finfo(torch.float16).smallest_normal * torch.finfo(torch.float16).eps:.2e})")


def show_fp8_rounding(recipes=("tensorwise",)):
    print("\n== FP8 quantisation of 1024 x 1024 Gaussian values per recipe: SQNR, and the largest relative error of")
    print("   the values that land in the format's normal range, against the bound eps/2")
    x = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    for dtype in (E4M3, E5M2):
        fi = torch.finfo(dtype)
        for recipe in recipes:
            if recipe == "tensorwise":
                q, s = quantize_fp8(x, dtype)
                x_hat, scaled = dequantize_fp8(q, s), x * s
            else:
                qb = quantize_operand(x, recipe, "activation", dtype)
                x_hat, scaled = dequantize_blocks(qb), x * block_scales(qb)
            normal = scaled.abs() >= fi.smallest_normal
            worst = ((x_hat - x).abs() / x.abs())[normal].max().item()
            print(f"   {str(dtype)[6:]:14s} {recipe:10s} SQNR {sqnr_db(x, x_hat):5.1f} dB; max relative error "
                  f"{worst:.4f} <= eps/2 = {fi.eps / 2}")
    print(f"   torch._scaled_mm on this CPU: " + ", ".join(
        f"{r} {scaled_mm_supports(r, torch.device('cpu'))}" for r in recipes))


def show_training():
    print("\n== a small MLP trained 300 steps with Adam (final loss = mean of the last 20 steps)")
    for mode in ("fp32", "bf16_autocast", "bf16_master", "fp16_master_scaler", "fp8_compute", "bf16_pure"):
        loss, skipped = train_small_model(mode)
        print(f"   {mode:20s} loss {loss:.5f}" + (f"  ({skipped} steps skipped by the loss scaler)" if skipped else ""))
    print(f"   FP8 forward GEMMs run: {fp8_log['gemm:count']} "
          f"(torch._scaled_mm {fp8_log['gemm:scaled_mm']}, emulated {fp8_log['gemm:emulated']})")


def show_training_recipes():
    print("\n== the same MLP with FP8 forward GEMMs under every recipe and the E5M2 backward")
    for recipe in FP8_RECIPES:
        loss, _ = train_small_model("fp8_compute", fp8_recipe=recipe, fp8_backward="fp8")
        print(f"   fp8 {recipe:10s} + E5M2 backward  loss {loss:.5f}")


def show_bytes_per_parameter():
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


def show_zero_bytes():
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


def show_fp8_accumulation():
    print("\n== FP8 GEMM accumulation: K-long dot products of E4M3 values in [0, 1), accumulated with 14 significant")
    print("   bits (Hopper's FP8 tensor cores), median relative error vs float64, without / with promotion to FP32")
    print("   every 128 elements (DeepSeek-V3); rounding to nearest, and toward zero (truncation)")
    nearest, truncated = fp8_accumulation_errors(), fp8_accumulation_errors(rounding="truncate")
    print(f"   {'K':>6s} | {'nearest':>9s} {'promoted':>9s} | {'truncate':>9s} {'promoted':>9s}")
    for a, b in zip(nearest, truncated):
        print(f"   {a['K']:6d} | {a['plain']:9.2e} {a['promoted']:9.2e} | {b['plain']:9.2e} {b['promoted']:9.2e}")
    print("   without promotion the error grows with K (the accumulator's spacing grows with the sum, then addends")
    print("   smaller than half of it are lost); with it every partial sum spans 128 products and the error stays flat")


def show_fine_grained_scaling():
    print("\n== why fine-grained scaling: 256 tokens x 1024 channels, 4 channels of 8 tokens m times the rest, times")
    print("   a 256 x 1024 Gaussian weight; SQNR of x (all values / the ordinary ones) and the mean per-token relative")
    print("   error of the FP8 GEMM vs float64")
    weight = torch.randn(256, 1024, generator=torch.Generator().manual_seed(1)) / 32
    print(f"   {'m':>6s} " + " ".join(f"| {r:^23s}" for r in ("tensorwise",) + FINE_GRAINED))
    for magnitude in (1e2, 1e3, 1e4, 1e5, 1e6):
        x, ordinary = outlier_activations(magnitude)
        rows = [recipe_errors(x, weight, r, ordinary) for r in ("tensorwise",) + FINE_GRAINED]
        print(f"   {magnitude:6.0e} " + " ".join(
            f"| {e['sqnr_db']:5.1f}/{e['sqnr_ordinary_db']:5.1f} dB {e['gemm_error']:8.2e}" for e in rows))
    print("   scale overhead, bits per element (activations / weight): " + ", ".join(
        f"{r} {e['scale_bits'][0]:.2g} / {e['scale_bits'][1]:.2g}" for r, e in zip(("tensorwise",) + FINE_GRAINED,
                                                                                  rows)))
    print(f"   E4M3's normal range spans 448 / 2^-6 = {448 / 2 ** -6:.0f}: while the ordinary values stay in it")
    print("   (m up to ~1e3 here) every recipe rounds them to 4 significant bits; beyond it, per-tensor scaling")
    print("   pushes them into subnormals and zero, while a fine-grained scale confines the outlier to its row,")
    print("   tile or block")


def show_fp8_under_tp():
    print("\n== FP8 under TP: a row-parallel GEMM (K = 384 split over P forked ranks) against one process; amax")
    print("   all-reduces per GEMM; the pieces' rounding and the summed output against the one-process GEMM")
    for recipe in ("tensorwise",) + FINE_GRAINED:
        alone = row_parallel_fp8(recipe)
        for p in (2, 3):
            ranks = on_forked_ranks(lambda group: row_parallel_fp8(recipe, group=group), p)
            cols = [slice(r * 384 // p, (r + 1) * 384 // p) for r in range(p)]
            same = all(torch.equal(r["x"], alone["x"][:, c]) and torch.equal(r["w"], alone["w"][:, c])
                       for r, c in zip(ranks, cols))
            rel = ((ranks[0]["y"] - alone["y"]).norm() / alone["y"].norm()).item()
            print(f"   {recipe:10s} P={p} (K_local {384 // p}): {ranks[0]['all_reduces']} all-reduce(s); pieces "
                  f"{'bit-identical' if same else 'DIFFER'}; output {rel:.1e} from one process (FP32 sum order)")


def show_fp8_param_gather():
    print("\n== ZeRO-1 with fp8_param_gather: bytes a rank sends in the parameter all-gather, BF16 vs FP8 + scales")
    for d in (2, 3):
        fp8 = on_forked_ranks(lambda group: fp8_param_gather_run(True, group=group), d)[0]
        bf16 = on_forked_ranks(lambda group: fp8_param_gather_run(False, group=group), d)[0]
        n = fp8["n_params"]
        formulas = [fp8_gather_sent_formula(n + r["padding"], d, fp8=r is fp8) for r in (bf16, fp8)]
        print(f"   d={d}: BF16 {bf16['sent']:.0f} B (formula {formulas[0]:.0f}), FP8 {fp8['sent']:.0f} B (formula "
              f"{formulas[1]:.0f}): {fp8['sent'] / bf16['sent']:.3f} of BF16 ((1 + 1/32) / 2 = 0.516, and the "
              "32-alignment)")
        print(f"        working weights within {fp8['distance']:.4f} of the FP32 masters (bound: E4M3's eps/2, "
              "0.0625)")


def show_sharded_bytes():
    print("\n== ZeRO-0..3: bytes per parameter on each of d forked gloo ranks, Adam, 3 units of 624 parameters (every")
    print("   parameter in a unit: no padding at d = 2, 3, 4); formula | measured = params + grads + optimizer states")
    forms = {torch.bfloat16: ("18", "6 + 12/d", "2 + 16/d", "18/d"),
             torch.float32: ("16", "8 + 8/d", "4 + 12/d", "16/d")}
    for d in (2, 3, 4):
        specs = [{"dtype": dtype, "zero": zero} for dtype in forms for zero in range(4)]
        for spec, r in zip(specs, on_forked_ranks(sharded_runs, d, specs)[0]):  # rank 0's figures
            b = {k: v / r["n_params"] for k, v in r["bytes"].items()}
            dtype, zero = spec["dtype"], spec["zero"]
            total = b["param_bytes"] + b["grad_bytes"] + b["optimizer_bytes"]
            print(f"   d={d} {str(dtype)[6:]:8s} zero={zero} {forms[dtype][zero]:>9s} = "
                  f"{zero_bytes_formula(dtype, d, zero):5.2f} | {total:5.2f} = {b['param_bytes']:4.2f} + "
                  f"{b['grad_bytes']:4.2f} + {b['optimizer_bytes']:5.2f}  padding {r['padding']}")
    print("   padding rule: each flat buffer (per entry, dtype, device; at zero 2 and 3 per unit) is padded to a")
    print("   multiple of its shard count: a unit of 599 parameters at d = 3 takes 600 (the tests check that case)")


def show_gathered_working_set():
    print("\n== ZeRO-3 working set: the most unit parameter bytes gathered at once in a step (BF16, d = 4, 3 units of")
    print("   624 parameters = 1248 bytes each), beside the bytes at rest")
    specs = [{"dtype": torch.bfloat16, "zero": 3, "prefetch": prefetch} for prefetch in (True, False)]
    for prefetch, r in zip((True, False), on_forked_ranks(sharded_runs, 4, specs)[0]):
        at_rest = sum(v for k, v in r["bytes"].items() if k in ("param_bytes", "grad_bytes", "optimizer_bytes"))
        print(f"   prefetch={str(prefetch):5s}: at rest {at_rest / r['n_params']:.2f} bytes/param (18/d = 4.50), "
              f"gathered at the peak {r['bytes']['peak_gathered_bytes']} bytes = "
              f"{r['bytes']['peak_gathered_bytes'] // 1248} unit(s) (formula: {2 if prefetch else 1})")


def show_sharded_sent():
    print("\n== bytes a rank sends per parameter and step (forward and backward gathers, reduce-scatters, the step's")
    print("   collectives), BF16 (e = 2), m micro-batches; HSDP: shards of k = 2 of d = 4, replicated over 2")
    specs = [{"dtype": torch.bfloat16, "zero": zero, "micro_batches": m} for zero in range(4) for m in (1, 3)]
    layouts = ((2, None), (4, None), (4, 2))
    runs = [on_forked_ranks(sharded_runs, d, [{**spec, "shard": shard} for spec in specs])[0] for d, shard in layouts]
    names = [f"d={d}" + (f" k={k}" if k else "") for d, k in layouts]
    print("   zero m | " + " | ".join(f"{name:>7s} measured formula" for name in names))
    for i, spec in enumerate(specs):
        formula = lambda d, k: zero_sent_formula(torch.bfloat16, d, spec["zero"], spec["micro_batches"], k)
        cells = [f"{r[i]['sent_per_param']:16.3f} {formula(d, k):7.3f}" for (d, k), r in zip(layouts, runs)]
        print(f"   {spec['zero']:4d} {spec['micro_batches']:1d} | " + " | ".join(cells))
    print("   formulas (k-1)/k x: zero 0: 8, 1: 4 + e, 2: 4m + e, 3: m (4 + 2e); HSDP adds 2 (r-1)/r 4/k (zero 0: 4)")


def show_micro_batch_cost():
    print("\n== what several micro-batches cost at ZeRO-2 (d = 2, BF16): one reduce-scatter per micro-batch, against")
    print("   ZeRO-1, which accumulates full-size FP32 gradients and reduces once (the gradient bytes it keeps)")
    ms = (1, 2, 3, 6)
    specs = [{"dtype": torch.bfloat16, "zero": zero, "micro_batches": m} for zero in (1, 2) for m in ms]
    runs = on_forked_ranks(sharded_runs, 2, specs)[0]
    for m, one, two in zip(ms, runs[:len(ms)], runs[len(ms):]):
        grads = lambda r: r["bytes"]["grad_bytes"] / r["n_params"]
        print(f"   m={m}: sent/param ZeRO-2 {two['sent_per_param']:.2f} ((d-1)/d (4m + 2) = "
              f"{zero_sent_formula(torch.bfloat16, 2, 2, m):.2f}), ZeRO-1 {one['sent_per_param']:.2f}; "
              f"grad bytes/param ZeRO-2 {grads(two):.1f}, ZeRO-1 {grads(one):.1f}")


def show_nvfp4():
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))
    weight = torch.randn(256, 1024, generator=torch.Generator().manual_seed(1)) / 32
    e, mx = nvfp4_errors(x, weight), recipe_errors(x, weight, "mxfp8")
    draws = round_to_e2m1(torch.full((10_000,), 0.7), stochastic=True, generator=torch.Generator().manual_seed(0))
    print(f"\n== NVFP4 (4.5 bits/element), 256 x 1024 Gaussians: SQNR {e['sqnr_db']:.1f} dB, GEMM relative error "
          f"{e['gemm_error']:.3f} (MXFP8: {mx['sqnr_db']:.1f} dB, {mx['gemm_error']:.3f}; BF16 GEMM "
          f"{e['bf16_gemm_error']:.4f})")
    print(f"   0.7 rounds to {round_to_e2m1(torch.tensor(0.7)).item()} to nearest, to {draws.mean().item():.3f} on "
          "average over 10^4 stochastic roundings (unbiased: E[round(v)] = v)")


def demo(everything=False):
    """The chapter's claims, each measured (under a minute on two cores); `everything` (--all) adds the at-scale
    forms: ZeRO-0..3 and HSDP bytes on forked ranks, the fine-grained recipes, FP8 under TP and in the gathers,
    NVFP4."""
    show_formats()
    show_master_weights()
    show_main_grads()
    show_fp16_underflow()
    show_fp8_rounding()
    show_training()
    show_bytes_per_parameter()
    if not everything:
        print("\n(python3 mixed_precision.py --all adds ZeRO-0..3 and HSDP on forked ranks, the fine-grained FP8 "
              "recipes, FP8 under TP, the FP8 parameter all-gather and NVFP4)")
        return
    show_zero_bytes()
    show_sharded_bytes()
    show_gathered_working_set()
    show_sharded_sent()
    show_micro_batch_cost()
    show_fp8_param_gather()
    show_fp8_rounding(("tensorwise",) + FINE_GRAINED)
    show_training_recipes()
    show_fp8_accumulation()
    show_fine_grained_scaling()
    show_fp8_under_tp()
    show_nvfp4()


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description="Mixed precision, measured: the chapter's claims; --all adds the "
                                                 "at-scale forms (ZeRO-1/2/3, HSDP, fine-grained FP8, NVFP4)")
    parser.add_argument("--all", action="store_true", help="also the longer sweeps on forked ranks")
    demo(parser.parse_args().all)
