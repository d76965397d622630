"""Mixed precision: the number formats, BF16 with FP32 master weights, FP16 loss scaling, FP8 scaling.

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
it after each step. Per parameter with Adam this costs 2 (BF16 weight) + 2 (BF16 grad) + 4 (FP32 master)
+ 4 + 4 (FP32 Adam moments) = 16 bytes (the ZeRO paper's 2 + 2 + 12); Megatron-LM accumulates gradients
in FP32 ("main grads", 2 + 4 + 12 = 18). The autocast flow keeps FP32 parameters (4 + 4 + 8 = 16 bytes)
and casts them to BF16 inside each op; the casts live only during forward and backward (+2 bytes/param
transient), so its persistent memory is the same, but every step reads the FP32 weights and writes FP32
gradients. Gradients are converted to FP32 before the optimizer and before any data-parallel reduction,
so that the sum over ranks does not round either.

FP16 dynamic loss scaling. FP16 has 5 exponent bits: gradients below 6e-8 (its smallest subnormal) flush
to zero. Multiplying the loss by S (2^16 to start) shifts every gradient up by S; before the step the
FP32 gradients are divided by S. If any gradient overflowed to inf/NaN the step is skipped and S halved
(on every data-parallel rank: the overflow check is a MAX all-reduce, or ranks would diverge); after
`growth_interval` clean steps S doubles again. `DynamicLossScaler` reproduces `torch.amp.GradScaler`.

FP8 with per-tensor dynamic scaling. E4M3 reaches only 448, so each tensor is scaled into range first:
`scale = fp8_max / max(amax, eps)`, `x_fp8 = clamp(x * scale, +-fp8_max).to(fp8)`, and `x ~= x_fp8 / scale`.
The clamp is explicit because casts differ (torch 2.13 saturates E4M3 but turns E5M2 overflow into inf).
`FP8Linear` multiplies the E4M3 input and weight with `torch._scaled_mm` (Hopper/Ada GPUs, and CPU in
torch 2.13) accumulating in FP32, and computes its backward in BF16 from the saved high-precision tensors.
Relative rounding error is at most eps/2: 6.25% for E4M3 (about 31 dB SQNR on Gaussian data), 12.5% for
E5M2. Delayed scaling (Transformer Engine) takes the scale from the amax history of earlier steps, so it
needs no extra pass over the tensor, at the risk of saturating a sudden outlier. Real FP8 training adds:
E5M2 gradients in the backward GEMMs, per-block scaling (MXFP8, DeepSeek-V3's 1x128 / 128x128 tiles) so
an outlier spoils only its block, FP8 weight caches and FP8 all-gathers.
"""
import math

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

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
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0 or growth_interval < 1:
            raise ValueError("need growth_factor > 1, 0 < backoff_factor < 1 and growth_interval >= 1")
        self._scale = torch.tensor(init_scale, dtype=torch.float32)  # FP32, as GradScaler keeps it
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self._growth_tracker = 0

    @property
    def scale(self):
        return self._scale.item()

    def scale_loss(self, loss):
        return loss * self._scale.to(loss.device)

    def unscale_and_check(self, params, group=None):
        """Divide every gradient by the scale in place; True if any gradient anywhere in `group` is inf/NaN."""
        grads = [p.grad for p in params if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        inv_scale = self._scale.double().reciprocal().float().to(device)  # as GradScaler: one rounding of 1/S
        found = torch.zeros(1, device=device)
        for g in grads:  # no host sync per tensor: the flag stays on the device until the end
            found = torch.maximum(found, (~torch.isfinite(g)).any().float())
            g.mul_(inv_scale)
        if group is not None and dist.get_world_size(group) > 1:
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
        self._scale = torch.tensor(state["scale"], dtype=torch.float32)
        self.growth_factor, self.backoff_factor = state["growth_factor"], state["backoff_factor"]
        self.growth_interval, self._growth_tracker = state["growth_interval"], state["_growth_tracker"]


# ----------------------------------------------------------------------------------------------------
# 16-bit parameters, FP32 master weights
# ----------------------------------------------------------------------------------------------------

class MixedPrecisionOptimizer:
    """Wrap any torch.optim optimizer so that it steps FP32 masters of 16-bit (BF16 or FP16) parameters.

        opt = MixedPrecisionOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-4)
        loss.backward(); opt.step(); opt.zero_grad()

    step(): 16-bit grads -> FP32 master grads (before the optional DP all-reduce, so the sum does not round)
    -> optional loss-scaler unscale and overflow check (skip on overflow) -> inner step on the masters ->
    masters rounded back into the 16-bit parameters. Returns True if the step was taken.
    """

    def __init__(self, params, optimizer_class, *, dp_group=None, loss_scaler=None, **optimizer_kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.optimizer = optimizer_class(self.masters, **optimizer_kwargs)
        self.dp_group, self.loss_scaler = dp_group, loss_scaler

    def _master_grads_fp32(self):
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None  # the 16-bit copy is no longer needed: do not hold both

    def _all_reduce_grads(self):
        """Average the FP32 gradients over the DP group in one flat all-reduce (grad_accum.py shows buckets)."""
        if self.dp_group is None or dist.get_world_size(self.dp_group) == 1:
            return
        for m in self.masters:
            if m.grad is None:
                m.grad = torch.zeros_like(m)  # every rank must send the same buffer
        flat = torch.cat([m.grad.reshape(-1) for m in self.masters])
        dist.all_reduce(flat, group=self.dp_group)
        flat.div_(dist.get_world_size(self.dp_group))
        for m, g in zip(self.masters, flat.split([m.numel() for m in self.masters])):
            m.grad.copy_(g.view_as(m))

    def step(self, grad_scale=1.0):
        """`grad_scale` multiplies the FP32 gradients after the reduction (e.g. DP size / tokens, to turn
        the DP average of summed token losses into a per-token mean)."""
        self._master_grads_fp32()
        self._all_reduce_grads()
        if grad_scale != 1.0:
            for m in self.masters:
                if m.grad is not None:
                    m.grad.mul_(grad_scale)
        if self.loss_scaler is not None:
            found_inf = self.loss_scaler.unscale_and_check(self.masters, group=self.dp_group)
            self.loss_scaler.update(found_inf)
            if found_inf:
                self.zero_grad()
                return False
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)  # round the FP32 master to the 16-bit working copy
        self.zero_grad()
        return True

    def zero_grad(self):
        for t in self.params + self.masters:
            t.grad = None

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict(), "masters": [m.detach().clone() for m in self.masters],
                "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict()}

    def load_state_dict(self, state):
        with torch.no_grad():
            for p, m, saved in zip(self.params, self.masters, state["masters"]):
                m.copy_(saved)
                p.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.loss_scaler is not None and state["loss_scaler"] is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])


# ----------------------------------------------------------------------------------------------------
# FP8: per-tensor scaling, a linear layer with an FP8 forward and a BF16 backward
# ----------------------------------------------------------------------------------------------------

AMAX_EPS = 1e-12  # an all-zero tensor gets a finite scale (fp8_max / 1e-12 is far below FP32's max)


def fp8_scale(amax, dtype=torch.float8_e4m3fn):
    return torch.finfo(dtype).max / torch.clamp(amax.float(), min=AMAX_EPS)


def quantize_fp8(x, dtype=torch.float8_e4m3fn, scale=None):
    """Per-tensor scaling: returns (x_fp8, scale) with x ~= x_fp8.float() / scale.

    scale defaults to the dynamic fp8_max / amax(x); a given scale (delayed scaling) may push values past
    the format's range, and they saturate at +-max rather than becoming inf or NaN.
    """
    if scale is None:
        scale = fp8_scale(x.detach().abs().max(), dtype)
    fp8_max = torch.finfo(dtype).max
    x_fp8 = torch.clamp(x.float() * scale, -fp8_max, fp8_max).to(dtype)
    return x_fp8, scale


def dequantize_fp8(x_fp8, scale):
    return x_fp8.float() / scale


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
    column-major operand that _scaled_mm wants. The emulation is the same arithmetic: FP8 values are exact
    in FP32, products are accumulated in FP32 and scaled once."""
    inv_a, inv_b = a_scale.reciprocal().float(), b_scale.reciprocal().float()
    shapes_ok = a_fp8.shape[0] % 16 == 0 and a_fp8.shape[1] % 16 == 0 and b_fp8.shape[0] % 16 == 0
    if use_scaled_mm and shapes_ok and scaled_mm_available(a_fp8.device):
        return torch._scaled_mm(a_fp8, b_fp8.t(), scale_a=inv_a, scale_b=inv_b, out_dtype=out_dtype)
    return ((a_fp8.float() @ b_fp8.float().t()) * (inv_a * inv_b)).to(out_dtype)


class _FP8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, x_scale, w_scale, use_scaled_mm):
        ctx.save_for_backward(x, weight)  # high precision: the backward does not see the FP8 rounding
        x2 = x.reshape(-1, x.shape[-1])
        x_fp8, _ = quantize_fp8(x2, scale=x_scale)
        w_fp8, _ = quantize_fp8(weight, scale=w_scale)
        y = fp8_matmul(x_fp8, x_scale, w_fp8, w_scale, x.dtype, use_scaled_mm)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        g = grad_out.reshape(-1, weight.shape[0]).to(torch.bfloat16)
        grad_x = (g @ weight.to(torch.bfloat16)).reshape(x.shape).to(x.dtype)
        grad_w = (g.t() @ x.reshape(-1, x.shape[-1]).to(torch.bfloat16)).to(weight.dtype)
        return grad_x, grad_w, None, None, None


class FP8Linear(nn.Module):
    """nn.Linear whose forward GEMM runs in FP8 E4M3 with per-tensor scales; backward in BF16.

    delayed_scaling=True takes each scale from the largest amax of the last `amax_history_len` steps
    (Transformer Engine's recipe) instead of the current tensor."""

    def __init__(self, in_features, out_features, bias=True, delayed_scaling=False, amax_history_len=16,
                 use_scaled_mm=True, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.delayed_scaling, self.use_scaled_mm = delayed_scaling, use_scaled_mm
        self.register_buffer("amax_history", torch.zeros(2, amax_history_len, device=device))  # input, weight
        self.reset_parameters()

    def reset_parameters(self):
        ref = nn.Linear(self.weight.shape[1], self.weight.shape[0], bias=self.bias is not None)
        with torch.no_grad():  # the same initialisation as nn.Linear
            self.weight.copy_(ref.weight)
            if self.bias is not None:
                self.bias.copy_(ref.bias)

    def _scale(self, t, slot):
        amax = t.detach().abs().max().float()
        if not self.delayed_scaling:
            return fp8_scale(amax)
        history = self.amax_history[slot]
        # first step: no history yet, fall back to the current amax (torch.where: no host sync)
        scale = fp8_scale(torch.where(history.max() > 0, history.max(), amax))
        if self.training:
            self.amax_history[slot] = torch.roll(history, 1)
            self.amax_history[slot, 0] = amax
        return scale

    def forward(self, x):
        y = _FP8LinearFunction.apply(x, self.weight, self._scale(x, 0), self._scale(self.weight, 1),
                                     self.use_scaled_mm)
        return y if self.bias is None else y + self.bias.to(y.dtype)


# ----------------------------------------------------------------------------------------------------
# Memory accounting: bytes per parameter, by formula and measured on live tensors
# ----------------------------------------------------------------------------------------------------

# Adam's two moments are kept in the master dtype; "transient" lives only inside forward/backward.
BYTES_PER_PARAM = {
    "fp32":                {"weights": 4, "grads": 4, "master": 0, "optimizer": 8, "transient": 0},
    "bf16_autocast":       {"weights": 4, "grads": 4, "master": 0, "optimizer": 8, "transient": 2},
    "bf16_master":         {"weights": 2, "grads": 2, "master": 4, "optimizer": 8, "transient": 0},
    "bf16_master_fp32_grads": {"weights": 2, "grads": 4, "master": 4, "optimizer": 8, "transient": 0},
    "fp16_master_scaler":  {"weights": 2, "grads": 2, "master": 4, "optimizer": 8, "transient": 0},
    "fp8_compute":         {"weights": 2, "grads": 2, "master": 4, "optimizer": 8, "transient": 1},
    "bf16_pure":           {"weights": 2, "grads": 2, "master": 0, "optimizer": 4, "transient": 0},
}
MODE_NOTES = {
    "fp32": "no mixed precision",
    "bf16_autocast": "FP32 params, BF16 casts inside autocast",
    "bf16_master": "ZeRO paper: 2 + 2 + 12",
    "bf16_master_fp32_grads": "Megatron-LM main grads (formula only)",
    "fp16_master_scaler": "plus one FP32 scale",
    "fp8_compute": "FP8 copies of W and x per GEMM",
    "bf16_pure": "loses small updates",
}


def persistent_bytes(mode):
    row = BYTES_PER_PARAM[mode]
    return row["weights"] + row["grads"] + row["master"] + row["optimizer"]


class MLP(nn.Module):
    def __init__(self, dim=32, hidden=64, depth=2, linear=nn.Linear):
        super().__init__()
        dims = [dim] + [hidden] * depth + [1]
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
    if mode in ("bf16_master", "fp8_compute", "fp16_master_scaler"):
        scaler = DynamicLossScaler() if mode == "fp16_master_scaler" else None
        opt = MixedPrecisionOptimizer(model.parameters(), torch.optim.Adam, loss_scaler=scaler, lr=lr)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        scaler = None

    def step(x, y, take_step=True):
        if mode == "bf16_autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
        else:
            out = model(x.to(dtype))
        loss = F.mse_loss(out.float(), y)
        (scaler.scale_loss(loss) if scaler else loss).backward()
        stepped = opt.step() if take_step else None
        if take_step:
            opt.zero_grad()
        return loss.item(), stepped

    return model, step, opt


def measure_bytes_per_parameter(mode, model_fn=MLP):
    """Bytes per parameter of the live tensors after a backward (gradients present, optimizer state built)."""
    model, step, opt = build(mode, model_fn)
    x, y = torch.randn(8, 32), torch.randn(8, 1)
    step(x, y)                    # one full step: the optimizer state now exists
    step(x, y, take_step=False)   # a backward: gradients are alive
    n = sum(p.numel() for p in model.parameters())
    size = lambda ts: sum(t.numel() * t.element_size() for t in ts)
    inner = opt.optimizer if isinstance(opt, MixedPrecisionOptimizer) else opt
    # Adam's state: exp_avg and exp_avg_sq per parameter; the 0-dim "step" counters are not per-parameter
    states = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    masters = opt.masters if isinstance(opt, MixedPrecisionOptimizer) else []
    return {"weights": size(model.parameters()) / n,
            "grads": size(p.grad for p in model.parameters() if p.grad is not None) / n,
            "master": size(masters) / n, "optimizer": size(states) / n, "n_params": n}


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

    print("\n== bytes per parameter with Adam: formula | measured on the live tensors of the MLP")
    print(f"   {'mode':24s} {'weights':>8s} {'grads':>6s} {'master':>7s} {'adam':>5s} {'total':>6s} "
          f"{'transient':>9s} | {'measured':>8s}  note")
    for mode, row in BYTES_PER_PARAM.items():
        measured = ""
        if mode != "bf16_master_fp32_grads":
            m = measure_bytes_per_parameter(mode)
            measured = f"{m['weights'] + m['grads'] + m['master'] + m['optimizer']:8.1f}"
        print(f"   {mode:24s} {row['weights']:8d} {row['grads']:6d} {row['master']:7d} {row['optimizer']:5d} "
              f"{persistent_bytes(mode):6d} {row['transient']:9d} | {measured:>8s}  {MODE_NOTES[mode]}")


if __name__ == "__main__":
    demo()
