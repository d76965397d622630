"""V-shaped pipelines (train_gpt.py, below its banner): ZB-V and DualPipeV. Each rank's list against the one torch's
own schedule builds, the lists replayed against their formulas, drawn by --show-schedule."""
import os
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt  # noqa: E402
from train_gpt import Action, Overlapped  # noqa: E402

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
                # ZB-V's W's follow their B's but where the drain defers them: the peak to W equals the one to B
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
    assert "54 units (formula 54)" in dual and "in flight per rank (chunks): 8 (8), 8 (8), 8 (8), 9 (9)" in dual
    assert "bubble per rank 6 units, formula 6: (p - 1)(F&B + B - 3W)" in dual
    # rank 0's first pair: chunk 0's forward of micro-batch 7 beside chunk 1's whole backward of micro-batch 3
    assert "F3.1  F7.0  &B3.1 &B3.1 ." in dual.splitlines()[0]
    assert train_gpt.schedule_error("zbv", 4, 8, 1) == ("--pp-schedule zbv places two model chunks per rank in a V: "
                                                        "pass --virtual-stages 2")
    assert "at least 2 --pp = 8" in train_gpt.schedule_error("dualpipev", 4, 7, 2)
    assert train_gpt.schedule_error("zbv", 4, 3, 2) is None  # ZB-V takes any m
