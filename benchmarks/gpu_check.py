"""The GPU check: run it whenever a GPU is lent; it prints one line per figure and stays within --budget-s.

    python3 benchmarks/gpu_check.py                 # on a CUDA machine (about 2-3 minutes on one H200)
    python3 benchmarks/gpu_check.py --dry-run       # the same code on CPU with tiny shapes (what CI can check)

1. train_gpt.py on NCCL at world size 1, GPT-2 small (12 layers, 768 wide, 12 heads, 1024 context, vocabulary
   50304) in bfloat16: tokens/s and MFU (the GPU's dense BF16 peak from train_gpt.GPU_PEAK_TFLOPS).
2. FP8: each recipe (tensorwise, rowwise, blockwise, MXFP8) through torch._scaled_mm where torch 2.13 runs its
   scales on the device, against mixed_precision.py's emulation (the same FP8 operands and scales); the two
   backward GEMMs with E5M2 gradients (--fp8-backward fp8) the same way; and the accumulation error of the real
   FP8 GEMM as K grows (1K-64K) beside the emulated 14-bit accumulator.
3. NVFP4: mixed_precision.py's emulated NVFP4 GEMM (1 x 16-blocked activations, 16 x 16-blocked weights) against
   float64 beside BF16's error, and through torch._scaled_mm where the device has FP4 tensor cores (Blackwell),
   against the emulation; elsewhere the emulation timed; nvfp4_linear's forward and backward timed, its errors;
   train_gpt.py --dtype nvfp4 on the device (its draws there), 1F1B against zero bubble and against BF16.
4. long_seq.py's fused ring attention on CUDA (world size 1: every ring step's kernel path) against the einsum
   reference and against F.scaled_dot_product_attention on the whole sequence, forward and backward.
5. A checkpoint of that run saved and sampled from (the CUDA path of `--sample`).
6. checkpointing.py's kept bytes per recomputation policy in bfloat16 on CUDA against its formula for CUDA
   kernels (1-byte dropout masks, FP32 LayerNorm statistics), which CPU runs cannot check; activation offloading
   (pinned host copies on a side stream, the next block prefetched): bytes resident and copied against the formula,
   gradients equal to keeping the activations, and a step's time against none's (what the copies add).
7. The pipeline schedules: zero bubble's split backward on the device against 1F1B; the interleaved schedule on four
   gloo CPU processes (PP2 x DP2 with ZeRO-3; one GPU holds one NCCL rank) against one process in float64.
8. Sharding: ZeRO-3's gather, release and reduction around every block on the device against ZeRO-0 (and on
   four gloo CPU processes, with the interleaved schedule, under 7); ZeRO-3 with FP8 parameter gathers (the
   MXFP8 packing on the device) against BF16 ones.
9. Memory: GPT-2 small's step-2 peak, torch.cuda.max_memory_allocated() (reset at the step's start), against
   topology.py's prediction for the same flags (`topology.py memory`, device cuda), and by part (the live tensors'
   tracker, --memory-report) against the prediction's parts; what max_memory_allocated holds beside the tensors
   (cuBLAS's workspace, the allocator's 512-byte rounding) stays within the bound.
Each section reports its own failure (an exception, or a figure outside its stated bound) and the next one still
runs; the exit code is 1 if any section failed.
"""
import argparse
import os
import sys
import tempfile
import time
import traceback
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import checkpointing  # noqa: E402
import long_seq  # noqa: E402
import mixed_precision  # noqa: E402
import train_gpt  # noqa: E402


def say(name, value):
    print(f"{name}: {value}", flush=True)


def check(name, value, bound, what):
    """Print a figure beside its bound; a figure outside it fails the section."""
    say(name, f"{what} {value:.2e} (bound {bound:.0e})")
    if not value < bound:
        raise AssertionError(f"{name}: {value:.2e} is not below {bound:.0e}")


def gpt2_small(device, dry, deadline):
    cfg = train_gpt.GPTConfig(vocab_size=50304, seq_len=1024, n_layer=12, n_head=12, n_embd=768)
    batch, micro = 16, 8
    if dry:
        cfg = train_gpt.GPTConfig(vocab_size=512, seq_len=64, n_layer=2, n_head=4, n_embd=64)
        batch, micro = 4, 2
    run = train_gpt.JobConfig(dtype="bfloat16", batch=batch, micro_batch=micro, lr=6e-4, log=False,
                              data="synthetic", timeout_s=120)
    data = train_gpt.check_inputs(cfg, run, 1)
    plan, stage, opt, pipe = train_gpt.build_job(cfg, run)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    say("gpt2 backend", f"{torch.distributed.get_backend()} on {device} ({name})")
    times, losses = [], []
    for step in range(3 + 10):
        if time.monotonic() > deadline:
            break
        tokens = data.batch("train", step, batch, cfg.seq_len, cfg.seed, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss, *_ = train_gpt.train_step(stage, pipe, opt, tokens, micro, run.grad_clip)
        if step >= 3:
            times.append(time.perf_counter() - t0)
        losses.append(loss)
    dt = sorted(times)[len(times) // 2]
    tokens_per_s = batch * cfg.seq_len / dt
    peak = train_gpt.peak_tflops(run, device)
    say("gpt2 params", f"{sum(p.numel() for p in stage.parameters()) / 1e6:.1f} M")
    say("gpt2 tokens/s", f"{tokens_per_s:,.0f} (median of {len(times)} steps, {dt * 1000:.1f} ms each)")
    say("gpt2 mfu", "n/a (no known peak)" if not peak else
        f"{train_gpt.model_flops_per_token(cfg) * tokens_per_s / (peak * 1e12):.1%} of {peak} TFLOP/s")
    say("gpt2 loss", f"{losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")
    if device.type == "cuda":
        say("gpt2 peak memory", f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    if not losses[-1] < losses[0]:
        raise AssertionError(f"gpt2: the loss did not fall ({losses[0]:.3f} -> {losses[-1]:.3f})")
    with tempfile.TemporaryDirectory() as out_dir:
        path = train_gpt.save_checkpoint(out_dir, len(losses), stage, opt, cfg, run)
        _, stage2, opt2, _ = train_gpt.build_job(cfg, run)  # a fresh model and optimizer, loaded on the device
        train_gpt.load_checkpoint(path, stage2, opt2)
        parts = lambda v: [t for _, t in v.parts] if isinstance(v, train_gpt.Boxes) else [v]
        saved, loaded = (train_gpt.checkpoint_tensors(s, o) for s, o in ((stage, opt), (stage2, opt2)))
        differ = [k for k in saved if not all(torch.equal(a.cpu(), b.cpu())
                                              for a, b in zip(parts(saved[k]), parts(loaded[k])))]
        say("gpt2 checkpoint round trip", f"{len(saved) - len(differ)} of {len(saved)} tensors equal")
        if differ or saved.keys() != loaded.keys():
            raise AssertionError(f"checkpoint: {len(differ)} tensors differ after loading, e.g. {differ[:3]}")
        text = train_gpt.sample(cfg, path, 16)
        say("gpt2 checkpoint and sample", f"{len(text)} tokens sampled from {os.path.basename(path)}")


def fp8(device, dry):
    """The FP8 section: the recipes' GEMMs, their FP8 backward, then the accumulation (each measured even when an
    earlier check fails)."""
    try:
        try:
            fp8_recipes(device, dry)
        finally:
            fp8_backward(device, dry)
    finally:
        fp8_accumulation(device, dry)


def fp8_recipes(device, dry):
    """Each FP8 recipe's GEMM through torch._scaled_mm where torch 2.13 runs its scale layout on this device,
    against mixed_precision's emulation of the same arithmetic on the same FP8 operands and scales; then the
    accumulation lesson measured: the real GEMM's error against float64 as K grows, beside the emulated 14-bit
    accumulator without and with promotion to FP32 every 128 elements."""
    mp = mixed_precision
    m, k, n = (64, 256, 128) if dry else (256, 4096, 1024)
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(device)
    b = torch.randn(n, k, generator=gen).to(device)
    out_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for recipe in ("tensorwise", "rowwise", "blockwise", "mxfp8"):
        if recipe == "tensorwise":
            (a8, sa), (b8, sb) = mp.quantize_fp8(a), mp.quantize_fp8(b)
            gemm = lambda fused: mp.fp8_matmul(a8, sa, b8, sb, out_dtype if fused else torch.float32, fused)
            exact = mp.dequantize_fp8(a8, sa).double() @ mp.dequantize_fp8(b8, sb).double().t()
        else:
            qa, qb = mp.quantize_operand(a, recipe, "activation"), mp.quantize_operand(b, recipe, "weight")
            gemm = lambda fused: mp.fp8_block_matmul(qa, qb, out_dtype if fused else torch.float32, fused, recipe)
            exact = mp.dequantize_blocks(qa).double() @ mp.dequantize_blocks(qb).double().t()
        emulated = gemm(False)
        sqnr = mp.sqnr_db(a.double() @ b.double().t(), emulated)
        say(f"fp8 {recipe} emulation vs the unquantised GEMM", f"SQNR {sqnr:.1f} dB (E4M3 operands: ~28; bound 20)")
        if not sqnr > 20:
            raise AssertionError(f"fp8 {recipe}: SQNR {sqnr:.1f} dB is below 20 dB")
        # the emulation against float64 on the same FP8 values: FP32 sums of exact products, ~1e-7
        check(f"fp8 {recipe} emulation vs float64", ((emulated.double() - exact).norm() / exact.norm()).item(), 1e-5,
              "relative error (FP32 accumulation)")
        if not mp.scaled_mm_supports(recipe, device):
            say(f"fp8 {recipe} _scaled_mm", f"not run by torch {torch.__version__} on this device: emulated")
            continue
        before = mp.fp8_log["gemm:scaled_mm"]
        fused = gemm(True)
        if mp.fp8_log["gemm:scaled_mm"] == before:
            raise AssertionError(f"fp8 {recipe}: _scaled_mm is supported here but the GEMM was emulated")
        # bound 1e-2: the same operands and scales, so only the kernel's accumulation (tensor cores: ~14-bit
        # partial sums, promoted by cuBLAS) and the BF16 output rounding (2^-9 per element) differ, ~1e-3; a
        # scale applied to the wrong row or block is off by O(1)
        check(f"fp8 {recipe} _scaled_mm vs emulation", ((fused.double() - emulated.double()).norm() /
                                                        emulated.double().norm()).item(), 1e-2, "relative error")


def fp8_backward(device, dry):
    """The backward GEMMs of an FP8 layer as --fp8-backward fp8 runs them (mixed_precision.fp8_backward_gemms:
    dgrad G W and wgrad G^T x, the gradient G in E5M2, x and W in E4M3, at each recipe's granularity), through
    torch._scaled_mm where torch 2.13 runs the layout on this device, against the emulation on the same operands;
    and the emulation's SQNR against the float64 products of the unquantised tensors."""
    mp = mixed_precision
    m, k, n = (64, 256, 128) if dry else (1024, 4096, 1024)
    gen = torch.Generator(device="cpu").manual_seed(1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g, x, w = (torch.randn(*shape, generator=gen).to(device, dtype) for shape in ((m, n), (m, k), (n, k)))
    exact = (g.double() @ w.double(), g.double().t() @ x.double())
    for recipe in ("tensorwise", "rowwise", "blockwise", "mxfp8"):
        emulated = mp.fp8_backward_gemms(g, x, w, recipe, use_scaled_mm=False)
        before = mp.fp8_log["gemm:scaled_mm"]
        fused = mp.fp8_backward_gemms(g, x, w, recipe, use_scaled_mm=True)
        ran = mp.fp8_log["gemm:scaled_mm"] - before
        for name, e, f, ref in zip(("dgrad", "wgrad"), emulated, fused, exact):
            sqnr = mp.sqnr_db(ref, e)
            # E5M2 keeps 3 significant bits (~22 dB alone), E4M3 4 (~28 dB): ~24.5 dB measured on CPU, bound 18
            say(f"fp8 {recipe} E5M2 {name} emulation vs the unquantised GEMM", f"SQNR {sqnr:.1f} dB (bound 18)")
            if not sqnr > 18:
                raise AssertionError(f"fp8 {recipe} E5M2 {name}: SQNR {sqnr:.1f} dB is below 18 dB")
            if ran:  # bound as the forward's: only the kernel's accumulation and the output rounding differ
                check(f"fp8 {recipe} E5M2 {name} _scaled_mm vs emulation",
                      ((f.double() - e.double()).norm() / e.double().norm()).item(), 1e-2, "relative error")
        if not ran:
            say(f"fp8 {recipe} E5M2 backward _scaled_mm", f"not run by torch {torch.__version__} on this device: "
                "emulated")


def fp8_accumulation(device, dry):
    """K-long dot products of E4M3 values in [0, 1) (a 16 x K times K x 16 GEMM, scales 1): the median relative
    error of the diagonal against float64, from torch._scaled_mm with use_fast_accum (Hopper: the tensor cores'
    own accumulator) and without (cuBLAS promotes), beside mixed_precision's emulated 14-bit accumulator."""
    mp = mixed_precision
    if not mp.scaled_mm_available(device):
        say("fp8 accumulation", "torch._scaled_mm not available on this device")
        return
    one = torch.tensor(1.0, device=device)
    for k in (1024, 4096) if dry else (1024, 4096, 16384, 65536):
        gen = torch.Generator(device="cpu").manual_seed(k)
        a8, b8 = (torch.rand(16, k, generator=gen).to(torch.float8_e4m3fn).to(device) for _ in range(2))
        products = (a8.double() * b8.double()).cpu().numpy()
        exact = products.sum(axis=1)
        err = lambda s: float(np.median(np.abs(s - exact) / exact))
        real = {fast: err(torch.diagonal(torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                                          out_dtype=torch.float32, use_fast_accum=fast))
                          .double().cpu().numpy()) for fast in (True, False)}
        plain, promoted = (err(mp.limited_precision_sum(products, 14, every)) for every in (None, 128))
        say(f"fp8 accumulation K={k}", f"_scaled_mm fast_accum {real[True]:.2e}, default {real[False]:.2e} | "
            f"emulated 14-bit {plain:.2e}, promoted every 128 {promoted:.2e}")
        # only the default path has a bound: cuBLAS promotes partial sums to FP32 (CPU: FP32 throughout)
        if not real[False] < 1e-3:
            raise AssertionError(f"fp8 accumulation K={k}: the default _scaled_mm error {real[False]:.2e} >= 1e-3")


def _median_time(fn, device, repeats=5):
    """The median wall time of fn() in seconds (the device synchronised around each call), after one warm-up."""
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[repeats // 2]


def nvfp4(device, dry):
    """NVFP4 as mixed_precision.py emulates it: the GEMM of 1 x 16-blocked activations and 16 x 16-blocked weights
    against float64 (beside BF16 operands'), and against float64 on its own dequantised operands; through
    torch._scaled_mm where the device has FP4 tensor cores (compute capability 10.0+), against the emulation;
    otherwise the emulation timed beside a BF16 GEMM; then nvfp4_linear's forward and backward (stochastic
    gradients, Hadamard-transformed wgrad) timed, and its output and gradients against float64; the trainer's draws
    (nvfp4_draws) and a run (nvfp4_in_the_run)."""
    mp = mixed_precision
    m, k, n = (64, 256, 128) if dry else (1024, 4096, 1024)
    gen = torch.Generator(device="cpu").manual_seed(2)
    a, b, g = (torch.randn(*shape, generator=gen).to(device) for shape in ((m, k), (n, k), (m, n)))
    relative = lambda y, ref: ((y.double() - ref).norm() / ref.norm()).item()
    qa, qb = mp.quantize_nvfp4(a), mp.quantize_nvfp4(b, (16, 16))
    exact = a.double() @ b.double().t()
    emulated = mp.nvfp4_matmul(qa, qb, use_scaled_mm=False)
    error, bf16 = relative(emulated, exact), relative(a.bfloat16() @ b.bfloat16().t(), exact)
    # one operand's NVFP4 error on Gaussian data is ~0.1 relative (SQNR ~20 dB); the two add in quadrature: ~0.15
    say("nvfp4 emulated GEMM vs float64", f"relative error {error:.3f} (bound 0.25); BF16 operands {bf16:.1e}")
    if not error < 0.25:
        raise AssertionError(f"nvfp4: the GEMM's relative error {error:.3f} is not below 0.25")
    # the same operands in float64: exact block partial sums, then a few FP32 roundings per block
    check("nvfp4 emulation vs float64 on its operands", relative(emulated, mp.dequantize_nvfp4(qa).double()
                                                                 @ mp.dequantize_nvfp4(qb).double().t()),
          1e-5, "relative error (FP32 accumulation)")
    seconds = _median_time(lambda: mp.nvfp4_matmul(qa, qb, use_scaled_mm=False), device)
    bf16_seconds = _median_time(lambda: a.bfloat16() @ b.bfloat16().t(), device)
    say(f"nvfp4 emulated GEMM {m}x{k}x{n}", f"{seconds * 1e3:.2f} ms (BF16 GEMM {bf16_seconds * 1e3:.2f} ms)")
    if mp.nvfp4_scaled_mm_supported(device):
        before = mp.fp8_log["nvfp4:scaled_mm"]
        fused = mp.nvfp4_matmul(qa, qb, torch.bfloat16)
        if mp.fp8_log["nvfp4:scaled_mm"] == before:
            raise AssertionError("nvfp4: FP4 _scaled_mm is supported here but the GEMM was emulated")
        # the same operands and scales: only the kernel's accumulation and the BF16 output rounding differ
        check("nvfp4 _scaled_mm vs emulation", relative(fused, emulated.double()), 1e-2, "relative error")
        fused_seconds = _median_time(lambda: mp.nvfp4_matmul(qa, qb, torch.bfloat16), device)
        say("nvfp4 _scaled_mm GEMM", f"{fused_seconds * 1e3:.2f} ms")
    else:
        say("nvfp4 _scaled_mm", f"no FP4 tensor cores on this device for torch {torch.__version__}: emulated")
    x, w = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    draws = torch.Generator(device=device).manual_seed(0)

    def step():
        x.grad = w.grad = None
        mp.nvfp4_linear(x, w, generator=draws).backward(g)
    say("nvfp4_linear forward + backward", f"{_median_time(step, device) * 1e3:.2f} ms (emulated unless FP4 cores)")
    errors = (relative(mp.nvfp4_linear(x, w, generator=draws), exact), relative(x.grad, g.double() @ b.double()),
              relative(w.grad, g.double().t() @ a.double()))
    # stochastic rounding's error variance is twice rounding to nearest's: ~0.17 for the gradients
    say("nvfp4_linear output, grad_x, grad_w vs float64", "relative errors " + ", ".join(f"{e:.3f}" for e in errors)
        + " (bound 0.25)")
    if not max(errors) < 0.25:
        raise AssertionError(f"nvfp4_linear: a relative error {max(errors):.3f} is not below 0.25")
    nvfp4_draws(device, dry)
    nvfp4_in_the_run(device, steps=2 if dry else 4)


def nvfp4_draws(device, dry):
    """train_gpt.py's stochastic-rounding draws (counter_uniforms: a hash of seed, row and column in int64 ops) on
    this device: the CPU's values exactly, and their time for one shard beside torch.rand's (which draws the same
    count from Philox on a GPU, but cannot make one shard of a whole tensor's draw alone)."""
    rows, cols = (512, 256) if dry else (8192, 4096)  # a TP8 x CP8 shard of an 8192-token fc gradient at h 8192
    index = (torch.arange(rows), torch.arange(cols))
    here = train_gpt.counter_uniforms(0x0123456789ABCDEF, *(i.to(device) for i in index))
    same = torch.equal(here.cpu(), train_gpt.counter_uniforms(0x0123456789ABCDEF, *index))
    say("nvfp4 draws on the device vs the CPU", "the same values" if same else "DIFFERENT values")
    if not same:
        raise AssertionError("counter_uniforms: the device's draws differ from the CPU's")
    on_device = [i.to(device) for i in index]
    hashed = _median_time(lambda: train_gpt.counter_uniforms(7, *on_device), device)
    drawn = _median_time(lambda: torch.rand(rows, cols, device=device), device)
    say(f"nvfp4 draws of a {rows} x {cols} shard", f"hashed {hashed * 1e3:.2f} ms, torch.rand {drawn * 1e3:.2f} ms")


def nvfp4_in_the_run(device, steps):
    """train_gpt.py --dtype nvfp4 on this device: the stochastic rounding's draws made on it (counter_uniforms, for
    this rank's shard), 1F1B (nvfp4_linear's own backward) against zero bubble (the trainer's backward GEMMs, the
    weight GEMM deferred to W), and against BF16."""
    before = mixed_precision.fp8_log["nvfp4:emulated"] + mixed_precision.fp8_log["nvfp4:scaled_mm"]
    bf16, one_f_one_b, zero_bubble = _device_curves(device, [dict(dtype="bfloat16"), dict(dtype="nvfp4"),
                                                             dict(dtype="nvfp4", pp_schedule="zb-h1")], steps)
    gemms = mixed_precision.fp8_log["nvfp4:emulated"] + mixed_precision.fp8_log["nvfp4:scaled_mm"] - before
    # 3 GEMMs x 4 linears x 3 NVFP4 blocks (the last of 4 stays BF16) x 4 micro-batches x the steps, in two runs
    expected = 2 * 3 * 4 * 3 * 4 * steps
    say("nvfp4 run GEMMs", f"{gemms} (expected {expected})")
    if gemms != expected:
        raise AssertionError(f"nvfp4 run: {gemms} NVFP4 GEMMs, not one per GEMM of every NVFP4 block linear")
    # the same draws and roundings; the weight gradients accumulate in another order, whose last-bit changes can
    # flip a rounding downstream
    check("nvfp4 run zb-h1 vs 1f1b on the device", _largest_difference(one_f_one_b, zero_bubble) / one_f_one_b[0],
          1e-3, f"largest relative loss difference over {steps} steps")
    check("nvfp4 run vs bf16 on the device", _largest_difference(bf16, one_f_one_b) / bf16[0], 2e-2,
          f"largest relative loss difference over {steps} steps")


def ring(device, dry):
    from torch.distributed import group
    s, d = (256, 16) if dry else (4096, 64)
    for dtype in (torch.bfloat16, torch.float32):
        gen = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(2, n, s, d, generator=gen).to(device, dtype) for n in (8, 2, 2))
        kernel = long_seq.fused_kernel(q, k)
        outs = {}
        for name in ("fused", "reference", "sdpa"):
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            if name == "sdpa":
                out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
            else:
                out = long_seq.ring_attention(*leaves, group.WORLD, causal=True, impl=name)
            out.float().square().sum().backward()
            outs[name] = [out.float()] + [t.grad.float() for t in leaves]
        err = lambda a, b: max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(outs[a], outs[b]))
        # bounds: float32 differs in summation order only; bfloat16 rounds outputs and gradients to 8 bits
        bound = 1e-4 if dtype == torch.float32 else 3e-2
        say(f"ring {str(dtype)[6:]} kernel", kernel)
        check(f"ring {str(dtype)[6:]} fused vs reference", err("fused", "reference"), bound, "max relative error")
        check(f"ring {str(dtype)[6:]} fused vs SDPA", err("fused", "sdpa"), bound, "max relative error")


def _device_curves(device, runs, steps=4):
    """The losses of `steps` steps of a small model on this device (one process; float32 unless a change says
    otherwise), for each TrainConfig change."""
    cfg = train_gpt.GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, n_embd=64)
    curves = []
    for changes in runs:
        run = train_gpt.JobConfig(batch=8, micro_batch=2, lr=1e-3, log=False, data="synthetic", timeout_s=120,
                                  **{"dtype": "float32", **changes})
        _, stage, opt, pipe = train_gpt.build_job(cfg, run)
        curve = []
        for k in range(steps):
            stage.step = k  # as train() sets it: NVFP4's stochastic rounding draws from the step
            curve.append(train_gpt.train_step(stage, pipe, opt, train_gpt.synthetic_batch(k, 8, 64, 256).to(device),
                                              2, run.grad_clip)[0])
        curves.append(curve)
    return curves


def _cpu_ranks_curve(nproc, flags):
    """The float64 losses of 3 steps of train_gpt.py on `nproc` gloo CPU processes (one GPU holds one NCCL rank)."""
    import json
    import subprocess
    with tempfile.TemporaryDirectory() as out:
        metrics = os.path.join(out, "metrics.jsonl")
        args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train_gpt.py"),
                *CPU_RUN, "--metrics", metrics, *flags]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
        subprocess.run(args, env=env, check=True, capture_output=True, timeout=300)
        return [json.loads(line)["loss"] for line in open(metrics)]


CPU_RUN = ["--data", "synthetic", "--layers", "4", "--hidden", "32", "--seq", "32", "--vocab", "64", "--batch", "8",
           "--micro-batch", "2", "--steps", "3", "--dtype", "float64"]


def _one_process_curve():
    """The same 3 steps in this process (on the CPU), the reference of the gloo runs."""
    cfg, run, _ = train_gpt.parse_job_args(CPU_RUN)
    return [r["loss"] for r in train_gpt.train_job(cfg, replace(run, log=False))]


def _largest_difference(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


def schedules(device, dry):
    """The pipeline executor's paths: on this device (one process), zero bubble's split backward (the linears'
    weight GEMMs deferred to W) against 1F1B; on two gloo CPU processes, the interleaved schedule (PP2, v = 2)
    against one process, in float64."""
    one_f_one_b, zero_bubble = _device_curves(device, [dict(pp_schedule="1f1b"), dict(pp_schedule="zb-h1")])
    # float32: only the order of the weight-gradient accumulation differs
    check("schedules zb-h1 vs 1f1b on the device", _largest_difference(one_f_one_b, zero_bubble), 1e-4,
          "largest loss difference over 4 steps")
    # PP2 x DP2 on four processes, interleaved, with the blocks under ZeRO-3: both executors' gloo paths at once
    check("schedules interleaved PP2 v=2 x DP2 ZeRO-3 vs one process (CPU, float64)",
          _largest_difference(_one_process_curve(), _cpu_ranks_curve(4, ["--pp", "2", "--pp-schedule", "interleaved",
                                                                         "--virtual-stages", "2", "--zero", "3",
                                                                         "--micro-batch", "1"])),
          1e-12, "largest loss difference over 3 steps")


def sharding(device, dry):
    """ZeRO-2/3's paths on this device: the units' gather, release (storage freed and reallocated) and gradient
    reduction around every block (one process: no collective; the multi-process one runs under `schedules`)."""
    zero0, zero3 = _device_curves(device, [dict(zero=0), dict(zero=3)])
    check("sharding zero 3 vs zero 0 on the device", _largest_difference(zero0, zero3), 1e-5,
          "largest loss difference over 4 steps (float32: another order of the gradient sums)")
    # --fp8-param-gather at ZeRO-3: the shards packed as MXFP8 bytes and E8M0 scales and unpacked on the device
    bf16, fp8 = _device_curves(device, [dict(dtype="bfloat16", zero=3),
                                        dict(dtype="bfloat16", zero=3, fp8_param_gather=True)])
    check("sharding zero 3 fp8 parameter gather vs bf16 on the device", _largest_difference(bf16, fp8), 1e-2,
          "largest loss difference over 4 steps (FP8-rounded working weights: E4M3's 2^-4 per weight)")


def recompute_memory(device, dry):
    layers, b, s, h, a = (2, 2, 64, 64, 4) if dry else (4, 4, 1024, 1024, 16)
    dtype, e = (torch.float32, 4) if device.type == "cpu" else (torch.bfloat16, 2)
    blocks = checkpointing.make_blocks(layers, h, a, s).to(device, dtype)
    x = torch.randn(b, s, h, device=device, dtype=dtype)
    for policy in ("none", "selective", "full"):
        measured, _ = checkpointing.measure_kept_bytes(blocks, x, policy)
        formula = checkpointing.kept_bytes(policy, layers, b, s, h, a, e, device=device.type)
        say(f"recompute {policy} kept bytes", f"{measured:,d} measured, {formula:,d} formula ({device.type}, {dtype})")
        if measured != formula:
            raise AssertionError(f"recompute {policy}: measured {measured} != formula {formula}")


def offload(device, dry):
    """Activation offloading (checkpointing.py): the bytes kept on the device and copied each way equal the formula
    and the gradients equal keeping the activations, both policies; on CUDA a step's time with the pinned copies on
    a side stream beside none's and selective's: what the copies add where they do not hide behind the compute."""
    layers, b, s, h, a = (2, 2, 64, 64, 4) if dry else (8, 4, 2048, 2048, 16)
    dtype, e = (torch.float32, 4) if device.type == "cpu" else (torch.bfloat16, 2)
    blocks = checkpointing.make_blocks(layers, h, a, s).to(device, dtype)
    x = torch.randn(b, s, h, device=device, dtype=dtype)
    kept = checkpointing.gradients(blocks, x, "none")
    for policy in ("offload", "selective+offload"):
        measured = checkpointing.measure_offload(blocks, x, policy)
        formula = checkpointing.offload_bytes(policy, layers, b, s, h, a, e, device=device.type)
        say(f"offload {policy} bytes", ", ".join(f"{k} {measured[k]:,d} ({formula[k]:,d})" for k in formula))
        if measured != formula:
            raise AssertionError(f"offload {policy}: measured {measured} != formula {formula}")
        rule = checkpointing.OFFLOAD_POLICIES[policy]
        if not all(torch.equal(g, k) for g, k in zip(checkpointing.gradients(blocks, x, rule), kept)):
            raise AssertionError(f"offload {policy}: gradients differ from keeping the activations")
    rules = {"none": "none", "selective": "selective", **checkpointing.OFFLOAD_POLICIES}
    times = {policy: _median_time(lambda: checkpointing.gradients(blocks, x, rule), device, 3 if dry else 5)
             for policy, rule in rules.items()}
    say("offload step time", ", ".join(f"{p} {t * 1e3:.1f} ms" for p, t in times.items())
        + f" (offload adds {times['offload'] / times['none'] - 1:+.1%} to none's step)")


def memory(device, dry):
    """Each rank's peak of a step after the first, predicted before the run (topology.py, from train_gpt.py's flags)
    against measured (train_job's MemoryMeter: on CUDA max_memory_allocated over step 2; on CPU the live tensors'
    peak), GPT-2 small in BF16 at world size 1 (tiny shapes with --dry-run); and each part."""
    cfg = train_gpt.GPTConfig(vocab_size=50304, seq_len=1024, n_layer=12, n_head=12, n_embd=768)
    batch, micro = 16, 8
    if dry:
        cfg = train_gpt.GPTConfig(vocab_size=512, seq_len=64, n_layer=2, n_head=4, n_embd=64)
        batch, micro = 4, 2
    run = train_gpt.JobConfig(dtype="bfloat16", batch=batch, micro_batch=micro, steps=2, log=False, data="synthetic",
                              timeout_s=120, memory_report=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    records = train_gpt.train_job(cfg, run)
    row, parts = records[1]["memory"][0], records[1]["memory_parts"]
    predicted, measured = row["predicted_bytes"], row["measured_bytes"]
    say("memory gpt2 step 2 peak", f"predicted {predicted / 2**30:.3f} GiB at {row['predicted_instant']}; measured "
        f"{measured / 2**30:.3f} GiB ({'max_memory_allocated' if device.type == 'cuda' else 'live tensors'}) at "
        f"{row['instant']}")
    say("memory gpt2 parts (MiB, predicted / measured)", ", ".join(
        f"{part} {p / 2**20:.1f} / {(m or 0) / 2**20:.1f}" for part, ((p, m),) in parts.items()))
    check("memory gpt2 predicted vs measured", abs(predicted / measured - 1), 0.05 if device.type == "cuda" else 0.03,
          "relative difference")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (checks the script, not a GPU)")
    a = ap.parse_args()
    if a.dry_run:  # CPU and gloo even on a GPU machine
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    deadline = time.monotonic() + a.budget_s
    if not a.dry_run and not torch.cuda.is_available():
        say("gpu", "none: run with --dry-run on CPU")
        return 1
    train_gpt.topology.init_distributed(120)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and not a.dry_run \
        else torch.device("cpu")
    say("torch", f"{torch.__version__}, cuda {torch.version.cuda}, device {device}")
    failed = 0
    for name, section in (("gpt2", lambda: gpt2_small(device, a.dry_run, deadline)),
                          ("fp8", lambda: fp8(device, a.dry_run)), ("nvfp4", lambda: nvfp4(device, a.dry_run)),
                          ("ring", lambda: ring(device, a.dry_run)),
                          ("recompute", lambda: recompute_memory(device, a.dry_run)),
                          ("offload", lambda: offload(device, a.dry_run)),
                          ("schedules", lambda: schedules(device, a.dry_run)),
                          ("sharding", lambda: sharding(device, a.dry_run)),
                          ("memory", lambda: memory(device, a.dry_run))):
        if time.monotonic() > deadline:
            say(name, "skipped: time budget spent")
            continue
        try:
            section()
        except Exception:
            failed += 1
            say(f"{name} FAILED", traceback.format_exc().strip().splitlines()[-1])
    say("time", f"{a.budget_s - (deadline - time.monotonic()):.0f} s of {a.budget_s:.0f} s budget")
    torch.distributed.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
