"""The GPU check: run it whenever a GPU is lent; it prints one line per figure and stays within --budget-s.

    python3 benchmarks/gpu_check.py                 # on a CUDA machine (about 2-3 minutes on one H200)
    python3 benchmarks/gpu_check.py --dry-run       # the same code on CPU with tiny shapes (what CI can check)

1. train_gpt.py on NCCL at world size 1, GPT-2 small (12 layers, 768 wide, 12 heads, 1024 context, vocabulary
   50304) in bfloat16: tokens/s and MFU (the GPU's dense BF16 peak from train_gpt.GPU_PEAK_TFLOPS).
2. FP8: torch._scaled_mm against the emulation in mixed_precision.py (the same FP8 operands, FP32 accumulation).
3. long_seq.py's fused ring attention on CUDA (world size 1: every ring step's kernel path) against the einsum
   reference and against F.scaled_dot_product_attention on the whole sequence, forward and backward.
4. A checkpoint of that run saved and sampled from (the CUDA path of `--sample`).
5. checkpointing.py's kept bytes per recomputation policy in bfloat16 on CUDA against its formula for CUDA
   kernels (1-byte dropout masks, FP32 LayerNorm statistics), which CPU runs cannot check.
Each section reports its own failure (an exception, or a figure outside its stated bound) and the next one still
runs; the exit code is 1 if any section failed.
"""
import argparse
import os
import sys
import tempfile
import time
import traceback

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
    run = train_gpt.TrainConfig(dtype="bfloat16", batch=batch, micro_batch=micro, lr=6e-4, log=False,
                                data="synthetic", timeout_s=120)
    data = train_gpt.check_inputs(cfg, run, 1)
    plan, stage, opt, pipe = train_gpt.build(cfg, run)
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
        _, stage2, opt2, _ = train_gpt.build(cfg, run)  # a fresh model and optimizer, loaded on the device
        train_gpt.load_checkpoint(path, stage2, opt2)
        saved, loaded = (train_gpt.checkpoint_tensors(s, o) for s, o in ((stage, opt), (stage2, opt2)))
        differ = [k for k in saved if not torch.equal(saved[k].cpu(), loaded[k].cpu())]
        say("gpt2 checkpoint round trip", f"{len(saved) - len(differ)} of {len(saved)} tensors equal")
        if differ or saved.keys() != loaded.keys():
            raise AssertionError(f"checkpoint: {len(differ)} tensors differ after loading, e.g. {differ[:3]}")
        text = train_gpt.sample(cfg, path, 16)
        say("gpt2 checkpoint and sample", f"{len(text)} tokens sampled from {os.path.basename(path)}")


def fp8(device, dry):
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(256, 512, generator=gen).to(device)
    b = torch.randn(768, 512, generator=gen).to(device)
    (a8, sa), (b8, sb) = mixed_precision.quantize_fp8(a), mixed_precision.quantize_fp8(b)
    available = mixed_precision.scaled_mm_available(a8.device)
    say("fp8 _scaled_mm available", available)
    emulated = mixed_precision.fp8_matmul(a8, sa, b8, sb, torch.float32, use_scaled_mm=False)
    if available:
        fused = mixed_precision.fp8_matmul(a8, sa, b8, sb, torch.float32, use_scaled_mm=True)
        rel = ((fused - emulated).norm() / emulated.norm()).item()
        # not bit-equal: Hopper's FP8 tensor cores accumulate with fewer bits than FP32 (DeepSeek-V3 report,
        # section 3.3.2: about 14); a wrong scale or operand order would be off by O(1)
        check("fp8 _scaled_mm vs emulation", rel, 1e-2, "relative error (the tensor cores' accumulation)")
    exact = a @ b.t()
    sqnr = mixed_precision.sqnr_db(exact, emulated)
    say("fp8 emulation vs FP32 GEMM", f"SQNR {sqnr:.1f} dB (E4M3 operands: ~25-30 dB; bound 20)")
    if not sqnr > 20:
        raise AssertionError(f"fp8: SQNR {sqnr:.1f} dB is below 20 dB")


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
                          ("fp8", lambda: fp8(device, a.dry_run)), ("ring", lambda: ring(device, a.dry_run)),
                          ("recompute", lambda: recompute_memory(device, a.dry_run))):
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
