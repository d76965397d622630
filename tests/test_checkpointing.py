"""checkpointing.py: identical gradients under every policy; kept bytes, peak bytes and FLOPs equal to the formulas."""
import itertools
import json
import math
import runpy
import sys

import pytest
import torch
import torch.nn.functional as F

import checkpointing as ck
import chapter_core

B, S, H, A, L = 2, 32, 32, 4, 4
# every policy by name: the chapter's four, op-level SAC and the two offload policies (Policy objects)
RULES = {**ck.RECOMPUTATION_POLICIES, **ck.OFFLOAD_POLICIES}


@pytest.fixture(scope="module")
def setup():
    blocks = ck.make_blocks(L, H, A, S, dropout=0.2)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(0))
    return blocks, x


@pytest.mark.parametrize("policy", [p for p in ck.RECOMPUTATION_POLICIES if p != "none"])
def test_gradients_identical_to_no_recomputation_with_dropout(setup, policy):
    blocks, x = setup
    reference = ck.gradients(blocks, x, "none")
    got = ck.gradients(blocks, x, RULES[policy])
    # recomputation replays the same ops on the same inputs with the RNG state restored: bit-identical
    assert all(torch.equal(a, b) for a, b in zip(reference, got))
    # and dropout really was on: another seed gives other gradients
    assert not torch.equal(reference[0], ck.gradients(blocks, x, "none", seed=999)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_bytes_and_flops_equal_the_formulas(setup, dtype):
    blocks, x = setup
    blocks, x = ck.make_blocks(L, H, A, S, dropout=0.2).to(dtype), x.to(dtype)
    e = x.element_size()
    kept, flops = {}, {}
    for policy, rule in ck.RECOMPUTATION_POLICIES.items():
        kept[policy] = ck.measure_kept_bytes(blocks, x, rule)[0]
        flops[policy] = ck.measure_flops(blocks, x, rule)
        assert kept[policy] == ck.kept_bytes(rule, L, B, S, H, A, e), policy
        assert flops[policy] == ck.training_flops(rule, L, B, S, H), policy
    assert kept["none"] > kept["selective"] > kept["full"]
    assert flops["none"] < flops["selective"] < flops["full"]
    assert flops["full"] / flops["none"] == pytest.approx(4 / 3)  # one extra forward: 72 -> 96
    assert kept["full"] == L * B * S * H * e                        # one block input per layer


def test_formula_at_16_bit_on_cuda_is_the_papers_plus_layernorm_statistics():
    for b, s, h, a in ((1, 2048, 4096, 32), (2, 64, 64, 4)):
        ours = sum(ck.kept_bytes_per_layer("none", b, s, h, a, e=2, device="cuda").values())
        assert ours == ck.korthikanti_bytes_per_layer("none", b, s, h, a) + 4 * s * b * 4
        sel = sum(ck.kept_bytes_per_layer("selective", b, s, h, a, e=2, device="cuda").values())
        assert sel == ck.korthikanti_bytes_per_layer("selective", b, s, h, a) + 4 * s * b * 4
        full = sum(ck.kept_bytes_per_layer("full", b, s, h, a, e=2, device="cuda").values())
        assert full == ck.korthikanti_bytes_per_layer("full", b, s, h, a) == 2 * s * b * h  # the block input


def test_sqrt_policy_grows_sublinearly():
    r = ck.report(layers=2, b=1, s=8, h=16, a=2, sweep=(4, 16, 64), crossover=False)
    for row in r["sweep"]["rows"]:
        for p in ("none", "full", "sqrt"):
            assert row[p] == row[p + "_formula"]
            assert row[p + "_peak"] == row[p + "_peak_formula"]
        # fewer kept bytes, a higher peak: L is far below (A/X)^2
        assert row["sqrt"] < row["full"] and row["sqrt_peak"] > row["full_peak"]
    # the paper's 16-bit figure is per layer, the row is for all L = 2: s b h (34 + 5 a s / h) = 128 x 39 bytes a
    # layer without recomputation, 34 s b h selective, 2 s b h full (one layer's: 4992, 4352, 256)
    paper = {row["policy"]: row["korthikanti_16bit_bytes"] for row in r["rows"]}
    assert paper == {"none": 2 * 128 * 39, "selective": 2 * 34 * 128, "full": 2 * 2 * 128, "sqrt": None,
                     "selective_sac": None}
    g = r["sweep"]["growth_exponent"]
    # measured: none 1.00, full 1.00, sqrt 0.50 (segments of sqrt(L): L / sqrt(L) inputs kept)
    assert g["sqrt"] == pytest.approx(0.5, abs=0.05)
    assert g["full"] == pytest.approx(1.0, abs=0.05) and g["none"] == pytest.approx(1.0, abs=0.05)


def test_report_refuses_a_dropout_its_formulas_do_not_describe():
    for p in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match=f"dropout={p!r} must be in \\(0, 1\\)"):
            ck.report(layers=2, b=1, s=8, h=16, a=2, dropout=p, sweep=(2,), crossover=False)


def test_json_report_from_the_command_line(monkeypatch, capsys):
    # `python3 checkpointing.py --json ...` run in this process (runpy, as __main__): the file's own entry point
    # without a second interpreter's start and imports (saves about 5 s)
    argv = ["checkpointing.py", "--json", "--layers", "2", "--seq", "16", "--hidden", "16", "--heads", "2",
            "--batch", "1", "--sweep", "2", "--no-crossover"]
    monkeypatch.setattr(sys, "argv", argv)
    threads = torch.get_num_threads()
    try:
        runpy.run_path(ck.__file__, run_name="__main__")
    finally:
        torch.set_num_threads(threads)  # the entry point sets one thread
    r = json.loads(capsys.readouterr().out)
    assert r["config"]["layers"] == 2
    rows = {row["policy"]: row for row in r["rows"]}
    assert {"none", "full", "sqrt", "selective"} <= set(rows)
    for row in rows.values():
        assert set(row) >= {"policy", "saved_bytes", "formula_bytes", "flops", "formula_flops"}
        assert row["saved_bytes"] == row["formula_bytes"] and row["flops"] == row["formula_flops"]
        assert row["peak_bytes"] == row["formula_peak_bytes"]


# b, s, h, a, L, dtype: the fixture's shape; long sequences (a s / h = 16), where the attention backward is the
# peak, with L = 3 (a shorter last sqrt segment); b = 1, where q, k, v are views of the QKV output
PEAK_SHAPES = [(B, S, H, A, L, torch.float32), (2, 128, 16, 2, 3, torch.float64), (1, 16, 32, 2, 2, torch.bfloat16)]


def test_peak_bytes_equal_the_formula_at_every_moment():
    moments = set()
    for b, s, h, a, layers, dtype in PEAK_SHAPES:
        blocks = ck.make_blocks(layers, h, a, s, dropout=0.2).to(dtype)
        x = torch.randn(b, s, h, dtype=dtype, generator=torch.Generator().manual_seed(0))
        e = x.element_size()
        for policy, rule in ck.RECOMPUTATION_POLICIES.items():
            peak, moment, work, transient = ck.peak_bytes(rule, layers, b, s, h, a, e)
            assert ck.measure_peak_bytes(blocks, x, rule) == peak, (b, s, h, a, layers, dtype, policy)
            assert peak == ck.kept_bytes(rule, layers, b, s, h, a, e) + work + transient
            moments.add(moment)
    # the shapes reach every moment peak_bytes_terms lists
    assert moments == {m for p in ck.RECOMPUTATION_POLICIES.values() for m in ck.peak_bytes_terms(p, 4, B, S, H, A, 4)}


def test_peak_orderings_of_the_docstring(setup):
    blocks, x = setup
    e, seg = x.element_size(), ck.sqrt_segment_size(L)
    layer, inp = sum(ck.kept_bytes_per_layer("none", B, S, H, A, e).values()), B * S * H * e
    peak = {p: ck.measure_peak_bytes(blocks, x, p) for p in ("none", "full", "sqrt")}
    assert peak["none"] - peak["full"] == (L - 1) * (layer - inp)
    assert L % seg == 0 and peak["sqrt"] - peak["full"] == (seg - 1) * layer - (L - L // seg) * inp > 0
    assert ck.measure_kept_bytes(blocks, x, "sqrt")[0] < ck.measure_kept_bytes(blocks, x, "full")[0]
    one = torch.nn.ModuleList(blocks[:1])
    assert ck.measure_peak_bytes(one, x, "none") == ck.measure_peak_bytes(one, x, "full")


def test_sqrt_lowers_the_peak_only_beyond_about_a_over_x_squared():
    r = ck.sqrt_vs_full(dict(b=B, s=S, h=H, a=A), dict(b=1, s=16, h=32, a=2), e=4)
    for case in r.values():
        ratio, first = case["layer_over_input"], case["first_layers"]
        assert abs(first - ratio ** 2) <= ratio
    assert r["cuda_16bit"]["first_layers"] > 17 ** 2 and r["tiny"]["layer_over_input"] < 19
    # the 16-bit CUDA layer (b 1, s 2048, h 4096, a 32) with CUDA's rules, a bool dropout mask (m = 1) and FP32
    # LayerNorm statistics: A/X = 16 + 2m/e + a s (2e + m)/(h e) + 4 e_ln/(h e) = 17 + 40 + 2/1024 (with CPU's
    # rules 66.001, first L 4358). sqrt wins when ceil(L/seg) + seg A/X < L + A/X, seg = round(sqrt(L)): at
    # L = 3251 (seg 57) 58 + 56 A/X < 3251, i.e. A/X < 57.018; at 3250 it would need A/X < 57
    cuda = r["cuda_16bit"]
    ratio = 57 + 2 / 1024
    assert cuda["shape"]["device"] == "cuda" and cuda["layer_over_input"] == pytest.approx(ratio, rel=1e-12)
    first = next(L for L in itertools.count(2)
                 if math.ceil(L / round(math.sqrt(L))) + round(math.sqrt(L)) * ratio < L + ratio)
    assert cuda["first_layers"] == first == 3251
    tiny = r["tiny"]  # measured at its first L: sqrt's peak is now the lower one
    assert tiny["sqrt_peak"] == tiny["sqrt_peak_formula"] < tiny["full_peak"] == tiny["full_peak_formula"]


@pytest.mark.parametrize("argv, names", [
    (["--layers", "0"], "layers=0 must be a positive integer (--layers)"),
    (["--layers", "-2"], "layers=-2 must be a positive integer (--layers)"),  # was a math domain error
    (["--seq", "0"], "s=0 must be a positive integer (--seq)"),
    (["--batch", "0"], "b=0 must be a positive integer (--batch)"),
    (["--heads", "0"], "a=0 must be a positive integer (--heads)"),
    (["--hidden", "0"], "h=0 must be a positive integer (--hidden)"),
    (["--heads", "3"], "hidden=64 must be divisible by heads=3"),
    (["--sweep", "0"], "layer counts >= 1 (--sweep)"),
])
def test_bad_sizes_on_the_command_line_are_one_line_and_exit_code_2(capsys, argv, names):
    with pytest.raises(SystemExit) as exit_:
        ck.main(argv + ["--no-crossover"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith("checkpointing.py: error: "), err
    assert names in err[0], err


def test_attention_core_is_causal_scaled_dot_product_attention_and_eval_turns_dropout_off():
    # float64 against torch's own causal attention: 6.7e-16 apart; scores scaled by sqrt(d) instead of
    # 1/sqrt(d) are 2.0 off, a mask hiding the past instead of the future 3.0, dropout 0.5 left on in eval 2.3
    torch.manual_seed(0)
    block = ck.Block(32, 4, 16, dropout=0.5).double().eval()
    q, k, v = (torch.randn(2, 4, 12, 8, dtype=torch.float64) for _ in range(3))  # 12 < seq_len: a mask slice
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (block.attention_core(q, k, v) - reference).abs().max().item() < 1e-12
    x = torch.randn(1, 16, 32, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(block(x), block(x))


def test_sequence_longer_than_the_blocks_seq_len_names_it():
    block = ck.Block(16, 2, seq_len=8)
    with pytest.raises(ValueError, match="sequence length 9 exceeds the block's seq_len=8"):
        block(torch.randn(1, 9, 16))
    assert block(torch.randn(1, 8, 16)).shape == (1, 8, 16)


@pytest.mark.parametrize("args, names", [((16, 0, 8), "heads=0"), ((0, 2, 8), "hidden=0"), ((16, 2, 0), "seq_len=0")])
def test_a_block_of_no_size_names_it(args, names):
    with pytest.raises(ValueError, match=f"{names} must be a positive integer"):
        ck.Block(*args)


def test_bad_policy_raises(setup):
    blocks, x = setup
    with pytest.raises(ValueError, match="policy='half'"):
        ck.run_blocks(blocks, x, "half")


class _AuxBlock(ck.Block):
    """A block whose state is (hidden, running auxiliary loss), as train_gpt.py's MoE blocks carry it."""

    def __init__(self, h):
        super().__init__(h, 2, S, dropout=0.0)

    def forward(self, x, aux):
        y = super().forward(x)
        return y, aux + y.square().mean()


@pytest.mark.parametrize("policy", [p for p in ck.RECOMPUTATION_POLICIES if p != "none"])
def test_tuple_state_blocks_give_the_same_gradients(policy):
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(_AuxBlock(H) for _ in range(L)).double()
    x = torch.randn(B, S, H, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def grads(p):
        for q in blocks.parameters():
            q.grad = None
        xi = x.clone().requires_grad_(True)
        y, aux = ck.run_blocks(blocks, (xi, torch.zeros((), dtype=torch.float64)), p)
        (y.sum() + aux).backward()
        return [xi.grad] + [q.grad.clone() for q in blocks.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(grads("none"), grads(RULES[policy])))


def test_tuple_state_kept_bytes_follow_the_policies():
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(_AuxBlock(H) for _ in range(L)).double()
    state = (torch.randn(B, S, H, dtype=torch.float64), torch.zeros((), dtype=torch.float64))
    kept = {p: ck.measure_kept_bytes(blocks, state, p)[0] for p in ("none", "selective", "full")}
    assert kept["none"] > kept["selective"] > kept["full"]
    # full keeps each block's inputs: the hidden state and the 0-dim running loss (8 bytes each but the first)
    assert kept["full"] == L * B * S * H * 8 + (L - 1) * 8


def test_the_core_alone_recomputes_exactly_and_keeps_the_closed_form_bytes(tmp_path):
    """The lines above the banner, loaded alone: each of the chapter's four policies gives the gradients of the
    blocks called one after the other with no checkpoint (float64; dropout 0.5 is on, so each recomputation must
    replay the RNG), and keeps, and computes, what the docstring's closed forms say (on CPU a dropout mask and a
    LayerNorm statistic take e bytes, as an element does), and peaks at the forward+backward peak's formula."""
    core = chapter_core.load_core("checkpointing", tmp_path)
    assert core.POLICIES == ("none", "full", "sqrt", "selective")
    b, s, h, a, layers, e = 2, 8, 16, 2, 4, 8
    blocks = core.make_blocks(layers, h, a, s, dropout=0.5).double()
    x = torch.randn(b, s, h, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def plain_gradients(seed):
        for p in blocks.parameters():
            p.grad = None
        y = x.clone().requires_grad_(True)
        torch.manual_seed(seed)
        out = y
        for block in blocks:
            out = block(out)
        out.backward(torch.ones_like(out))
        return [y.grad] + [p.grad.clone() for p in blocks.parameters()]

    reference = plain_gradients(7)  # before any policy marks the blocks
    assert not torch.equal(reference[0], plain_gradients(8)[0])  # the dropout masks matter
    sbh, as2b, sb = s * b * h, a * s * s * b, s * b
    kept = {"none": layers * (18 * sbh + 3 * as2b + 4 * sb) * e, "full": layers * sbh * e, "sqrt": 2 * sbh * e,
            "selective": layers * (18 * sbh + 4 * sb) * e}
    forward = 24 * b * s * h * h + 4 * b * s * s * h
    redone = {"none": 0, "full": forward, "sqrt": forward, "selective": 2 * b * s * s * h}
    peak = {}
    for policy in core.POLICIES:
        assert all(torch.equal(r, g) for r, g in zip(reference, core.gradients(blocks, x, policy, seed=7))), policy
        measured = core.measure_kept_bytes(blocks, x, policy)[0]
        assert measured == kept[policy] == core.kept_bytes(policy, layers, b, s, h, a, e), policy
        flops = core.measure_flops(blocks, x, policy)
        assert flops == layers * (3 * forward + redone[policy]) == core.training_flops(policy, layers, b, s, h), policy
        peak[policy] = core.measure_peak_bytes(blocks, x, policy)
        assert peak[policy] == core.peak_bytes(policy, layers, b, s, h, a, e)[0], policy
    # the docstring's peak: full's is (L - 1)(A - X) below none's, A one layer's none bytes, X its input
    assert peak["none"] - peak["full"] == (layers - 1) * (kept["none"] // layers - sbh * e)


@pytest.mark.parametrize("policy", ["offload", "selective+offload"])
# the second shape: b = 1, where q, k, v are views of the QKV output (the host copies are of the views)
@pytest.mark.parametrize("b, s, h, a, layers, dtype", [(B, S, H, A, L, torch.float32),
                                                      (1, 16, 32, 2, 2, torch.bfloat16)])
def test_offloading_gives_identical_gradients_and_moves_the_formula_bytes(policy, b, s, h, a, layers, dtype):
    blocks = ck.make_blocks(layers, h, a, s, dropout=0.2).to(dtype)
    x = torch.randn(b, s, h, dtype=dtype, generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(r, g) for r, g in zip(ck.gradients(blocks, x, "none"),
                                                 ck.gradients(blocks, x, ck.OFFLOAD_POLICIES[policy])))
    measured = ck.measure_offload(blocks, x, policy)
    assert measured == ck.offload_bytes(policy, layers, b, s, h, a, x.element_size())
    # everything the recomputation underneath keeps crosses the bus; only the caller's input stays
    underneath = {"offload": "none", "selective+offload": "selective"}[policy]
    assert measured["to_host"] == ck.measure_kept_bytes(blocks, x, underneath)[0]
    assert measured["device_resident"] == b * s * h * x.element_size()
