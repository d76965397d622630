"""Is train_gpt.py, at world size 1, as fast as the same GPT written plainly in PyTorch?

    python3 benchmarks/train_gpt_vs_plain.py [--layers 4 --hidden 128 --heads 4 --seq 128 --batch 8
                                              --micro-batch 8 --rounds 30 --threads 0 --profile]

Both models have the same shape, the same initial weights' distribution, the same data and the same optimizer
(AdamW, betas (0.9, 0.95), weight decay 0.1 on 2-D weights, FP32). The plain one is nanoGPT's model.py in a
few lines: nn.Linear, F.scaled_dot_product_attention, F.cross_entropy, torch.optim.AdamW, and nanoGPT's gradient
accumulation (loss / steps, one backward per micro-batch). train_gpt.py runs its whole machinery with every group
of size 1 (plan, TP linears, vocabulary-parallel loss, 1F1B with one stage, the mixed-precision optimizer with
its FP32 gradient buffers). Both take the same micro-batches (--micro-batch, default the whole batch: fewer rows
per GEMM is slower in both, and on two threads more so). The two alternate in rounds of --steps-per-round steps
each on this noisy machine, on one thread and then on every core (torch's default; --threads N: only N); for
each, the ratio of the median step times is printed (> 1: train_gpt.py is faster) with a 95% interval (the rounds
resampled: whether a ratio's distance from 1 is more than this machine's noise) and the spread of the per-round
ratios. --profile adds, per thread count, both programs' self CPU time per step by operator
(torch.profiler, the same alternation), the operators where they differ most first.
"""
import argparse
import contextlib
import math
import os
import random
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt  # noqa: E402


class PlainBlock(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc, self.out = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class PlainGPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.blocks = nn.ModuleList(PlainBlock(cfg.n_embd, cfg.n_head) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        for name, p in self.named_parameters():  # GPT-2's initialisation, as train_gpt.py's
            residual = name.endswith(("proj.weight", "out.weight"))
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * cfg.n_layer) if residual else 1))

    def forward(self, ids, targets):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def adamw(params, lr):
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def race(steps, data, a, threads, rounds=None, watch=None):
    """Alternating rounds of both programs on `threads` threads. Returns per program the median step time; the ratio
    plain / train_gpt.py of each round's medians (their spread is the noise of this machine); per program each
    counted round's step times. `watch(name, counted)`, if given, is a context manager around each program's round
    (profile_ops' profiler)."""
    torch.set_num_threads(threads)
    times = {name: [] for name in steps}  # per program, each counted round's step times
    ratios, k = [], 0
    for r in range((a.rounds if rounds is None else rounds) + 1):  # round 0 warms up both and is not counted
        # ABBA: which program goes first alternates, so neither always runs on a cache the other warmed
        this_round = {}
        for name, step in (list(steps.items()) if r % 2 else list(steps.items())[::-1]):
            round_times = []
            with watch(name, r > 0) if watch else contextlib.nullcontext():
                for _ in range(a.steps_per_round):
                    tokens = data.batch("train", k, a.batch, a.seq, 0, a.device)
                    k += 1
                    t0 = time.perf_counter()
                    step(tokens)  # each ends with a host sync (the loss), so the clock sees the whole step
                    round_times.append(time.perf_counter() - t0)
            this_round[name] = statistics.median(round_times)
            if r:
                times[name].append(round_times)
        if r:
            ratios.append(this_round["plain"] / this_round["train_gpt.py"])
    return {name: pooled_median(t, range(len(t))) for name, t in times.items()}, ratios, times


def pooled_median(rounds, which):
    return statistics.median(t for i in which for t in rounds[i])


def ratio_interval(times, resamples=1000, seed=0):
    """A 95% interval of the ratio of median step times plain / train_gpt.py (a percentile bootstrap): the rounds
    drawn again with replacement, the two programs' rounds of one draw together (they ran side by side, on the same
    state of the machine), the ratio of the pooled medians of each draw."""
    rng, n = random.Random(seed), len(times["plain"])
    draws = ([rng.randrange(n) for _ in range(n)] for _ in range(resamples))
    ratios = sorted(pooled_median(times["plain"], d) / pooled_median(times["train_gpt.py"], d) for d in draws)
    return ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]


def profile_ops(steps, data, a, threads, rounds=3):
    """Self CPU time per step of every operator, per program: torch.profiler around each program's rounds of the
    same alternation as race (`rounds` counted after one warm-up): {program: {operator: (ms, calls) per step}}."""
    from torch.profiler import ProfilerActivity, profile
    ops, n = {name: {} for name in steps}, rounds * a.steps_per_round

    @contextlib.contextmanager
    def watch(name, counted):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            yield
        for e in prof.key_averages() if counted else ():
            ms, calls = ops[name].get(e.key, (0.0, 0.0))
            ops[name][e.key] = (ms + e.self_cpu_time_total / 1e3 / n, calls + e.count / n)

    race(steps, data, a, threads, rounds, watch)
    return ops


def print_profile(ops, top=16):
    a, b = ops["train_gpt.py"], ops["plain"]
    total = {name: sum(ms for ms, _ in o.values()) for name, o in ops.items()}
    print(f"    self CPU time per step by operator (ms; calls per step), where the two differ most first; totals "
          f"train_gpt.py {total['train_gpt.py']:.1f}, plain {total['plain']:.1f}:")
    print(f"      {'operator':52s} {'train_gpt.py':>18s} {'plain':>18s} {'difference':>10s}")
    keys = sorted(set(a) | set(b), key=lambda key: -abs(a.get(key, (0, 0))[0] - b.get(key, (0, 0))[0]))
    for key in keys[:top]:
        (ma, ca), (mb, cb) = a.get(key, (0.0, 0.0)), b.get(key, (0.0, 0.0))
        print(f"      {key[:52]:52s} {ma:9.2f} ({ca:6.1f}) {mb:9.2f} ({cb:6.1f}) {ma - mb:+10.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--layers", 4), ("--hidden", 128), ("--heads", 4), ("--seq", 128), ("--batch", 8),
                          ("--micro-batch", 0), ("--rounds", 30), ("--steps-per-round", 5), ("--threads", 0)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--profile", action="store_true", help="also both programs' time by operator")
    a = ap.parse_args()
    cfg = train_gpt.GPTConfig(vocab_size=256, seq_len=a.seq, n_layer=a.layers, n_head=a.heads, n_embd=a.hidden)
    run = train_gpt.JobConfig(batch=a.batch, micro_batch=a.micro_batch or a.batch, lr=1e-3, log=False,
                              data="embedded")
    try:  # bad sizes: one line and exit code 2, as train_gpt.py does
        for flag in ("rounds", "steps_per_round"):
            if getattr(a, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} {getattr(a, flag)} must be a positive integer")
        if a.threads < 0:
            raise ValueError(f"--threads {a.threads} must be >= 0 (0: one thread, then every core)")
        if a.micro_batch < 0:
            raise ValueError(f"--micro-batch {a.micro_batch} must be >= 0 (0: the whole batch)")
        data = train_gpt.check_inputs(cfg, run, 1)
    except ValueError as e:
        print(f"train_gpt_vs_plain.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    cores = torch.get_num_threads()  # torch's default: the machine's cores
    _, stage, opt, pipe = train_gpt.build_job(cfg, run)
    a.device = next(stage.parameters()).device  # both on the device train_gpt.py chose
    torch.manual_seed(0)
    plain = PlainGPT(cfg).to(a.device)
    plain_opt = adamw(plain.parameters(), run.lr)
    accumulate = a.batch // run.micro_batch

    def step_train_gpt(tokens):
        train_gpt.train_step(stage, pipe, opt, tokens, run.micro_batch, run.grad_clip)

    def step_plain(tokens):
        for micro in tokens.split(run.micro_batch):  # nanoGPT's gradient accumulation
            loss = plain(micro[:, :-1], micro[:, 1:]) / accumulate
            loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), run.grad_clip)
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)
        loss.item()  # the host sync train_step also has (its loss for the log)

    n = sum(p.numel() for p in plain.parameters())
    print(f"GPT L={a.layers} h={a.hidden} heads={a.heads} s={a.seq} batch={a.batch} in {accumulate} micro-batch"
          f"{'es' * (accumulate > 1)} of {run.micro_batch} ({n / 1e6:.2f} M parameters), {a.rounds} alternating rounds "
          f"of {a.steps_per_round} steps each")
    programs = {"train_gpt.py": step_train_gpt, "plain": step_plain}
    for threads in [a.threads] if a.threads else sorted({1, cores}):
        med, rounds, times = race(programs, data, a, threads)
        lo, hi = ratio_interval(times)
        print(f"  {threads} thread{'s' * (threads > 1)}:")
        for name, t in med.items():
            print(f"    {name:13s} median step {t * 1000:7.1f} ms   {a.batch * a.seq / t:9,.0f} tokens/s")
        print(f"    ratio plain / train_gpt.py = {med['plain'] / med['train_gpt.py']:.3f} (95% interval {lo:.3f} to "
              f"{hi:.3f}, resampling the rounds; rounds {min(rounds):.3f} to {max(rounds):.3f}; >= 1: train_gpt.py as "
              "fast)")
        if a.profile:
            print_profile(profile_ops(programs, data, a, threads))


if __name__ == "__main__":
    main()
