"""V-shaped pipelines (train_gpt.py, below its banner): ZB-V and DualPipeV. Each rank's list against the one torch's
own schedule builds, the lists replayed against their formulas, drawn by --show-schedule; the executor against one
process on every kind of layout, its lists, peaks and transfers; the planner against the executor's lists."""
import dataclasses
import os
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt  # noqa: E402
from multirank import run_ranks  # noqa: E402
from train_gpt import Action, Overlapped  # noqa: E402
from test_train_gpt import CFG, CFG_MOE, STEPS, TOL, _run, _schedule_stats  # noqa: E402

TORCH_V_SCHEDULES = {"zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}


def torch_orders(kind, p, m):
    """Every rank's compute actions as torch 2.13's own schedule class builds them (its `pipeline_order`, what its
    runtime lowers and runs; None, an idle slot, left out), as strings: "5F2" stage 5's forward of micro-batch 2,
    "I" a backward of the input gradients, "B" a whole one, "W" the weights', "(0F3;3B1)OVERLAP_F_B" a pair. The
    schedule is made on stand-ins for the two stages of rank 0 (building the order needs their sizes only)."""
    from torch.distributed.pipelining import schedules
    stages = [SimpleNamespace(group_size=p, group_rank=0, num_stages=2 * p, stage_index=s, submod=None)
              for s in (0, 2 * p - 1)]
    schedule = getattr(schedules, TORCH_V_SCHEDULES[kind])(stages, m)
    return [[str(a) for a in schedule.pipeline_order[r] if a is not None] for r in range(p)]


def as_torch(order, p, r):
    """Rank r's list in torch's notation: chunk c is stage train_gpt.v_stage(p, r, c); a B whose W the list holds is
    torch's I, one without is torch's (whole) B."""
    deferred = {(a.chunk, a.micro) for a in order if a.kind == "W"}

    def one(a):
        kind = "I" if a.kind == "B" and (a.chunk, a.micro) in deferred else a.kind
        return f"{train_gpt.v_stage(p, r, a.chunk)}{kind}{a.micro}"
    return [f"({one(a.forward)};{one(a.backward)})OVERLAP_F_B" if isinstance(a, Overlapped) else one(a)
            for a in order]


@pytest.mark.parametrize("kind", train_gpt.V_SCHEDULES)
def test_each_ranks_list_is_the_one_torchs_schedule_builds(kind):
    # the grid, p = 2 and 4 with m from 2p to 4p, and odd pipelines; ZB-V also below 2p (torch builds those
    # from the order of 2p - 1 micro-batches with the missing ones left out, as schedule_zbv does)
    tried = 0
    for p in (2, 3, 4, 5):
        for m in range(1 if kind == "zbv" else 2 * p, 4 * p + 1):
            theirs, ours = torch_orders(kind, p, m), train_gpt.pipeline_schedule(kind, p, m, 2)
            for r in range(p):
                assert as_torch(ours[r], p, r) == theirs[r], (kind, p, m, r)
            tried += 1
    assert tried == (56 if kind == "zbv" else 32)
    # what the two notations say alike: DualPipeV at p = 2, m = 4 (torch's string, and ours)
    if kind == "dualpipev":
        assert torch_orders(kind, 2, 4)[0][7] == "(0F3;3B1)OVERLAP_F_B"
        assert train_gpt.pipeline_schedule(kind, 2, 4, 2)[0][7] == Overlapped(Action("F", 3, 0), Action("B", 1, 1))


def _every_action_once(kind, order, m):
    entries = [a for entry in order for a in train_gpt.halves(entry)]
    assert sorted(a for a in entries if a.kind != "W") == sorted(
        Action(k, i, c) for i in range(m) for c in (0, 1) for k in "FB"), kind
    weights = [a for a in entries if a.kind == "W"]
    assert len(set(weights)) == len(weights)
    for w in weights:  # a W after its own B, and only for a B that left it
        assert entries.index(Action("B", w.micro, w.chunk)) < entries.index(w)
    if kind == "zbv":
        assert len(weights) == 2 * m  # every backward split
    return weights


def test_the_lists_replay_to_their_formulas_over_a_grid():
    # each list runs each F and B once (W's of split B's once, after them); its replay (chunk units, F = B = W = 1,
    # a whole backward 2, an F&B pair 3, communication free) gives the formula's step time, its in-flight peak the
    # formula's on every rank
    for kind in train_gpt.V_SCHEDULES:
        for p in range(2, 9):
            for m in sorted({1, 2, p, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p, 4 * p, 16}):
                if train_gpt.schedule_error(kind, p, m, 2):
                    assert kind == "dualpipev" and m < 2 * p
                    continue
                orders = train_gpt.pipeline_schedule(kind, p, m, 2)
                for order in orders:
                    _every_action_once(kind, order, m)
                span = train_gpt.replay_pipeline(orders, backward=1, v=2)
                formula, peaks = train_gpt.schedule_formulas(kind, p, m, 2)
                assert span == formula == 6 * m + train_gpt.v_bubble(kind, p, m), (kind, p, m)
                assert [train_gpt.in_flight_peak(o, True) for o in orders] == peaks, (kind, p, m)
                # the W's follow their B's but where the drain defers them: the peak to W equals the one to B
                assert [train_gpt.in_flight_peak(o, False) for o in orders] == peaks, (kind, p, m)
    # DualPipe's table in its units: (PP/2 - 1)(F&B + B - 3W) with PP = 2p stages, F&B the pair, B whole
    for p in (2, 4, 8):
        pair, whole, w = 3, 2, 1
        assert train_gpt.v_bubble("dualpipev", p, 4 * p) == (2 * p / 2 - 1) * (pair + whole - 3 * w) == 2 * (p - 1)
        assert train_gpt.v_bubble("zbv", p, 4 * p) == p - 1
    # at p = 4, m = 8: ZB-V's bubble is ZB-H1's (p - 1 units, one third of 1F1B's) with both chunks of a stage's
    # layers on each rank, interleaved ZB-H1's v = 2 keeps 11 chunks on rank 0 where ZB-V keeps 8
    assert train_gpt.schedule_formulas("zbv", 4, 8, 2)[0] - 48 == train_gpt.schedule_formulas("zb-h1", 4, 8)[0] - 24
    assert train_gpt.schedule_formulas("zb-h1", 4, 8, 2)[1][0] == 11


def test_the_placement_is_a_v_and_an_order_that_waits_forever_is_refused():
    assert [train_gpt.v_stage(4, r, c) for c in (0, 1) for r in range(4)] == [0, 1, 2, 3, 7, 6, 5, 4]
    orders = train_gpt.pipeline_schedule("zbv", 2, 4, 2)
    assert orders.v_shape and train_gpt.replay_pipeline(orders, backward=1, v=2) == 25
    # the same lists read as the interleaved placement (chunk c on stage c p + r) wait forever: the V is the lists'
    with pytest.raises(ValueError, match="wait on each other forever"):
        train_gpt.replay_pipeline(list(orders), backward=1, v=2)
    # a pair waits for both its inputs: rank 1's F&B needs stage 3's B (rank 0's) of micro-batch 0
    swapped = train_gpt.VOrders([[Action("F", 0, 0), Overlapped(Action("F", 0, 1), Action("B", 0, 1)),
                                  Action("B", 0, 0)], [Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 1),
                                                       Action("B", 0, 0)]])
    with pytest.raises(ValueError, match="wait on each other forever"):
        train_gpt.replay_pipeline(swapped, backward=1, v=2)


def test_show_schedule_draws_both_v_schedules_with_bubble_and_peaks_beside_the_formulas():
    zbv = train_gpt.timeline("zbv", 4, 8, 2).splitlines()
    assert zbv[0].startswith("rank 0  F0.0 F1.0") and zbv[3].startswith("rank 3  .    .    .    F0.0 F0.1 F1.0")
    assert "51 units (formula 51)" in zbv[4] and zbv[5] == "in flight per rank (chunks): 8 (8), 8 (8), 8 (8), 8 (8)"
    assert "bubble per rank 3 units, formula 3: p - 1" in zbv[-1]
    dual = train_gpt.timeline("dualpipev", 4, 8, 2)
    assert "54 units (formula 54)" in dual and "in flight per rank (chunks): 9 (9), 9 (9), 9 (9), 9 (9)" in dual
    assert "bubble per rank 6 units, formula 6: (p - 1)(F&B + B - 3W)" in dual
    # rank 0's first pair: chunk 0's forward of micro-batch 7 beside chunk 1's whole backward of micro-batch 3
    assert "F3.1  F7.0  &B3.1 &B3.1 ." in dual.splitlines()[0]
    assert train_gpt.schedule_error("zbv", 4, 8, 1) == ("--pp-schedule zbv places two model chunks per rank in a V: "
                                                        "pass --virtual-stages 2")
    assert "at least 2 --pp = 8" in train_gpt.schedule_error("dualpipev", 4, 7, 2)
    assert train_gpt.schedule_error("zbv", 4, 3, 2) is None  # ZB-V takes any m


# ---- the planner (topology.py) against the executor's lists --------------------------------------------------

def _weighted_peak(order, a_w):
    """The most a rank's list holds at once, 1 per chunk between its F and its B, `a_w` per chunk whose B has run and
    whose W waits, counted after each action and each half of an F&B pair."""
    deferred = {(a.chunk, a.micro) for a in order if a.kind == "W"}
    before = waiting = peak = 0
    for entry in order:
        for a in train_gpt.halves(entry):
            before += (a.kind == "F") - (a.kind == "B")
            waiting += (a.kind == "B" and (a.chunk, a.micro) in deferred) - (a.kind == "W")
            peak = max(peak, before + a_w * waiting)
    return peak


def test_the_planners_bubble_and_in_flight_equal_the_replay_of_the_executors_lists():
    """Units as tests/test_topology.py's: replay_pipeline in durations of one chunk's F, B, W; the planner's `stage`
    one micro-batch through both chunks, 2 (F + B + W), its W part 2 W, its F part 2 F. The V formulas hold where
    W <= F <= B, as the planner's split always is (test_topology's test of the planner's split)."""
    import topology
    durations = [(1, 1, 1), (1, 1, 0), (1, 2, 1), (2, 3, 1), (2, 2, 1), (3, 5, 2), (4, 7, 3), (3, 3, 3), (2, 7, 0)]
    for kind in train_gpt.V_SCHEDULES:
        for p in range(2, 7):
            for m in sorted({2 * p - (kind == "zbv"), 2 * p, 2 * p + 1, 3 * p, 4 * p}):
                orders = train_gpt.pipeline_schedule(kind, p, m, 2)
                for f, b, w in durations:
                    span = train_gpt.replay_pipeline(orders, f, b, w, v=2)
                    bubble = topology.pipeline_bubble(kind, p, 2, m, 2 * (f + b + w), 2 * w, 2 * f)
                    assert bubble == pytest.approx(span - 2 * m * (f + b + w), abs=1e-9), (kind, p, m, f, b, w)
                chunks = topology.in_flight_chunks(kind, p, m, 2)
                for r, order in enumerate(orders):
                    before = train_gpt.in_flight_peak(order, False)
                    assert chunks[r] == (before, train_gpt.in_flight_peak(order, True) - before), (kind, p, m, r)
                in_flight = topology.in_flight_microbatches(p, 2, m, kind)
                assert in_flight == chunks[0][0] / 2 == (p if kind == "zbv" else p + 0.5)
                # the planner's activations (A = 1 per chunk: a stage's 2, A_w = a_w per chunk): the most loaded rank
                for a_w in (0, 0.5, 1, 1.5, 2, 5):
                    gb = topology._activations_gb((2.0, 0.0, 0.0, 0.0), in_flight, kind, p, m, 2, 2 * a_w)
                    measured = max(_weighted_peak(order, a_w) for order in orders)
                    assert gb * topology.GB == pytest.approx(measured, rel=1e-12), (kind, p, m, a_w)
    # with F = B = W: ZB-V p - 1 chunk-forwards, a third of ZB-H1 at v = 1's 2 (p - 1) per stage of two chunks...
    assert topology.pipeline_bubble("zbv", 4, 2, 16, 6, 2, 2) == 3 == train_gpt.v_bubble("zbv", 4, 16)
    # ... and DualPipeV (p - 1)(F&B + B - 3W) with F&B = 3, B whole 2, W 1
    assert topology.pipeline_bubble("dualpipev", 4, 2, 16, 6, 2, 2) == 3 * (3 + 2 - 3)


def test_the_planner_searches_the_v_schedules_and_prints_their_command():
    import topology
    cluster = topology.Cluster(gpus=16)
    model = topology.ModelShape(layers=32, hidden=4096, heads=32, seq=2048, vocab=51200, global_batch=256,
                                micro_batch=1, recompute="selective", sequence_parallel=True, zero=1)
    rows = {s: topology.estimate(cluster, model, 2, 4, 1, pp_schedule=s, virtual_stages=None if s in
                                 train_gpt.V_SCHEDULES else 1) for s in ("zb-h1", "zbv", "dualpipev")}
    zb, zbv, dual = rows["zb-h1"], rows["zbv"], rows["dualpipev"]
    assert zbv["virtual_stages"] == dual["virtual_stages"] == 2 and zbv["micro_batches"] == 128
    # rank 0 holds the first and the last stage: the tied embedding once, no all-reduce of its gradient
    assert zbv["params_per_gpu"] == zb["params_per_gpu"] == topology.params_on_first_stage(model, 2, 4)
    assert not zb["intra_node"]["pp"]  # the first and last stage all-reduce over InfiniBand under ZB-H1
    assert zb["dp_s"] - zbv["dp_s"] == pytest.approx(cluster.grad_bytes * 51200 * 4096 / 2 / (cluster.ib_gbps
                                                                                                * topology.GB))
    # p chunks' worth of 1F1B's stage 0 in flight (ZB-V), a half more (DualPipeV); their bubbles below ZB-H1's
    assert (zbv["in_flight"], dual["in_flight"], zb["in_flight"]) == (4, 4.5, 4)
    assert 0 < zbv["bubble_s"] < zb["bubble_s"] and 0 < dual["bubble_s"]
    command = topology.torchrun_command(zbv, model, cluster)
    assert "--pp-schedule zbv --virtual-stages 2" in command
    # the search tries them wherever a pipeline has two chunks per GPU and enough micro-batches, and says why not
    plans = topology.plan(cluster, replace_model(model, micro_batch=None), tp=2, pp=4)
    assert {r["pp_schedule"] for r in plans} <= set(topology.SCHEDULES) and plans[0]["pp_schedule"] in (
        "zbv", "dualpipev", "zb-h1")
    with pytest.raises(ValueError, match="needs at least 8 micro-batches per pipeline"):
        topology.estimate(cluster, replace_model(model, global_batch=8), 2, 4, 1, pp_schedule="dualpipev")
    with pytest.raises(ValueError, match="virtual_stages must be 2"):
        replace_model(model, pp_schedule="zbv", virtual_stages=4)


def replace_model(model, **changes):
    import dataclasses
    return dataclasses.replace(model, **changes)


# ---- the executor: the V placement, the split per B, the F&B pairs, against one process -----------------------

CFG8 = dataclasses.replace(CFG, n_layer=8)  # p = 4: 2p = 8 chunks of one layer


def _train_and_count(rank, world, tp, pp, cp, cfg, **kwargs):
    """_train's curve with the validation loss of its last step, the parameters this rank holds (rank 0 of a V:
    both ends, the tied embedding once), its layers and how often an F&B pair's half handed the turn to the other
    while its all-to-all travelled."""
    batons, make = [], train_gpt.Baton.__init__

    def made(self):
        make(self)
        batons.append(self)
    train_gpt.Baton.__init__ = made
    torch.set_default_dtype(torch.float64)
    records = train_gpt.train_job(cfg, _run(tp=tp, pp=pp, cp=cp, eval_every=STEPS, eval_batches=1, **kwargs))
    train_gpt.Baton.__init__ = make
    curve = [(r["loss"], r["aux_loss"], r["grad_norm"]) for r in records] + [(records[-1]["val_loss"],) * 3]
    plan, stage, _, _ = train_gpt.build_job(cfg, _run(tp=tp, pp=pp, cp=cp, **kwargs), optimizer=False)
    handovers = sum(n for baton in batons for n in baton.handovers.values())
    return curve, sum(p.numel() for p in stage.parameters()), plan.layers, handovers


V_LAYOUTS = {  # (world, tp, pp, cp, cfg, kwargs): float64 SGD against the one-process run (test_train_gpt's)
    "zbv PP2": (2, 1, 2, 1, CFG, dict(pp_schedule="zbv")),
    "dualpipev PP4": (4, 1, 4, 1, CFG8, dict(pp_schedule="dualpipev", micro_batch=1)),
    "dualpipev MoE EP2 CP2": (8, 1, 2, 2, CFG_MOE, dict(pp_schedule="dualpipev", ep=2, micro_batch=1)),
    "dualpipev ZeRO-3": (4, 1, 2, 1, CFG, dict(pp_schedule="dualpipev", zero=3, micro_batch=1)),
    "zbv TP2 SP selective MoE": (4, 2, 2, 1, CFG_MOE, dict(pp_schedule="zbv", sequence_parallel=True,
                                                            recompute="selective")),
    "zbv CP2 full recomputation": (4, 1, 2, 2, CFG, dict(pp_schedule="zbv", recompute="full")),
    "dualpipev ZeRO-2 offload": (4, 1, 2, 1, CFG, dict(pp_schedule="dualpipev", zero=2, recompute="offload",
                                                       micro_batch=1)),
}


@pytest.fixture(scope="module")
def one_process():
    # a MoE layer's router losses are statistics of a micro-batch's tokens: each reference has the layouts' micro-batch
    return {key: run_ranks(_train_and_count, 1, 1, 1, 1, cfg, micro_batch=key[2], timeout=120)[0][0]
            for key, cfg in (((4, 0, 2), CFG), ((8, 0, 2), CFG8), ((4, 2, 1), CFG_MOE), ((4, 2, 2), CFG_MOE))}


@pytest.mark.parametrize("name", V_LAYOUTS)
def test_every_layout_trains_the_one_process_model_under_both_v_schedules(one_process, name):
    import topology
    world, tp, pp, cp, cfg, kwargs = V_LAYOUTS[name]
    micro = kwargs.get("micro_batch", 2) if cfg.moe_every else 2
    reference = one_process[(cfg.n_layer, cfg.moe_every, micro)]
    results = run_ranks(_train_and_count, world, tp, pp, cp, cfg, virtual_stages=2, timeout=240, **kwargs)
    for curve, _, _, handovers in results:  # the steps, then the validation loss (a forward-only V)
        assert len(curve) == len(reference) == STEPS + 1
        assert max(abs(a - b) for got, ref in zip(curve, reference) for a, b in zip(got, ref)) < TOL, (name, curve)
        # DualPipeV with EP: each F&B pair's halves took turns while their all-to-alls travelled
        assert (handovers > 0) == (kwargs["pp_schedule"] == "dualpipev" and kwargs.get("ep", 1) > 1), handovers
    # rank 0 holds stages 0 and 2p - 1 and both ends of the model, the tied embedding once: the planner's count
    # (Narayanan's, without the final LayerNorm's 2 h) for its GPU; the others their two chunks
    (_, held, layers, _), *_ = results
    per = cfg.n_layer // (2 * pp)
    assert layers == tuple(range(per)) + tuple(range(cfg.n_layer - per, cfg.n_layer))
    if tp == 1:
        shape = topology.ModelShape(layers=cfg.n_layer, hidden=cfg.n_embd, heads=cfg.n_head, seq=cfg.seq_len,
                                    vocab=cfg.vocab_size, global_batch=2, moe_every=cfg.moe_every,
                                    experts=cfg.n_experts, top_k=cfg.top_k)
        assert held == topology.params_on_first_stage(shape, 1, pp, kwargs.get("ep", 1), v_shape=True) + 2 * cfg.n_embd


@pytest.mark.parametrize("kind, p, cfg", [("zbv", 2, CFG), ("dualpipev", 4, CFG8)])
def test_the_executor_runs_each_ranks_list_frees_what_it_sends_and_holds_the_formulas_peak(kind, p, cfg):
    # each rank ran its list in its order and kept alive at most what the list keeps (F to B, or to W where its B is
    # split; an F&B pair's forward beside its backward): the formula's peak, DualPipe's PP + 1 = 2p + 1 chunks
    # under DualPipeV; no output held once sent (rank p - 1's handoff to itself frees its output too)
    for rank, (peak, held, order), unfreed, left in run_ranks(_schedule_stats, p, cfg, kind, 2, timeout=120):
        assert order == train_gpt.pipeline_schedule(kind, p, 8, 2)[rank], (kind, rank)
        assert peak == train_gpt.in_flight_peak(order, True) == train_gpt.schedule_formulas(kind, p, 8, 2)[1][rank]
        assert held == 0 and left == 0 and unfreed <= peak, (kind, rank, held, left, unfreed)


class _Done:
    def wait(self):
        pass

    def is_completed(self):
        return True


@pytest.mark.parametrize("kind, p, m", [("zbv", 2, 4), ("zbv", 4, 8), ("dualpipev", 2, 5), ("dualpipev", 4, 8)])
def test_every_input_is_what_its_producer_sent_or_handed_over(kind, p, m, monkeypatch):
    """Every rank's run_schedule in this process, twice, each action's output a number naming it, the transport a
    recorder matching as gloo does (the k-th receive a rank posts from a peer gets that peer's k-th send to it,
    recorded by the first pass). Each read must be its producer's output: the previous stage's F, the next stage's
    B, from another rank or, at the V's bottom, from this one."""
    name = lambda rank, action: float(hash((rank, action)) % 2 ** 50)  # noqa: E731
    first, reads = None, {}
    for _ in range(2):
        sent = {}
        for rank in range(p):
            ps = SimpleNamespace(pp_rank=rank, ranks={"pp": list(range(p))})
            plan = SimpleNamespace(sizes={"pp": p}, virtual_stages=2, parallel_state=ps, pp=None)
            stage = SimpleNamespace(plan=plan, chunk_blocks=lambda chunk: [],
                                    parameters=lambda: iter([torch.zeros(1)]))
            pipe, taken, reads[rank] = train_gpt.VPipeline(plan, (1,), torch.float64, torch.device("cpu"), kind), {}, []

            def run_action(self, stage, action, received, *_, rank=rank):
                reads[rank] += [(action, received.item())] if received is not None else []
                return torch.tensor([name(rank, action)], dtype=torch.float64)

            def isend(tensor, dst, group, rank=rank):
                sent.setdefault((rank, dst), []).append(tensor.item())
                return _Done()

            def irecv(buf, src, group, rank=rank, taken=taken):
                k = taken[src] = taken.get(src, -1) + 1
                arrived = (first or {}).get((src, rank), [])
                buf.fill_(arrived[k] if k < len(arrived) else -1.0)
                return _Done()
            monkeypatch.setattr(train_gpt.ZeroBubblePipeline, "run_action", run_action)
            monkeypatch.setattr(train_gpt.dist, "isend", isend)
            monkeypatch.setattr(train_gpt.dist, "irecv", irecv)
            train_gpt.run_schedule(stage, pipe, kind, [None] * m, 1)
        assert first is None or first == sent  # the second pass sent what the first did
        first = sent
    at = {(train_gpt.v_stage(p, r, c), c): r for r in range(p) for c in (0, 1)}
    for rank, pairs in reads.items():
        for action, value in pairs:
            stage = train_gpt.v_stage(p, rank, action.chunk) + (-1 if action.kind == "F" else 1)
            chunk = int(stage >= p)
            assert value == name(at[(stage, chunk)], Action(action.kind, action.micro, chunk)), (kind, rank, action)
        # every F but the first stage's and every B but the last stage's read something: nothing went missing
        wanted = [a for entry in train_gpt.pipeline_schedule(kind, p, m, 2)[rank] for a in train_gpt.halves(entry)
                  if (a.kind == "F" and (rank, a.chunk) != (0, 0)) or (a.kind == "B" and (rank, a.chunk) != (0, 1))]
        assert sorted(a for a, _ in pairs) == sorted(wanted), (kind, rank)


# A checkpoint of any schedule resumes under a V schedule and back: test_train_gpt.py's
# test_a_checkpoint_resumes_under_another_schedule_and_back (1F1B -> DualPipeV, ZB-V -> 1F1B beside ZB-H1's)


def _curves_in_every_dtype(rank, world):
    """(dtype, schedule): its losses and gradient norms over 2 AdamW steps at PP 2 under 1F1B and a V schedule
    (each V schedule in two dtypes; float32 defaults, so that each --dtype keeps its own weights)."""
    torch.set_default_dtype(torch.float32)
    out = {}
    for dtype, extra, v_kind in (("bfloat16", {}, "zbv"), ("float16", {}, "dualpipev"),
                                 ("fp8", dict(fp8_backward="fp8"), "zbv"), ("nvfp4", {}, "dualpipev")):
        for kind in ("1f1b", v_kind):
            run = _run(pp=2, dtype=dtype, optimizer="adamw", lr=1e-2, steps=2, pp_schedule=kind,
                       virtual_stages=1 if kind == "1f1b" else 2, **extra)
            out[(dtype, kind)] = [(r["loss"], r["grad_norm"]) for r in train_gpt.train_job(CFG, run)]
    return out


def test_every_dtype_runs_the_v_schedules_as_1f1b_runs_it():
    # 16-bit weights, FP8 with FP8 backward GEMMs (whose weight GEMM W defers, with its scales agreed in B) and NVFP4
    # (its stochastic rounding drawn per micro-batch and GEMM): the same losses as 1F1B's, and gradient norms within
    # the FP32 accumulators' order (the W's of a V sum the micro-batches' weight gradients in another order: <= 6e-8
    # measured)
    curves = run_ranks(_curves_in_every_dtype, 2, timeout=240)[0]
    for (dtype, kind), curve in curves.items():
        for (loss, norm), (loss_1f1b, norm_1f1b) in zip(curve, curves[(dtype, "1f1b")]):
            assert loss == loss_1f1b and abs(norm - norm_1f1b) <= 1e-6 * norm_1f1b, (dtype, kind, curve)


def _overlapped_or_not(rank, world):
    """One float32 DualPipeV step of a MoE model with EP 2, its F&B pairs overlapped, then one with the same pairs
    one after the other (from the same initial weights): (loss, router loss, norm) of each, and the handovers."""
    torch.set_default_dtype(torch.float32)
    out = []
    for overlap in (True, False):
        run = _run(pp=2, ep=2, dtype="float32", optimizer="adamw", micro_batch=1, steps=1, pp_schedule="dualpipev",
                   virtual_stages=2)
        plan, stage, opt, pipe = train_gpt.build_job(CFG_MOE, run)
        pipe.overlap = overlap
        tokens = train_gpt.synthetic_batch(0, run.batch, CFG_MOE.seq_len, CFG_MOE.vocab_size)
        loss, aux, norm, *_ = train_gpt.train_step(stage, pipe, opt, tokens, run.micro_batch, run.grad_clip)
        out.append(((loss, aux, norm), dict(pipe.baton.handovers)))
    return out


def test_overlapping_the_pairs_changes_nothing_but_when_each_half_computes():
    # the halves take turns at the all-to-alls and at their inputs' receives, in the same order on every rank of a
    # group: the same sums, bit for bit; every rank hands the turn over at both (its pairs' halves receive an input)
    for (overlapped, handovers), (apart, none) in run_ranks(_overlapped_or_not, 4, timeout=180):
        assert overlapped == apart, (overlapped, apart)
        assert min(handovers.values()) > 0 and set(none.values()) == {0}, (handovers, none)


def test_the_race_against_torch_runs_both_v_schedules_with_the_overlap_measured(tmp_path):
    """benchmarks/pipeline_vs_torch.py on a small MoE model (EP 2, 4 ranks), one counted round: parity with torch's
    schedules first, each ratio inside its own interval, the overlap's figures per rank (handovers at both kinds of
    transfer overlapped, none one after the other) and the breakdown timing our pairs whole. No figure is timed."""
    import re
    from chapter_core import ROOT, run_program
    argv = ["--schedules", "zbv,dualpipev", "--layers", "4", "--hidden", "32", "--heads", "2", "--seq", "16",
            "--batch", "16", "--ep", "2", "--moe-every", "1", "--rounds", "1", "--steps-per-round", "1",
            "--parity-steps", "1", "--overlap", "--breakdown"]
    (code, out, err), = run_program(ROOT, argv, 1, tmp_path, timeout=180, environ=False,
                                    script=os.path.join("benchmarks", "pipeline_vs_torch.py"))
    assert code == 0, out + err
    for kind, theirs in TORCH_V_SCHEDULES.items():
        assert f"{kind} against torch's {theirs}:" in out, out
    assert out.count("parity step 0: loss ours") == 2, out
    for ratio, lo, hi in re.findall(r"= ([\d.]+) \(95% interval ([\d.]+) to ([\d.]+)", out):
        assert float(lo) <= float(ratio) <= float(hi), (ratio, lo, hi)
    for rank in range(4):
        overlapped = re.search(rf"rank {rank} overlapped .*\((\d+) handovers\).*\((\d+) handovers\)", out)
        apart = re.search(rf"rank {rank} one after the other .*\((\d+) handovers\).*\((\d+) handovers\)", out)
        assert min(map(int, overlapped.groups())) > 0 and set(map(int, apart.groups())) == {0}, out
    ours = [line for line in out.splitlines() if line.strip().startswith("ours rank")]
    assert len(ours) == 8 and sum("compute F&B" in line for line in ours) == 4, ours  # zbv's 4 have no pair
    assert all("bookkeeping" in line for line in ours), ours
