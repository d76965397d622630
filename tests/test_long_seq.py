"""long_seq.py: ring (zigzag causal and non-causal), Ulysses and all-gather attention against SDPA on the whole
sequence, on every rank; communication counted; zigzag balance; saved memory; validation before communication."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import long_seq as ls
from multirank import run_ranks, value_errors

# float64: the ring merges P partial softmaxes exactly (log-sum-exp), so it differs from SDPA by rounding only:
# measured <= 1.2e-11 over all cases (the x100-logit case dominates; O(1) logits give ~1e-15); 1e-10 is the
# issue's bound. float32: FP32 accumulators on both sides, measured <= 3.2e-6 on these sizes (s <= 32, gradients
# O(1)); 1e-5 allows for a different summation order, while a wrong or missing block costs O(0.1).
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
H = 12  # divisible by 1, 2, 3, 4 ranks


def _ulysses_allowed(h, h_kv, P):
    return h % P == 0 and (h_kv % P == 0 or P % h_kv == 0)


def _case_errors(rank, P, fn, causal, h_kv, dtype, scale=None, logit_mult=1.0, noncontig=False, b=2, d=8):
    group = dist.group.WORLD
    s = 8 * P
    gen = torch.Generator().manual_seed(1234)
    q = torch.randn(b, H, s, d, generator=gen, dtype=torch.float64) * logit_mult
    k = torch.randn(b, h_kv, s, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, h_kv, s, d, generator=gen, dtype=torch.float64)
    dout = torch.randn(b, H, s, d, generator=gen, dtype=torch.float64)
    full = [t.to(dtype).clone().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=causal, scale=scale, enable_gqa=h_kv != H)
    ref.backward(dout.to(dtype))
    shard = ls.zigzag_shard if (causal and fn is not ls.ulysses_attention) else ls.contiguous_shard
    local = []
    for t in (q, k, v):
        x = shard(t.to(dtype), 2, rank, P).clone()
        if noncontig:  # the same values behind permuted strides
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
            assert not x.is_contiguous()
        local.append(x.requires_grad_(True))
    out = fn(*local, group, causal=causal, scale=scale)
    out.backward(shard(dout.to(dtype), 2, rank, P))
    errs = [(out - shard(ref, 2, rank, P)).abs().max().item()]
    errs += [(l.grad - shard(r.grad, 2, rank, P)).abs().max().item() for l, r in zip(local, full)]
    finite = all(torch.isfinite(t).all() for t in [out] + [l.grad for l in local])
    return max(errs), finite


def _all_cases(rank, P):
    results = {}
    for fn in (ls.ring_attention, ls.ulysses_attention, ls.allgather_attention):
        for causal in (True, False):
            for h_kv in (H, 4, 1):  # MHA, GQA, MQA
                if fn is ls.ulysses_attention and not _ulysses_allowed(H, h_kv, P):
                    continue
                for dtype in (torch.float64, torch.float32):
                    key = (fn.__name__, causal, h_kv, str(dtype))
                    results[key] = _case_errors(rank, P, fn, causal, h_kv, dtype)
        key = (fn.__name__, "scale=0.3 x100 logits noncontiguous")
        results[key] = _case_errors(rank, P, fn, True, 4 if fn is not ls.ulysses_attention or P != 3 else 3,
                                    torch.float64, scale=0.3, logit_mult=100.0, noncontig=True)
    return results


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_attention_equals_sdpa_on_the_whole_sequence(P):
    per_rank = run_ranks(_all_cases, P, timeout=240)
    for rank, results in enumerate(per_rank):
        for key, (err, finite) in results.items():
            dtype = torch.float32 if "torch.float32" in key else torch.float64
            assert finite, (rank, key)
            assert err < TOL[dtype], (rank, key, err)
    names = {key[0] for key in per_rank[0]}
    assert names == {"ring_attention", "ulysses_attention", "allgather_attention"}


KV_HEADS = {1: 2, 2: 1, 3: 3, 4: 2}  # P=2 (MQA) and P=4 replicate KV heads for Ulysses; P=3 splits them


def _comm_and_memory(rank, P, dtype):
    group = dist.group.WORLD
    b, h, h_kv, d, s = 2, 12, KV_HEADS[P], 8, 8 * P
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, s, d, generator=gen, dtype=dtype) for n in (h, h_kv, h_kv))
    out = {}
    for name, fn, shard in (("ring", ls.ring_attention, ls.zigzag_shard),
                            ("ulysses", ls.ulysses_attention, ls.contiguous_shard)):
        local = [shard(t, 2, rank, P).requires_grad_(True) for t in (q, k, v)]
        ls.comm_log.clear()
        ls.work_log.clear()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = fn(*local, group, causal=True)
        fwd = dict(ls.comm_log)
        work = ls.work_log["pairs"]
        y.sum().backward()
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
        out[name] = {"fwd": fwd, "all": dict(ls.comm_log), "saved": sum(storages.values()), "work": work}
    return out


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_collectives_counted_and_bytes_match_the_formulas(P):
    b, h, h_kv, d, s = 2, 12, KV_HEADS[P], 8, 8 * P
    e = 8
    for r in run_ranks(_comm_and_memory, P, torch.float64, timeout=120):
        ring = r["ring"]["all"]
        if P == 1:
            assert ring == {} and r["ulysses"]["all"] == {}  # one rank sends nothing
            continue
        assert ring["ring_kv_fwd:count"] == P - 1           # KV passed P-1 times forward
        assert ring["ring_kv_bwd:count"] == P - 1           # and again backward
        assert ring["ring_dkv_bwd:count"] == P              # dK/dV travel P hops to get home
        assert ring["ring_kv_fwd:bytes"] == 2 * (P - 1) * b * (s // P) * h_kv * d * e  # = 2(P-1)/P b s h_kv d e
        assert ring["ring_dkv_bwd:bytes"] == P * 2 * b * (s // P) * h_kv * d * e
        uly = r["ulysses"]["all"]
        assert uly["ulysses_a2a_fwd:count"] == 4 and uly["ulysses_a2a_bwd:count"] == 4
        h_kv_eff = h_kv if h_kv >= P else P  # MQA/GQA with fewer KV heads than ranks: replicated to P
        assert uly["ulysses_a2a_fwd:bytes"] == pytest.approx((P - 1) / P ** 2 * b * s * (2 * h + 2 * h_kv_eff) * d * e)


@pytest.mark.parametrize("P, dtype", [(2, torch.float64), (3, torch.float32), (4, torch.float32)])
def test_ring_memory_per_rank_is_the_o_s_over_p_formula(P, dtype):
    b, h, h_kv, d, s = 2, 12, KV_HEADS[P], 8, 8 * P
    for r in run_ranks(_comm_and_memory, P, dtype, timeout=120):
        assert r["ring"]["saved"] == ls.ring_saved_bytes(b, h, h_kv, s // P, d, dtype)


def test_zigzag_balances_causal_work():
    P, s = 4, 32
    contiguous = ls.causal_pairs_per_rank(s, P, "contiguous")
    zigzag = ls.causal_pairs_per_rank(s, P, "zigzag")
    assert sum(contiguous) == sum(zigzag) == s * (s + 1) // 2
    assert len(set(zigzag)) == 1                                 # every rank the same
    assert contiguous == sorted(contiguous) and contiguous[-1] > 6 * contiguous[0]  # last rank ~2P-1 times more
    # the ring's blocks compute exactly the attended pairs of the zigzag shard, equal on every rank
    b, h = 2, 12
    for rank, r in enumerate(run_ranks(_comm_and_memory, P, torch.float64, timeout=120)):
        assert r["ring"]["work"] == b * h * zigzag[rank]


def test_zigzag_shard_round_trip_and_positions():
    x = torch.arange(24).view(1, 24)
    shards = [ls.zigzag_shard(x, 1, r, 3) for r in range(3)]
    assert shards[0].tolist() == [[0, 1, 2, 3, 20, 21, 22, 23]]
    assert torch.equal(ls.zigzag_unshard(shards, 1), x)


def _bad_inputs(rank, P):
    group = dist.group.WORLD
    q = torch.randn(1, 6, 5, 4)
    kv = torch.randn(1, 6, 5, 4)
    ls.comm_log.clear()
    msgs = value_errors(
        lambda: ls.ring_attention(q, kv, kv, group, causal=True),                    # odd local length: zigzag
        lambda: ls.ulysses_attention(torch.randn(1, 5, 4, 4), torch.randn(1, 5, 4, 4),
                                     torch.randn(1, 5, 4, 4), group),                # H=5 % P
        lambda: ls.ring_attention(torch.randn(1, 6, 4, 4), torch.randn(1, 4, 4, 4),
                                  torch.randn(1, 4, 4, 4), group),                   # H % H_kv
        lambda: ls.zigzag_shard(torch.randn(1, 2, 6, 4), 2, rank, P),                 # s % 2P
        lambda: ls.contiguous_shard(torch.randn(1, 2, 5, 4), 2, rank, P),             # s % P
    )
    return msgs, dict(ls.comm_log)


def test_bad_input_raises_before_any_communication():
    for msgs, log in run_ranks(_bad_inputs, 2, timeout=60):
        assert log == {}  # nothing was sent
        assert "must be even" in msgs[0]
        assert "H=5 must be divisible by P=2" in msgs[1]
        assert "multiple of KV heads" in msgs[2]
        assert "not divisible by 2*world = 4" in msgs[3]
        assert "not divisible by world = 2" in msgs[4]
