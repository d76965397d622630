"""topology.py: Megatron-LM's layout, groups that reach exactly their ranks, the planner's arithmetic."""
import itertools
import random

import pytest
import torch
import torch.distributed as dist

import topology
from multirank import run_ranks


# ---- the layout ----------------------------------------------------------------------------------

def test_megatron_documented_ground_truth():
    g = topology.rank_groups(16, tp=2, pp=4)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert g["embedding"] == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert topology.rank_groups(8, tp=4, cp=2)["cp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def _brute_force(world, tp, pp, cp, ep):
    """Independent enumeration: walk every coordinate tuple, compute its rank by the documented formula and
    bucket ranks by the coordinates that stay fixed within a group."""
    dp = world // (tp * pp * cp)
    edp = cp * dp // ep
    buckets = {k: {} for k in ("tp", "cp", "dp", "pp", "dp_cp", "tp_cp", "tp_pp", "ep", "edp")}
    for t, c, d, p in itertools.product(range(tp), range(cp), range(dp), range(pp)):
        r = t + tp * (c + cp * (d + dp * p))
        buckets["tp"].setdefault((c, d, p), []).append(r)
        buckets["cp"].setdefault((t, d, p), []).append(r)
        buckets["dp"].setdefault((t, c, p), []).append(r)
        buckets["pp"].setdefault((t, c, d), []).append(r)
        buckets["dp_cp"].setdefault((t, p), []).append(r)
        buckets["tp_cp"].setdefault((d, p), []).append(r)
        buckets["tp_pp"].setdefault((c, d), []).append(r)
    for t, e, x, p in itertools.product(range(tp), range(ep), range(edp), range(pp)):
        r = t + tp * (e + ep * (x + edp * p))
        buckets["ep"].setdefault((t, x, p), []).append(r)
        buckets["edp"].setdefault((t, e, p), []).append(r)
    return {k: sorted(sorted(v) for v in b.values()) for k, b in buckets.items()}


def test_rank_groups_match_brute_force_on_random_layouts():
    rng = random.Random(0)
    for _ in range(200):
        tp, pp, cp, dp = (rng.choice([1, 2, 3, 4]) for _ in range(4))
        ep = rng.choice([e for e in range(1, cp * dp + 1) if (cp * dp) % e == 0])
        world = tp * pp * cp * dp
        got = topology.rank_groups(world, tp=tp, pp=pp, cp=cp, ep=ep)
        want = _brute_force(world, tp, pp, cp, ep)
        for kind in want:
            assert got[kind] == want[kind], (kind, tp, pp, cp, dp, ep)
        for r in range(world):
            c = topology.rank_coordinates(r, world, tp, pp, cp, ep)
            assert r == c["tp"] + tp * (c["cp"] + cp * (c["dp"] + dp * c["pp"]))
            assert r == c["tp"] + tp * (c["ep"] + ep * (c["edp"] + (cp * dp // ep) * c["pp"]))


@pytest.mark.parametrize("layout", [(16, 2, 4, 1, 1), (24, 2, 3, 2, 2), (12, 3, 1, 1, 4), (8, 1, 2, 2, 4)])
def test_every_kind_partitions_the_world(layout):
    world, tp, pp, cp, ep = layout
    g = topology.rank_groups(world, tp=tp, pp=pp, cp=cp, ep=ep)
    dp = world // (tp * pp * cp)
    sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp, "dp_cp": dp * cp, "tp_cp": tp * cp, "tp_pp": tp * pp, "ep": ep,
             "edp": cp * dp // ep}
    for kind, size in sizes.items():
        flat = sorted(r for grp in g[kind] for r in grp)
        assert flat == list(range(world)), kind
        assert all(len(grp) == size for grp in g[kind]), kind
    # the embedding groups pair the two ends of every pipeline
    assert [grp for grp in g["embedding"]] == [[p[0], p[-1]] if pp > 1 else p for p in g["pp"]]
    # an EP group lies inside one dp_cp group: experts fold over data/context-parallel ranks
    dpcp_of = {r: i for i, grp in enumerate(g["dp_cp"]) for r in grp}
    assert all(len({dpcp_of[r] for r in grp}) == 1 for grp in g["ep"])


@pytest.mark.parametrize("kwargs, name", [
    (dict(world_size=16, tp=3), "world_size=16 is not divisible by tp\\*pp\\*cp"),
    (dict(world_size=8, tp=0), "tp must be a positive integer"),
    (dict(world_size=8, pp=-1), "pp must be a positive integer"),
    (dict(world_size=8, tp=2, cp=2, ep=3), "ep=3 must divide cp\\*dp"),
])
def test_bad_layouts_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        topology.rank_groups(**kwargs)


def test_tp_across_nodes_warns_and_locality_is_reported():
    g = topology.rank_groups(16, tp=16)
    with pytest.warns(UserWarning, match="TP group crosses nodes"):
        topology.warn_if_tp_crosses_nodes(g, gpus_per_node=8)
    local = topology.group_locality(topology.rank_groups(64, tp=8, pp=4), 8)
    assert local["tp"] and not local["pp"] and not local["dp"]
    local_b = topology.group_locality(topology.rank_groups(64, tp=4, pp=8), 8)
    assert local_b["tp"] and local_b["dp"] and not local_b["pp"]  # plan B: DP pairs share a node


def test_rank_map_picture():
    text = topology.rank_map(8, 8, tp=8, pp=4)
    assert "node7" in text and "CROSSES nodes" in text
    assert " 63 7.0.1.3" in text  # last rank: tp 7, cp 0, dp 1, pp 3


# ---- process groups on 8 gloo ranks --------------------------------------------------------------

def _init_and_probe(rank, world_size, tp, pp, cp, ep, gpus_per_node):
    state = topology.init_parallel(tp=tp, pp=pp, cp=cp, ep=ep, gpus_per_node=gpus_per_node)
    reached = {}
    for kind, group in state.groups.items():
        if group is None:  # a middle pipeline stage holds no embedding
            reached[kind] = []
            continue
        # every member contributes 2**rank: the sum names exactly the ranks the collective reached
        t = torch.tensor([2 ** rank], dtype=torch.int64)
        dist.all_reduce(t, group=group)
        reached[kind] = [r for r in range(world_size) if t.item() >> r & 1]
    mesh = {dim: dist.get_process_group_ranks(state.mesh.get_group(dim)) for dim in ("pp", "dp", "cp", "tp")}
    return {"reached": reached, "ranks": state.ranks, "mesh": mesh, "coords": state.coords,
            "prev": state.pp_prev, "next": state.pp_next, "first": state.is_first_stage,
            "last": state.is_last_stage, "intra": state.intra_node}


@pytest.mark.parametrize("world, tp, pp, cp, ep, gpus_per_node",
                         [(8, 2, 2, 1, 2, 4), (8, 2, 1, 2, 4, 4), (6, 3, 2, 1, 1, 3), (3, 1, 3, 1, 1, 1)])
def test_init_parallel_groups_reach_exactly_their_ranks(world, tp, pp, cp, ep, gpus_per_node):
    out = run_ranks(_init_and_probe, world, tp, pp, cp, ep, gpus_per_node, timeout=90)
    groups = topology.rank_groups(world, tp=tp, pp=pp, cp=cp, ep=ep)
    for rank, o in enumerate(out):
        for kind in topology.GROUP_KINDS:
            expected = next((g for g in groups[kind] if rank in g), [])
            assert o["ranks"][kind] == expected
            assert o["reached"][kind] == expected, (rank, kind)
        for dim in ("pp", "dp", "cp", "tp"):
            assert o["mesh"][dim] == o["ranks"][dim], (rank, dim)
        assert o["coords"] == topology.rank_coordinates(rank, world, tp, pp, cp, ep)
        pp_ranks = o["ranks"]["pp"]
        stage = pp_ranks.index(rank)
        assert o["first"] == (stage == 0) and o["last"] == (stage == pp - 1)
        assert o["prev"] == (pp_ranks[stage - 1] if stage else None)
        assert o["next"] == (pp_ranks[stage + 1] if stage < pp - 1 else None)
        assert o["intra"]["tp"]  # TP fits inside a node in every case here
        assert o["intra"]["pp"] == (pp == 1)  # PP strides across nodes in every case here


def _bad_layout(rank, world_size):
    try:
        topology.init_parallel(tp=3)
    except ValueError as e:
        # the default group is still clean: no new_group was issued before the check
        return str(e), dist.distributed_c10d._world.group_count
    return None, None


def test_bad_layout_raises_on_every_rank_before_any_group():
    out = run_ranks(_bad_layout, 4, timeout=60)
    for msg, group_count in out:
        assert msg is not None and "tp*pp*cp" in msg
        assert group_count == 1  # only the default group exists


# ---- the planner, reproduced by hand ----------------------------------------------------------------

def test_planner_terms_reproduced_by_hand():
    # Documented configuration: 64 GPUs (8 x 8, 80 GB, 300 GB/s NVLink, 25 GB/s IB, 312 TFLOPs at 50%),
    # L=40 h=5120 a=40 s=2048 V=51200, B=512, b=1, selective recomputation, plan B: TP=4 PP=8 DP=2.
    c = topology.Cluster(gpus=64)
    m = topology.ModelShape(layers=40, hidden=5120, heads=40, seq=2048, vocab=51200, global_batch=512,
                            recompute="selective")
    r = topology.estimate(c, m, tp=4, pp=8, cp=1)
    L, h, s, V, B, b, t, p, d = 40, 5120, 2048, 51200, 512, 1, 4, 8, 2
    GB = 1e9
    # memory: 16 bytes per parameter of the first stage, split 2 + 2 + 12
    params = ((12 * h * h + 13 * h) * (L // p) + (V + s) * h) / t
    assert r["params_per_gpu"] == pytest.approx(params, rel=1e-12)
    assert r["weights_gb"] == pytest.approx(2 * params / GB, rel=1e-12)
    assert r["grads_gb"] == pytest.approx(2 * params / GB, rel=1e-12)
    assert r["optimizer_gb"] == pytest.approx(12 * params / GB, rel=1e-12)
    m_micro = B // (b * d)
    assert r["micro_batches"] == m_micro == 256
    # Korthikanti: selective + SP keeps 34 s b h / t per layer; 1F1B keeps p micro-batches on stage 0
    assert r["activations_gb"] == pytest.approx((L // p) * 34 * s * b * h / t * p / GB, rel=1e-12)
    assert r["memory_gb"] == pytest.approx(16 * params / GB + r["activations_gb"], rel=1e-12)
    # time: FLOPs 72 B s L h^2 (1 + s/(6h) + V/(12 L h)) plus the attention core recomputed (4 B s^2 h L)
    flops = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h)) + 4 * B * s * s * h * L
    assert r["compute_s"] == pytest.approx(flops / 64 / (312e12 * 0.5), rel=1e-12)
    tp_bytes = 2 * (L // p) * m_micro * 4 * (t - 1) / t * b * s * h * 2   # fwd + bwd, on NVLink
    assert r["tp_s"] == pytest.approx(tp_bytes / 300e9, rel=1e-12)
    pp_bytes = 2 * m_micro * b * s * h / t * 2                           # activation and its gradient, IB
    assert r["pp_p2p_s"] == pytest.approx(pp_bytes / 25e9, rel=1e-12)
    dp_bytes = 2 * (d - 1) / d * 2 * params                              # ring all-reduce of bf16 grads, NVLink
    assert r["dp_s"] == pytest.approx(dp_bytes / 300e9, rel=1e-12)
    assert r["bubble_s"] == pytest.approx((p - 1) / m_micro * (r["compute_s"] + r["tp_s"]), rel=1e-12)
    assert r["cp_s"] == 0
    assert r["step_time_s"] == pytest.approx(sum(r[k] for k in ("compute_s", "tp_s", "pp_p2p_s", "dp_s",
                                                                 "bubble_s", "cp_s")), rel=1e-12)
    assert r["bubble_fraction"] == pytest.approx((p - 1) / (m_micro + p - 1))


def test_planner_full_recompute_flops_and_cp_terms():
    c = topology.Cluster(gpus=16)
    m = topology.ModelShape(layers=8, hidden=1024, heads=16, seq=4096, vocab=32000, global_batch=8,
                            recompute="full")
    r = topology.estimate(c, m, tp=2, pp=1, cp=4)
    B, s, L, h, V = 8, 4096, 8, 1024, 32000
    flops = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    assert topology.training_flops(m) == pytest.approx(flops, rel=1e-12)
    # full recomputation keeps 2 s b h / t per layer, sequence split over cp
    assert r["activations_gb"] == pytest.approx(L * 2 * (s // 4) * 1 * h / 2 / 1e9, rel=1e-12)
    sl, t, cp, m_micro = s // 4, 2, 4, r["micro_batches"]
    kv_shard = sl * h / t * 2  # bytes of one K (or V) shard
    # forward twice (the original and the recomputed one): K and V passed cp-1 times;
    # backward: K and V passed cp-1 times, dK and dV cp times
    per_layer = 2 * (2 * (cp - 1) * kv_shard) + (2 * (cp - 1) + 2 * cp) * kv_shard
    assert r["cp_s"] == pytest.approx(L * m_micro * per_layer / 300e9, rel=1e-12)


def test_planner_ranks_fitting_layouts_and_cli_json(capsys):
    topology.main(["plan", "--gpus", "64", "--layers", "40", "--hidden", "5120", "--heads", "40", "--seq", "2048",
                   "--vocab", "51200", "--global-batch", "512", "--recompute", "selective", "--json"])
    import json
    plans = json.loads(capsys.readouterr().out)
    assert {"tp", "pp", "dp", "cp", "memory_gb", "step_time_s", "fits"} <= set(plans[0])
    fits = [p["fits"] for p in plans]
    assert fits == sorted(fits, reverse=True)  # every fitting layout before every other
    times = [p["step_time_s"] for p in plans if p["fits"]]
    assert times == sorted(times)
    for p in plans:
        assert p["tp"] * p["pp"] * p["dp"] * p["cp"] == 64


def test_planner_given_impossible_layout_raises():
    c = topology.Cluster(gpus=64)
    m = topology.ModelShape(layers=40, hidden=5120, heads=40, seq=2048, vocab=51200, global_batch=512)
    with pytest.raises(ValueError, match="layers=40 is not divisible by pp=3"):
        topology.estimate(topology.Cluster(gpus=48), m, tp=2, pp=3, cp=1)
    with pytest.raises(ValueError, match="world_size=64 is not divisible"):
        topology.plan(c, m, tp=2, pp=3, cp=1)
    with pytest.raises(ValueError, match="heads=40 is not divisible by tp=3"):
        topology.plan(topology.Cluster(gpus=48), m, tp=3, pp=1, cp=1)


def test_chapter_example_preferences_differ():
    ex = {e["shape"]: e for e in topology.chapter_example()}
    assert ex["wide_layers_small_batch"]["preferred"] == "A"
    assert ex["narrow_layers_big_batch"]["preferred"] == "B"
    for e in ex.values():
        a, b = e["plan_a"], e["plan_b"]
        assert (a["tp"], a["pp"], a["dp"]) == (8, 4, 2) and (b["tp"], b["pp"], b["dp"]) == (4, 8, 2)
        # B holds twice the activations of A: (L/8)/4 * 8 in flight against (L/4)/8 * 4
        assert b["activations_gb"] == pytest.approx(2 * a["activations_gb"], rel=1e-12)
