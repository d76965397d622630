"""moe_ep.py: EP on 2/3/4 ranks equals the single-process MoE (float64), edge cases, losses, gradient placement."""
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import chapter_core
import moe_ep
import topology
from multirank import run_ranks, value_errors

# float64 throughout: EP moves the same rows to the same expert matmuls, so outputs and expert gradients agree
# to the last bit or to summation-order rounding (~1e-16 relative); router gradients are summed over ranks in a
# different order. 1e-12 is far below any routing or scaling mistake (those are O(1e-2) or more).
TOL = 1e-12


def naive_moe(moe, x):
    """Token by token, expert by expert: the definition, written independently of the vectorised code."""
    probs = torch.softmax(x @ moe.router.weight.t(), -1)
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        top = probs[t].topk(moe.top_k)
        w = top.values / top.values.sum() if moe.router.normalize and moe.top_k > 1 else top.values
        for weight, e in zip(w, top.indices):
            y[t] += weight * (F.gelu(x[t] @ moe.w1[e]) @ moe.w2[e])
    return y


def test_single_process_moe_matches_the_naive_definition():
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    for k, normalize in ((1, False), (1, True), (2, True), (4, True)):
        moe = moe_ep.MoE(8, 16, 4, k, normalize_topk=normalize)
        x = torch.randn(20, 8)
        assert (moe(x)[0] - naive_moe(moe, x)).abs().max() < TOL


def test_top1_router_learns_from_the_task_loss():
    # top-1 is not renormalised (a weight of exactly 1 is a constant): with the auxiliary losses off, the task
    # loss alone reaches the router, the same as without normalisation. Renormalised, the router's gradient was
    # rounding error only, far below the bound.
    torch.set_default_dtype(torch.float64)
    gen = torch.Generator().manual_seed(2)
    x, g = torch.randn(20, 8, generator=gen), torch.randn(20, 8, generator=gen)
    grads = []
    for normalize in (True, False):
        torch.manual_seed(0)
        moe = moe_ep.MoE(8, 16, 4, 1, normalize_topk=normalize, aux_loss_coeff=0.0, z_loss_coeff=0.0)
        (moe(x)[0] * g).sum().backward()
        grads.append(moe.router.weight.grad)
    assert grads[0].norm() > 1e-2
    assert torch.equal(grads[0], grads[1])


def _ep_rank(rank, P, E, k, T, route_to=None, seed=0):
    torch.set_default_dtype(torch.float64)
    group = dist.group.WORLD
    d, h = 8, 12
    torch.manual_seed(seed)
    moe = moe_ep.MoE(d, h, E, k, ep_group=group, stats_group=group)
    torch.manual_seed(seed)
    ref = moe_ep.MoE(d, h, E, k)
    gen = torch.Generator().manual_seed(seed + 1)
    x_all = torch.randn(P * T, d, generator=gen)
    if route_to is not None:  # every token strongly prefers expert `route_to` (and k-1 others by chance)
        for m in (moe, ref):
            with torch.no_grad():
                m.router.weight[route_to] = 50.0
        x_all = x_all.abs()
    g_all = torch.randn(P * T, d, generator=gen)
    mine = slice(rank * T, (rank + 1) * T)
    x = x_all[mine].clone().requires_grad_(True)
    moe_ep.comm_log.clear()
    y, aux = moe(x)
    ((y * g_all[mine]).sum() + aux).backward()
    x_ref = x_all.clone().requires_grad_(True)
    y_ref, aux_ref = ref(x_ref)
    ((y_ref * g_all).sum() + aux_ref).backward()
    experts = slice(rank * (E // P), (rank + 1) * (E // P))
    router_sum = moe.router.weight.grad.clone()
    dist.all_reduce(router_sum)
    # token copies that leave this rank and that arrive from the others, from the reference's routing of all tokens
    rank_of_copy = ref.router(x_all)[2] // (E // P)
    ours = torch.zeros(P * T, dtype=torch.bool)
    ours[mine] = True
    return {
        "sent_away": (rank_of_copy[ours] != rank).sum().item() * d * 8,
        "received": (rank_of_copy[~ours] == rank).sum().item() * d * 8,
        "y": (y - y_ref[mine]).abs().max().item(),
        "x_grad": (x.grad - x_ref.grad[mine]).abs().max().item(),
        "w1": (moe.w1 - ref.w1[experts]).abs().max().item(),     # layout-independent initialisation
        "w1_grad": (moe.w1.grad - ref.w1.grad[experts]).abs().max().item(),
        "w2_grad": (moe.w2.grad - ref.w2.grad[experts]).abs().max().item(),
        "router_grad": (router_sum - ref.router.weight.grad).abs().max().item(),
        "aux": abs(aux.item() - aux_ref.item()),
        "log": dict(moe_ep.comm_log),
    }


@pytest.mark.parametrize("P, E", [(2, 4), (3, 6), (4, 8)])
@pytest.mark.parametrize("k", [1, 2])
def test_ep_equals_single_process_moe(P, E, k):
    for r in run_ranks(_ep_rank, P, E, k, 10, timeout=120):
        for key in ("y", "x_grad", "w1", "w1_grad", "w2_grad", "router_grad", "aux"):
            assert r[key] < TOL, (key, r[key])
        assert r["log"]["dispatch_fwd:count"] == 1 and r["log"]["combine_fwd:count"] == 1
        assert r["log"]["dispatch_bwd:count"] == 1 and r["log"]["combine_bwd:count"] == 1
        # bytes that left this rank in each all-to-all (float64 rows of d=8): dispatch forward sends its tokens'
        # copies away, combine forward returns the results of the copies it received; each backward sends the
        # gradients along the other direction's routes
        assert r["log"]["dispatch_fwd:bytes"] == r["log"]["combine_bwd:bytes"] == r["sent_away"]
        assert r["log"]["combine_fwd:bytes"] == r["log"]["dispatch_bwd:bytes"] == r["received"]
        # the counts all-to-all: E/P int64 counts to each of the P-1 other ranks (P=2, E=4: 16 bytes, not 32)
        assert r["log"]["counts_a2a:bytes"] == E // P * 8 * (P - 1)


def test_top_k_equal_to_num_experts():
    for r in run_ranks(_ep_rank, 2, 4, 4, 6, timeout=120):
        assert max(r[key] for key in ("y", "x_grad", "w1_grad", "w2_grad", "router_grad")) < TOL


def test_all_tokens_to_one_expert_and_ranks_that_receive_nothing():
    # k=1 and every token on expert 0 (EP rank 0): ranks 1-3 receive no token at all, their experts no gradient
    for rank, r in enumerate(run_ranks(_ep_rank, 4, 8, 1, 8, 0, timeout=120)):
        assert max(r[key] for key in ("y", "x_grad", "w1_grad", "w2_grad", "router_grad")) < TOL
        sent_away = r["log"].get("dispatch_fwd:bytes", 0)
        assert sent_away == (0 if rank == 0 else 8 * 8 * 8)  # T=8 rows of d=8 float64 leave ranks 1..3


def _uniform_routing_bytes(rank, P):
    torch.set_default_dtype(torch.float64)
    E = d = 8
    T = 16
    moe = moe_ep.MoE(d, 4, E, 1, ep_group=dist.group.WORLD)
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(E))
    x = 10 * torch.eye(E).repeat(T // E, 1)  # token t prefers expert t mod E: perfectly uniform routing
    x.requires_grad_(True)  # else no gradient goes back through the dispatch
    moe_ep.comm_log.clear()
    y, aux = moe(x)
    (y.sum() + aux).backward()
    return dict(moe_ep.comm_log)


@pytest.mark.parametrize("P", [2, 4])
def test_all_to_all_bytes_equal_the_uniform_routing_formula(P):
    T, k, d, e = 16, 1, 8, 8
    for log in run_ranks(_uniform_routing_bytes, P, timeout=60):
        for kind in ("dispatch_fwd", "combine_fwd", "dispatch_bwd", "combine_bwd"):
            assert log[kind + ":count"] == 1 and log[kind + ":bytes"] == T * k * d * e * (P - 1) / P, kind


def test_capacity_drops_exactly_the_lowest_weight_assignments():
    torch.set_default_dtype(torch.float64)
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    weights = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.5, 0.5], [0.7, 0.3]])
    # capacity 2: expert 0 has four assignments with weights 0.6, 0.9, 0.5, 0.3 -> keeps 0.9 and 0.6
    keep = moe_ep.apply_capacity(experts, weights, 4, 2)
    assert keep.tolist() == [[True, True], [True, True], [False, True], [True, False]]
    assert moe_ep.expert_capacity(tokens=4, top_k=2, num_experts=4, capacity_factor=1.0) == 2
    assert moe_ep.expert_capacity(tokens=10, top_k=2, num_experts=4, capacity_factor=1.25) == math.ceil(6.25)
    # inside the layer: a dropped slot contributes nothing, the kept ones are unchanged
    torch.manual_seed(0)
    moe = moe_ep.MoE(8, 16, 4, 2, capacity_factor=0.5)
    x = torch.randn(12, 8)
    y, _ = moe(x)
    logits, w, ex = moe.router(x)
    keep = moe_ep.apply_capacity(ex, w, 4, moe_ep.expert_capacity(12, 2, 4, 0.5))
    assert (~keep).sum() > 0
    expected = torch.zeros_like(x)
    for t in range(12):
        for j in range(2):
            if keep[t, j]:
                e = ex[t, j]
                expected[t] += w[t, j] * (F.gelu(x[t] @ moe.w1[e]) @ moe.w2[e])
    assert (y - expected).abs().max() < TOL
    assert torch.bincount(ex[keep], minlength=4).max() <= 3


def test_expert_capacity_is_exact_for_the_factor_as_written():
    # in floats 100 * 2 / 4 * 1.1 = 55.00000000000001 and 100 * 0.07 = 7.000000000000001: ceil gave 56 and 8
    assert moe_ep.expert_capacity(100, 2, 4, 1.1) == 55
    assert moe_ep.expert_capacity(100, 1, 1, 0.07) == 7
    # against integer arithmetic on the decimal as written: cf = digits / 10**places
    for written in ("0.07", "0.1", "0.3", "0.75", "1", "1.1", "1.15", "1.2", "1.25", "1.3", "2.2"):
        digits, places = int(written.replace(".", "")), len(written.partition(".")[2])
        for tokens in range(0, 130, 7):
            for top_k, num_experts in ((1, 1), (1, 4), (2, 4), (2, 6), (3, 8), (6, 64)):
                exact = -(-tokens * top_k * digits // (num_experts * 10 ** places))
                assert moe_ep.expert_capacity(tokens, top_k, num_experts, float(written)) == exact, \
                    (tokens, top_k, num_experts, written)


def test_auxiliary_losses_on_a_hand_computed_example():
    torch.set_default_dtype(torch.float64)
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 0.0, 3.0], [0.5, 0.0, 0.0]])
    p = torch.softmax(logits, -1)
    # top-1 experts: 0, 1, 2, 0 -> f = [2/4, 1/4, 1/4]; P_i = column means of p
    f = torch.tensor([0.5, 0.25, 0.25])
    expected = 0.1 * 3 * (f * p.mean(0)).sum()
    assert moe_ep.load_balancing_loss(logits, 1, 0.1).item() == pytest.approx(expected.item(), rel=1e-14)
    # hand arithmetic for the first row: p0 = e^2 / (e^2 + 2)
    assert p[0, 0].item() == pytest.approx(math.exp(2) / (math.exp(2) + 2), rel=1e-14)
    lse = [math.log(math.exp(2) + 2), math.log(math.e + 2), math.log(math.e + 1 + math.exp(3)),
           math.log(math.exp(0.5) + 2)]
    assert moe_ep.z_loss(logits, 1e-3).item() == pytest.approx(1e-3 * sum(v * v for v in lse) / 4, rel=1e-14)
    # top-2: f counts both choices of every token over T*k = 8 assignments
    f2 = torch.bincount(p.topk(2).indices.reshape(-1), minlength=3) / 8
    assert moe_ep.load_balancing_loss(logits, 2, 1.0).item() == pytest.approx(3 * (f2 * p.mean(0)).sum().item())
    # uniform routing gives exactly coeff
    assert moe_ep.load_balancing_loss(torch.zeros(8, 4), 1, 0.01, selected=torch.arange(8).remainder(4)[:, None]) \
        .item() == pytest.approx(0.01)


def test_router_losses_of_16_bit_logits_are_computed_in_float32():
    # bfloat16 logits (randn(64, 8) * 3, seed 0): measured 1.084054 and 28.853458 in float32, equal to the losses
    # of the logits cast to float32; in bfloat16 they were 1.078125 and 28.875
    torch.manual_seed(0)
    logits = (torch.randn(64, 8, dtype=torch.float32) * 3).bfloat16()
    for loss in (lambda x: moe_ep.load_balancing_loss(x, 2, 1.0), lambda x: moe_ep.z_loss(x, 1.0)):
        got, want = loss(logits), loss(logits.float())
        assert got.dtype == torch.float32 and want.dtype == torch.float32
        assert got.item() == want.item(), (got.item(), want.item())  # the same float32 arithmetic: equal


def test_balancing_bias_update_rule_and_selection_only():
    bias = torch.zeros(4)
    moe_ep.update_balancing_bias(bias, torch.tensor([10, 2, 4, 0]), rate=0.01)  # mean load 4
    assert bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.01])
    torch.set_default_dtype(torch.float64)
    router = moe_ep.BiasBalancedRouter(4, 4, 1, normalize=False)
    x = torch.randn(6, 4)
    _, w_before, e_before = router(x)
    router.bias[:] = torch.tensor([0.0, 0.0, 0.0, 10.0])  # a huge bias: expert 3 always selected
    _, w_after, e_after = router(x)
    assert torch.all(e_after == 3)
    assert torch.allclose(w_after[:, 0], torch.softmax(x @ router.weight.t(), -1)[:, 3])  # weights without bias
    assert not any(n == "bias" for n, _ in router.named_parameters())


def test_bias_balanced_moe_is_the_chapters_layer_with_the_bias_router():
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    plain, plain_next = moe_ep.MoE(8, 12, 4, 1), torch.rand(1)
    torch.manual_seed(0)
    balanced, balanced_next = moe_ep.BiasBalancedMoE(8, 12, 4, 1), torch.rand(1)
    # the same weights from the same seed, and the RNG left where the chapter's layer leaves it
    assert isinstance(balanced.router, moe_ep.BiasBalancedRouter) and torch.equal(plain_next, balanced_next)
    weights = {k: v for k, v in balanced.state_dict().items() if k != "router.bias"}
    assert weights.keys() == plain.state_dict().keys()
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in weights.items())
    x = torch.randn(5, 8)
    assert torch.equal(plain(x)[0], balanced(x)[0])  # a zero bias: the chapter's layer
    balanced.router.bias[:] = torch.tensor([0.0, 0.0, 0.0, 10.0])
    balanced(x)
    assert balanced.last_load.tolist() == [0, 0, 0, 5]  # the bias selects


def _split_invariant_aux(rank, P):
    torch.set_default_dtype(torch.float64)
    logits_all = torch.randn(12, 6, generator=torch.Generator().manual_seed(3))
    sizes = [2, 4, 6][:P] if P == 3 else [5, 7]  # uneven splits of the same 12 tokens
    start = sum(sizes[:rank])
    mine = logits_all[start:start + sizes[rank]].clone().requires_grad_(True)
    lb = moe_ep.load_balancing_loss(mine, 2, 0.1, group=dist.group.WORLD)
    z = moe_ep.z_loss(mine, 0.01, group=dist.group.WORLD)
    (lb + z).backward()
    return lb.item(), z.item(), mine.grad, start


@pytest.mark.parametrize("P", [2, 3])
def test_router_statistics_summed_over_a_group_do_not_depend_on_the_split(P):
    logits = torch.randn(12, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    full = logits.clone().requires_grad_(True)
    lb, z = moe_ep.load_balancing_loss(full, 2, 0.1), moe_ep.z_loss(full, 0.01)
    (lb + z).backward()
    for lb_r, z_r, grad, start in run_ranks(_split_invariant_aux, P, timeout=60):
        assert lb_r == pytest.approx(lb.item(), abs=1e-15) and z_r == pytest.approx(z.item(), abs=1e-15)
        assert (grad - full.grad[start:start + grad.shape[0]]).abs().max() < TOL


def _bad_moe(rank, P):
    moe_ep.comm_log.clear()
    msgs = value_errors(lambda: moe_ep.MoE(8, 8, 5, 1, ep_group=dist.group.WORLD),
                        lambda: moe_ep.MoE(8, 8, 4, 5, ep_group=dist.group.WORLD),
                        lambda: moe_ep.MoE(8, 8, 4, 1, ep_group=dist.group.WORLD)(torch.randn(3, 7)),
                        lambda: moe_ep.MoE(8, 8, 4, 1, ep_group=dist.group.WORLD, capacity_factor=float("nan")),
                        lambda: moe_ep.MoE(8, 8, 4, 1, ep_group=dist.group.WORLD, capacity_factor=float("inf")))
    return msgs, dict(moe_ep.comm_log)


def test_bad_input_raises_before_any_collective():
    for msgs, log in run_ranks(_bad_moe, 2, timeout=60):
        assert log == {}
        assert "num_experts=5 is not divisible by the EP group size 2" in msgs[0]
        assert "top_k=5 must be between 1 and num_experts=4" in msgs[1]
        assert "d_model=8" in msgs[2]
        assert "capacity_factor=nan must be positive and finite" in msgs[3]
        assert "capacity_factor=inf must be positive and finite" in msgs[4]


def _bad_router_losses(rank, P):
    moe_ep.comm_log.clear()
    g = dist.group.WORLD
    logits = torch.randn(2, 5, 4)  # (batch, seq, experts): the losses count tokens along dimension 0
    msgs = value_errors(lambda: moe_ep.z_loss(logits, 0.1, group=g),
                        lambda: moe_ep.load_balancing_loss(logits, 1, 0.1, group=g),
                        lambda: moe_ep.router_losses(logits, 1, 0.1, 0.1, group=g),
                        lambda: moe_ep.load_balancing_loss(logits[0], 0, 0.1, group=g),
                        lambda: moe_ep.router_losses(logits[0], 5, 0.1, 0.1, group=g),
                        lambda: moe_ep.z_loss(logits, 0.1))
    return msgs, dict(moe_ep.comm_log)


def test_router_losses_refuse_bad_input_before_any_collective():
    for msgs, log in run_ranks(_bad_router_losses, 2, timeout=60):
        assert log == {}
        assert all(m is not None and "router_logits has shape (2, 5, 4)" in m for m in msgs[:3] + msgs[5:]), msgs
        assert "top_k=0 must be an int between 1 and the 4 experts" in msgs[3]
        assert "top_k=5 must be an int between 1 and the 4 experts" in msgs[4]


def test_balancing_bias_stays_float32_when_the_model_is_cast_to_bfloat16():
    router = moe_ep.BiasBalancedRouter(8, 4, 2).to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16 and router.bias.dtype == torch.float32
    for _ in range(1000):  # expert 3 always under-loaded: +1e-3 per step, 1.0 after 1000 (bf16 stalls at 0.5)
        moe_ep.update_balancing_bias(router.bias, torch.tensor([5, 5, 5, 1]), rate=1e-3)
    assert router.bias[3].item() == pytest.approx(1.0, abs=1e-4)
    assert router.state_dict()["bias"].dtype == torch.float32
    _, weights, _ = router(torch.randn(3, 8, dtype=torch.bfloat16))
    assert weights.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="keep the balancing bias in torch.float32"):
        moe_ep.update_balancing_bias(torch.zeros(4, dtype=torch.bfloat16), torch.tensor([1, 1, 1, 1]), 1e-3)


def _folded_layout(rank, world):
    """4 ranks, DP=4, EP=2 -> EDP=2 (topology's folded expert grid); each rank a different batch."""
    torch.set_default_dtype(torch.float64)
    groups = topology.rank_groups(world, ep=2)
    handles = {}
    for kind in ("ep", "edp", "dp_cp"):
        for ranks in groups[kind]:
            g = dist.new_group(ranks)
            if rank in ranks:
                handles[kind] = g
    ep_rank = dist.get_rank(handles["ep"])
    E, T, d = 4, 6, 8
    torch.manual_seed(0)
    moe = moe_ep.MoE(d, 8, E, 2, ep_group=handles["ep"], aux_loss_coeff=0.0, z_loss_coeff=0.0)
    torch.manual_seed(0)
    ref = moe_ep.MoE(d, 8, E, 2)
    x_all = torch.randn(world, T, d, generator=torch.Generator().manual_seed(5))
    moe(x_all[rank])[0].square().mean().backward()
    moe_ep.reduce_moe_gradients(moe, handles["dp_cp"], handles["edp"])  # sums; the caller normalises
    # the objective whose gradient the SUM is: the sum over the 4 data-parallel ranks of each rank's mean loss
    sum(ref(x_all[r])[0].square().mean() for r in range(world)).backward()
    mine = slice(ep_rank * (E // 2), (ep_rank + 1) * (E // 2))
    return max((moe.router.weight.grad - ref.router.weight.grad).abs().max().item(),
               (moe.w1.grad - ref.w1.grad[mine]).abs().max().item(),
               (moe.w2.grad - ref.w2.grad[mine]).abs().max().item())


def test_expert_gradients_summed_over_edp_dense_over_dp_cp():
    # a mean (division by DP x CP) would be off by a factor 4, far above TOL
    assert max(run_ranks(_folded_layout, 4, timeout=60)) < TOL


# ----------------------------------------------------------------------------------------------------
# The router losses of a micro-batch split over a stats_group (CP, or TP under SP) do not depend on the split
# ----------------------------------------------------------------------------------------------------

def _split_micro_batch(rank, P, sizes):
    """One micro-batch of sum(sizes) tokens split unevenly over P ranks that all hold every expert (as CP
    ranks do); the router statistics are summed over them. Returns this rank's aux, router and expert grads."""
    torch.set_default_dtype(torch.float64)
    group = dist.group.WORLD
    torch.manual_seed(0)
    moe = moe_ep.MoE(8, 12, 6, 2, stats_group=group, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    gen = torch.Generator().manual_seed(4)
    x_all, g_all = torch.randn(sum(sizes), 8, generator=gen), torch.randn(sum(sizes), 8, generator=gen)
    mine = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    y, aux = moe(x_all[mine])
    ((y * g_all[mine]).sum() + aux).backward()
    return aux.item(), moe.router.weight.grad, moe.w1.grad, moe.w2.grad


@pytest.mark.parametrize("sizes", [[7, 7], [3, 11], [5, 5, 5], [1, 6, 8], [0, 9]])
def test_moe_router_losses_over_a_split_micro_batch_equal_the_whole(sizes):
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    ref = moe_ep.MoE(8, 12, 6, 2, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    gen = torch.Generator().manual_seed(4)
    x_all, g_all = torch.randn(sum(sizes), 8, generator=gen), torch.randn(sum(sizes), 8, generator=gen)
    y, aux = ref(x_all)
    ((y * g_all).sum() + aux).backward()
    assert aux.item() > 0.1  # the losses are on (a balancing loss alone is >= coeff = 0.1)
    results = run_ranks(_split_micro_batch, len(sizes), sizes, timeout=60)
    for aux_r, *_ in results:
        assert abs(aux_r - aux.item()) < 1e-15  # measured 0 to 3e-17 (summation order of the statistics)
    # summed over the group (what the gradient reduction over CP does), every gradient is the whole one's
    for i, p in enumerate((ref.router.weight, ref.w1, ref.w2)):
        assert (sum(r[i + 1] for r in results) - p.grad).abs().max() < TOL


def _no_tokens_in_the_group(rank, P):
    torch.set_default_dtype(torch.float64)
    group = dist.group.WORLD
    torch.manual_seed(0)
    moe = moe_ep.MoE(8, 12, 4, 2, ep_group=group, stats_group=group)
    x = torch.randn(0, 8, requires_grad=True)
    y, aux = moe(x)
    (y.sum() + aux).backward()
    return aux.item(), aux.grad_fn is not None, moe.router.weight.grad


def test_no_tokens_give_router_losses_that_are_a_zero_in_the_graph():
    # a rank with no tokens (grad_accum.py allows them) and no group to bring statistics from: 0, not 0/0
    torch.set_default_dtype(torch.float64)
    logits = torch.randn(0, 4, requires_grad=True)
    losses = [moe_ep.load_balancing_loss(logits, 2, 0.01), moe_ep.z_loss(logits, 1e-3),
              moe_ep.router_losses(logits, 2, 0.01, 1e-3)]
    for loss in losses:
        assert loss.item() == 0 and loss.requires_grad
    sum(losses).backward()
    assert logits.grad.shape == (0, 4)
    torch.manual_seed(0)
    moe = moe_ep.MoE(16, 32, 4, 2)
    y, aux = moe(torch.randn(0, 16))
    (y.sum() + aux).backward()
    assert y.shape == (0, 16) and aux.item() == 0 and torch.equal(moe.router.weight.grad, torch.zeros(4, 16))
    # a group where no rank has a token: the summed counts are zero, the losses too (one rank with none is
    # exact: test_moe_router_losses_over_a_split_micro_batch_equal_the_whole, sizes [0, 9])
    for aux_r, in_graph, router_grad in run_ranks(_no_tokens_in_the_group, 2, timeout=60):
        assert aux_r == 0 and in_graph and torch.equal(router_grad, torch.zeros(4, 8))


def _router_stats_allreduces(rank, P):
    """All-reduces of router statistics: of one MoE forward (both losses on), of the two standalone losses and
    of router_losses; and the standalone pair against router_losses, value and logits' gradient."""
    torch.set_default_dtype(torch.float64)
    group = dist.group.WORLD
    torch.manual_seed(0)
    moe = moe_ep.MoE(8, 12, 6, 2, stats_group=group, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    counts = []
    moe_ep.comm_log.clear()
    moe(torch.randn(5 + rank, 8, generator=torch.Generator().manual_seed(rank)))
    counts.append(moe_ep.comm_log["router_stats_allreduce:count"])
    logits = torch.randn(4 + 3 * rank, 6, generator=torch.Generator().manual_seed(7 + rank))
    results = []
    for combined in (False, True):
        mine = logits.clone().requires_grad_(True)
        moe_ep.comm_log.clear()
        if combined:
            loss = moe_ep.router_losses(mine, 2, 0.1, 0.01, group)
        else:
            loss = moe_ep.load_balancing_loss(mine, 2, 0.1, group) + moe_ep.z_loss(mine, 0.01, group)
        counts.append(moe_ep.comm_log["router_stats_allreduce:count"])
        loss.backward()
        results.append((loss.item(), mine.grad))
    (separate, separate_grad), (combined, combined_grad) = results
    return counts, separate - combined, (separate_grad - combined_grad).abs().max().item()


def test_moe_layer_sums_both_router_losses_statistics_in_one_allreduce():
    for counts, value_diff, grad_diff in run_ranks(_router_stats_allreduces, 2, timeout=60):
        assert counts == [1, 2, 1]  # MoE forward; load_balancing_loss + z_loss; router_losses
        assert value_diff == 0 and grad_diff == 0  # the same statistics summed: the same arithmetic


def test_local_router_losses_do_depend_on_the_split():
    # the failure the stats_group prevents: without it each rank's aux is its own shard's, not the whole's
    torch.set_default_dtype(torch.float64)
    logits = torch.randn(14, 6, generator=torch.Generator().manual_seed(3))
    whole = moe_ep.load_balancing_loss(logits, 2, 0.1)
    shards = [moe_ep.load_balancing_loss(logits[:3], 2, 0.1), moe_ep.load_balancing_loss(logits[3:], 2, 0.1)]
    assert min(abs(s.item() - whole.item()) for s in shards) > 1e-4


# ----------------------------------------------------------------------------------------------------
# One host synchronisation per layer per micro-batch
# ----------------------------------------------------------------------------------------------------

def test_host_sync_counter_sees_every_kind_of_host_read():
    tolist = torch.Tensor.tolist
    x = torch.randn(12)
    e = torch.tensor([0, 2, 2, 1])
    w = torch.randn(4, requires_grad=True)
    cases = {
        "tolist": lambda: e.tolist(),
        "_local_scalar_dense": lambda: x.sum().item(),
        "bincount": lambda: torch.bincount(e, minlength=4),
        "nonzero": lambda: torch.nonzero(x > 0),
        "boolean index": lambda: x[x > 0],
        "masked_select": lambda: torch.masked_select(x, x > 0),
        "repeat_interleave without output_size": lambda: torch.repeat_interleave(e),
    }
    for kind, call in cases.items():
        with moe_ep.HostSyncCounter() as c:
            call()
        assert c.syncs == {kind: 1}, (kind, c.syncs)
    with moe_ep.HostSyncCounter() as c:  # the backward of a boolean index is a boolean index_put
        w[e > 0].sum().backward()
    assert c.syncs == {"boolean index": 2}
    with moe_ep.HostSyncCounter() as c:  # sized by shapes or by given sizes: nothing to wait for
        torch.repeat_interleave(e, output_size=5)
        moe_ep.tokens_per_expert(e, 4)
        x.index_select(0, e)
        torch.where(x > 0, x, 0.0)
        x.new_full((), 3)
    assert sum(c.syncs.values()) == 0 and c.uploads == 0
    with moe_ep.HostSyncCounter() as c:
        torch.tensor(float(x.shape[0]))
    assert c.uploads == 1
    assert torch.Tensor.tolist is tolist and e.tolist() == [0, 2, 2, 1]  # restored on exit


def _syncs_of_a_step(rank, P, dtype, impl, capacity_factor, layers=2, micro_batches=2):
    """`layers` MoE layers, `micro_batches` forward + backward passes, counted; returns the counts."""
    torch.set_default_dtype(dtype)
    group = dist.group.WORLD if P > 1 else None
    torch.manual_seed(0)
    E = 6 if P == 3 else 4
    stack = [moe_ep.GroupedGEMMMoE(16, 32, E, 2, ep_group=group, stats_group=group, capacity_factor=capacity_factor,
                                   expert_impl=impl) for _ in range(layers)]
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(2, 6, 16, generator=gen).to(dtype).requires_grad_(True) for _ in range(micro_batches)]
    with moe_ep.HostSyncCounter() as c:
        for x in batches:
            aux_total = 0
            for moe in stack:
                x, aux = moe(x)
                aux_total = aux_total + aux
            (x.float().square().sum() + aux_total).backward()
    return dict(c.syncs), c.uploads, c.ops["_grouped_mm"]


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_one_host_synchronisation_per_layer_per_micro_batch(P, capacity_factor):
    # float64 runs the expert loop: with P = 1 its slice sizes, with P > 1 the split sizes (and the loop's
    # sizes in the same transfer): one .tolist() per layer per micro-batch, forward and backward together.
    # The code at the parent commit made, by this counter, 10 (EP 1) and 13 (EP 2) per layer per micro-batch.
    for syncs, uploads, grouped_calls in run_ranks(_syncs_of_a_step, P, torch.float64, "auto", capacity_factor,
                                                   timeout=60):
        assert syncs == {"tolist": 2 * 2} and uploads == 0 and grouped_calls == 0


@pytest.mark.parametrize("P", [1, 2])
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_grouped_gemm_needs_the_host_only_for_the_split_sizes(P, capacity_factor):
    if not moe_ep.grouped_gemm_supported(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no CPU grouped GEMM for float32")
    for syncs, uploads, grouped_calls in run_ranks(_syncs_of_a_step, P, torch.float32, "grouped", capacity_factor,
                                                   timeout=60):
        # with P = 1 and no capacity nothing is read back (the grouped GEMM takes the counts on the device);
        # with P > 1 the split sizes, with a capacity the number of kept copies: 1 per layer per micro-batch
        expected = {} if (P == 1 and capacity_factor is None) else {"tolist": 2 * 2}
        assert syncs == expected and uploads == 0
        assert grouped_calls == 2 * 2 * 2 * 3  # 2 GEMMs per layer, 1 forward + 2 backward (input and weight
        # gradients), 2 layers x 2 micro-batches


# ----------------------------------------------------------------------------------------------------
# Grouped GEMM and the loop over experts agree
# ----------------------------------------------------------------------------------------------------

def _loop_and_grouped(rank, P, dtype, capacity_factor):
    group = dist.group.WORLD if P > 1 else None
    out = {}
    for impl in ("loop", "grouped"):
        torch.manual_seed(0)
        moe = moe_ep.GroupedGEMMMoE(16, 32, 4, 2, ep_group=group, stats_group=group, capacity_factor=capacity_factor,
                                    expert_impl=impl).to(dtype)
        gen = torch.Generator().manual_seed(rank + 10)
        x = torch.randn(3, 8, 16, generator=gen).to(dtype).requires_grad_(True)
        g = torch.randn(3, 8, 16, generator=gen).to(dtype)
        y, aux = moe(x)
        ((y * g).sum() + aux).backward()
        out[impl] = [t.float() for t in (y, x.grad, moe.w1.grad, moe.w2.grad, moe.router.weight.grad)]
    return [(a - b).abs().max().item() / max(a.abs().max().item(), 1e-30) for a, b in zip(out["loop"], out["grouped"])]


@pytest.mark.parametrize("P", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_grouped_gemm_equals_the_loop_over_experts(P, dtype, capacity_factor):
    if not moe_ep.grouped_gemm_supported(torch.device("cpu"), dtype):
        pytest.skip(f"this torch has no CPU grouped GEMM for {dtype}")
    # On the CPU torch._grouped_mm computes each group with the same GEMM as the loop: measured 0 difference
    # in float32 and bfloat16, so equality is asserted (a wrong offset or expert is an O(1) change).
    bound = 0.0
    for errors in run_ranks(_loop_and_grouped, P, dtype, capacity_factor, timeout=60):
        assert max(errors) <= bound, errors


def test_expert_impl_choice():
    torch.set_default_dtype(torch.float64)
    moe = moe_ep.GroupedGEMMMoE(16, 32, 4, 2)
    assert not moe.uses_grouped_gemm(torch.randn(3, 16))  # float64: no grouped GEMM in torch, the loop runs
    if moe_ep.grouped_gemm_supported(torch.device("cpu"), torch.float32):
        assert moe.float().uses_grouped_gemm(torch.randn(3, 16, dtype=torch.float32))
        odd = moe_ep.GroupedGEMMMoE(6, 32, 4, 2).float()  # 6 x 4 bytes: rows not 16-byte aligned
        assert not odd.uses_grouped_gemm(torch.randn(3, 6, dtype=torch.float32))
        # alignment is in bytes: 4 and 12 float32 elements are rows of 16 and 48 bytes
        assert moe_ep.GroupedGEMMMoE(4, 12, 4, 2).float().uses_grouped_gemm(torch.randn(3, 4, dtype=torch.float32))
    if moe_ep.grouped_gemm_supported(torch.device("cpu"), torch.bfloat16):  # 8 and 24 bf16: 16 and 48 bytes
        assert moe_ep.GroupedGEMMMoE(8, 24, 4, 2).bfloat16().uses_grouped_gemm(torch.randn(3, 8, dtype=torch.bfloat16))
    loop = moe_ep.GroupedGEMMMoE(16, 32, 4, 2, expert_impl="loop").float()
    assert not loop.uses_grouped_gemm(torch.randn(3, 16).float())


def _first_probe(rank, P, dtype):
    """A process that has never tried the grouped GEMM: its first MoE forward runs inside activation
    checkpointing, after a first try under no_grad."""
    moe_ep._grouped_gemm_works.clear()
    with torch.no_grad():
        under_no_grad = moe_ep.grouped_gemm_supported(torch.device("cpu"), dtype)
    moe_ep._grouped_gemm_works.clear()
    torch.manual_seed(0)
    moe = moe_ep.GroupedGEMMMoE(16, 32, 4, 2).to(dtype)
    x = torch.randn(8, 16, dtype=dtype, requires_grad=True)
    y, aux = torch.utils.checkpoint.checkpoint(moe, x, use_reentrant=False)
    (y.sum() + aux).backward()  # the recomputation must save what the first forward saved
    return under_no_grad, moe_ep._grouped_gemm_works[(str(torch.device("cpu")), dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_grouped_gemm_try_is_invisible_to_checkpointing_and_no_grad(dtype):
    # The try used to run in the caller's context: inside a checkpointed block it saved 3 more tensors in the
    # first forward than the recomputation (CheckpointError), and under no_grad its backward failed, so a
    # supported dtype was recorded as unsupported. A fresh process is forked so that nothing is cached.
    under_no_grad, supported = run_ranks(_first_probe, 1, dtype, timeout=60)[0]
    assert under_no_grad == supported


def _bad_impl(rank, P):
    moe_ep.comm_log.clear()
    group = dist.group.WORLD
    msgs = value_errors(lambda: moe_ep.GroupedGEMMMoE(8, 8, 4, 1, ep_group=group, expert_impl="fast"),
                        lambda: moe_ep.GroupedGEMMMoE(8, 8, 4, 1, ep_group=group, stats_group=group,
                                                      expert_impl="grouped")(torch.randn(3, 8, dtype=torch.float64)),
                        lambda: moe_ep.load_balancing_loss(torch.randn(4, 4), 2, 0.1, group=group,
                                                           selected=torch.zeros(4, 1, dtype=torch.long)))
    return msgs, dict(moe_ep.comm_log)


def test_bad_expert_impl_raises_before_any_collective():
    for msgs, log in run_ranks(_bad_impl, 2, timeout=60):
        assert log == {}
        assert "expert_impl='fast' must be 'auto', 'grouped' or 'loop'" in msgs[0]
        assert "expert_impl='grouped' but torch._grouped_mm does not run torch.float64" in msgs[1]
        assert "selected has shape (4, 1)" in msgs[2]


def _capacity_under_ep(rank, P):
    """Capacity is decided on each rank's own tokens: EP must equal the single-process MoE applied to each
    rank's tokens separately (outputs, input gradients, and expert gradients summed over the ranks' chunks)."""
    torch.set_default_dtype(torch.float64)
    E, T, d = 4, 12, 8
    torch.manual_seed(0)
    moe = moe_ep.MoE(d, 12, E, 2, ep_group=dist.group.WORLD, capacity_factor=0.75, aux_loss_coeff=0.0,
                     z_loss_coeff=0.0)
    torch.manual_seed(0)
    ref = moe_ep.MoE(d, 12, E, 2, capacity_factor=0.75, aux_loss_coeff=0.0, z_loss_coeff=0.0)
    gen = torch.Generator().manual_seed(1)
    x_all, g_all = torch.randn(P * T, d, generator=gen), torch.randn(P * T, d, generator=gen)
    chunks = [slice(r * T, (r + 1) * T) for r in range(P)]
    x = x_all[chunks[rank]].clone().requires_grad_(True)
    (moe(x)[0] * g_all[chunks[rank]]).sum().backward()
    errors = {}
    for r, chunk in enumerate(chunks):
        x_ref = x_all[chunk].clone().requires_grad_(True)
        y_ref = ref(x_ref)[0]
        (y_ref * g_all[chunk]).sum().backward()
        if r == rank:
            errors["dropped"] = int((y_ref.abs().sum(-1) == 0).sum()) + int(moe.last_load.sum() < 2 * T)
            errors["y"] = (moe(x_all[chunk])[0] - y_ref).abs().max().item()
            errors["x_grad"] = (x.grad - x_ref.grad).abs().max().item()
    mine = slice(rank * (E // P), (rank + 1) * (E // P))
    errors["w1_grad"] = (moe.w1.grad - ref.w1.grad[mine]).abs().max().item()
    return errors


def test_capacity_under_ep_equals_the_single_process_moe_per_rank():
    for e in run_ranks(_capacity_under_ep, 2, timeout=60):
        assert e["dropped"] > 0  # the capacity really drops assignments
        assert max(e["y"], e["x_grad"], e["w1_grad"]) < TOL, e


@pytest.mark.parametrize("k", [1, 2, 3])
def test_balancing_loss_bounds_uniform_coeff_and_collapsed_coeff_e_over_k(k):
    # the docstring: uniform routing gives coeff; every token certain of one expert gives coeff * E / k (that
    # expert gets 1/k of the T*k assignments, probability 1)
    E, T, coeff = 4, 64, 0.01
    uniform = moe_ep.load_balancing_loss(torch.zeros(T, E, dtype=torch.float64), k, coeff,
                                         selected=torch.arange(T * k).reshape(T, k) % E)
    assert uniform.item() == pytest.approx(coeff, rel=1e-12)
    collapsed = torch.full((T, E), -60.0, dtype=torch.float64)
    collapsed[:, 0] = 60.0
    assert moe_ep.load_balancing_loss(collapsed, k, coeff).item() == pytest.approx(coeff * E / k, rel=1e-12)


def test_the_demo_runs_to_its_last_line(tmp_path):
    # `python3 moe_ep.py` as the interpreter would run it (the file as __main__), in a process forked from this one,
    # which has imported torch already
    from chapter_core import ROOT, run_program
    (code, stdout, stderr), = run_program(ROOT, [], 1, tmp_path, timeout=120, environ=False, script="moe_ep.py")
    assert code == 0, stderr
    assert "balancing bias after one update with loads [10, 2, 2, 2]: [-0.001, 0.001, 0.001, 0.001]" in stdout


def _core_ep_rank(rank, P, core, capacity_factor):
    """The core's MoE over an EP group of P ranks and the core's MoE in one process on each rank's tokens in turn
    (capacity is decided per rank's tokens, and so is the chapter's aux loss): float64, the same seed."""
    torch.set_default_dtype(torch.float64)
    E, k, T, d = 4, 2, 12, 8
    torch.manual_seed(0)
    moe = core.MoE(d, 12, E, k, ep_group=dist.group.WORLD, capacity_factor=capacity_factor)
    torch.manual_seed(0)
    ref = core.MoE(d, 12, E, k, capacity_factor=capacity_factor)
    gen = torch.Generator().manual_seed(1)
    x_all, g_all = torch.randn(P * T, d, generator=gen), torch.randn(P * T, d, generator=gen)
    chunks = [slice(r * T, (r + 1) * T) for r in range(P)]
    x = x_all[chunks[rank]].clone().requires_grad_(True)
    core.comm_log.clear()
    y, aux = moe(x)
    ((y * g_all[chunks[rank]]).sum() + aux).backward()
    x_ref = x_all.clone().requires_grad_(True)
    ref_outputs = [ref(x_ref[chunk]) for chunk in chunks]
    sum((y_r * g_all[chunk]).sum() + aux_r for (y_r, aux_r), chunk in zip(ref_outputs, chunks)).backward()
    router_sum = moe.router.weight.grad.clone()
    dist.all_reduce(router_sum)  # each rank holds its own tokens' share of the router's gradient
    experts = slice(rank * (E // P), (rank + 1) * (E // P))
    y_ref, aux_ref = ref_outputs[rank]
    # the router losses of a micro-batch split over the ranks (a stats_group) are the whole micro-batch's
    logits_all = x_all @ ref.router.weight.detach().t()
    split = core.router_losses(logits_all[chunks[rank]], k, 0.01, 1e-3, dist.group.WORLD)
    whole = core.router_losses(logits_all, k, 0.01, 1e-3)
    return {"y": (y - y_ref).abs().max().item(), "aux": abs(aux.item() - aux_ref.item()),
            "stats_group": abs(split.item() - whole.item()),
            "x_grad": (x.grad - x_ref.grad[chunks[rank]]).abs().max().item(),
            "w1_grad": (moe.w1.grad - ref.w1.grad[experts]).abs().max().item(),
            "w2_grad": (moe.w2.grad - ref.w2.grad[experts]).abs().max().item(),
            "router_grad": (router_sum - ref.router.weight.grad).abs().max().item(),
            "kept": moe.last_load.sum().item(), "log": dict(core.comm_log)}


def test_the_core_alone_ep_equals_one_process_and_balancing_loss_is_coeff_at_balance(tmp_path):
    core = chapter_core.load_core("moe_ep", tmp_path)  # loaded before forking: the ranks inherit it
    # the cut is the chapter: the router losses over the ranks sharing a micro-batch, not the at-scale forms
    assert hasattr(core, "router_losses") and not hasattr(core, "HostSyncCounter")
    assert not hasattr(core, "GroupedGEMMMoE") and not hasattr(core, "BiasBalancedRouter")
    for capacity_factor in (None, 0.75):
        for r in run_ranks(_core_ep_rank, 2, core, capacity_factor, timeout=60):
            for key in ("y", "aux", "x_grad", "w1_grad", "w2_grad", "router_grad", "stats_group"):
                assert r[key] < TOL, (capacity_factor, key, r[key])
            assert r["kept"] == (24 if capacity_factor is None else 4 * math.ceil(0.75 * 12 * 2 / 4))
            kinds = ("dispatch_fwd", "combine_fwd", "dispatch_bwd", "combine_bwd", "counts_a2a")
            assert [r["log"][kind + ":count"] for kind in kinds] == [1] * len(kinds)
    # the balancing loss: coeff at perfect balance (f_i = P_i = 1/E), coeff * E / k at collapse (every token
    # certain of expert 0); E = 4, k = 2, 8 tokens
    coeff, one_copy_per_expert = 0.01, torch.arange(16).reshape(8, 2) % 4
    collapse = torch.tensor([60.0, -60.0, -60.0, -60.0], dtype=torch.float64).expand(8, 4)
    balanced = core.load_balancing_loss(torch.zeros(8, 4, dtype=torch.float64), 2, coeff, selected=one_copy_per_expert)
    assert balanced.item() == pytest.approx(coeff, rel=1e-14)
    assert core.load_balancing_loss(collapse, 2, coeff).item() == pytest.approx(coeff * 4 / 2, rel=1e-12)
