"""The helper itself: results by rank, a failing rank's traceback, a deadlock turned into a timeout."""
import pytest
import torch
import torch.distributed as dist

from multirank import run_ranks


def _sum_of_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "sum": t, "threads": torch.get_num_threads()}


def test_results_come_back_by_rank():
    out = run_ranks(_sum_of_ranks, 3, timeout=60)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert all(o["sum"].item() == 3.0 for o in out)
    assert all(o["threads"] == 1 for o in out)


def _rank_one_raises(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank one")
    return rank


def test_failing_rank_traceback_is_surfaced():
    with pytest.raises(RuntimeError, match="(?s)rank 1 of 2 failed.*boom on rank one"):
        run_ranks(_rank_one_raises, 2, timeout=60)


def _rank_zero_skips_collective(rank, world_size):
    import time
    if rank == 0:
        time.sleep(60)  # never joins the all-reduce: the other rank waits forever
    t = torch.ones(1)
    dist.all_reduce(t)
    return t


def test_deadlock_becomes_timeout():
    with pytest.raises(TimeoutError, match="did not finish"):
        run_ranks(_rank_zero_skips_collective, 2, timeout=2)


def test_a_failed_group_setup_is_retried_once(tmp_path, monkeypatch):
    # forked ranks inherit this patch: the first launch cannot join the group, the relaunch can
    marker = tmp_path / "first-launch-done"
    real_init = dist.init_process_group

    def flaky_init(*args, **kwargs):
        if not marker.exists():
            marker.touch()
            raise RuntimeError("simulated: address already in use")
        return real_init(*args, **kwargs)

    monkeypatch.setattr(dist, "init_process_group", flaky_init)
    out = run_ranks(_sum_of_ranks, 2, timeout=30)
    assert [o["sum"].item() for o in out] == [1.0, 1.0]


def test_a_group_that_never_forms_fails_clearly(monkeypatch):
    def broken_init(*args, **kwargs):
        raise RuntimeError("simulated: no network")

    monkeypatch.setattr(dist, "init_process_group", broken_init)
    with pytest.raises(RuntimeError, match="(?s)could not join the gloo group.*simulated: no network"):
        run_ranks(_sum_of_ranks, 2, timeout=30)
