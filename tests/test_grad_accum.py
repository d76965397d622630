"""grad_accum.py: K micro-steps equal one big batch (1 and 2/3 DP ranks), one sync per step, clear errors."""
import copy
import importlib.util
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import chapter_core
import grad_accum as ga
from multirank import run_ranks, value_errors

# float64 everywhere: the accumulated and the one-batch gradients differ only by summation order, ~1e-16
# relative; 1e-12 leaves four orders of magnitude for a handful of additions.
TOL = 1e-12


def _data(world, K, b=2, seq=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[ga.make_batch(gen, b, seq) for _ in range(K)] for _ in range(world)]


def _reference(state, all_micro):
    torch.set_default_dtype(torch.float64)
    model = ga.TinyLM()
    model.load_state_dict(state)
    big = ga.concat_batches([mb for mbs in all_micro for mb in mbs])
    s, n = ga.token_loss(model, big)
    (s / n).backward()
    return model, (s / n).item()


def _initial_state():
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    return ga.TinyLM().state_dict()


def _max_grad_diff(a, b):
    return max((p.grad - q.grad).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def test_k_micro_batches_equal_one_batch_of_k_times_b():
    state = _initial_state()
    mbs = _data(1, K=4)
    ref, ref_loss = _reference(state, mbs)
    model = ga.TinyLM()
    model.load_state_dict(state)
    loss = ga.accumulate_gradients(model, mbs[0], ga.token_loss)
    assert loss == pytest.approx(ref_loss, abs=TOL)
    assert _max_grad_diff(model, ref) < TOL
    # and the update: one AdamW step from the accumulated gradient equals the big-batch step
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_opt.step()
    model2 = ga.TinyLM()
    model2.load_state_dict(state)
    opt = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    ga.accumulate_and_step(model2, opt, mbs[0], ga.token_loss)
    assert all(p.grad is None for p in model2.parameters())  # cleared after the step
    assert max((p - q).abs().max().item() for p, q in zip(model2.parameters(), ref.parameters())) < TOL


def test_equal_micro_batches_is_divide_by_k():
    # equal token counts: the per-token normalisation is the textbook "mean loss / K"
    state = _initial_state()
    gen = torch.Generator().manual_seed(1)
    mbs = []
    for _ in range(3):
        idx, tgt, _ = ga.make_batch(gen, 2, 5)
        mbs.append((idx, tgt, torch.ones_like(idx, dtype=torch.bool)))
    a, b = ga.TinyLM(), ga.TinyLM()
    a.load_state_dict(state)
    b.load_state_dict(state)
    ga.accumulate_gradients(a, mbs, ga.token_loss)
    for mb in mbs:
        s, n = ga.token_loss(b, mb)
        (s / n / len(mbs)).backward()
    assert _max_grad_diff(a, b) < TOL


def _dp_rank(rank, world, K, use_ddp, state, all_micro):
    torch.set_default_dtype(torch.float64)
    model = ga.TinyLM()
    model.load_state_dict(state)
    wrapped = DDP(model) if use_ddp else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = ga.accumulate_gradients(wrapped, all_micro[rank], ga.token_loss, dp_group=dist.group.WORLD)
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    return loss, grads, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("use_ddp", [False, True])
def test_dp_ranks_with_variable_length_micro_batches_equal_one_process(world, use_ddp):
    K = 3
    state = _initial_state()
    all_micro = _data(world, K, seed=world)
    ref, ref_loss = _reference(state, all_micro)
    n_tokens = [sum(int(mb[2].sum()) for mb in mbs) for mbs in all_micro]
    assert len(set(n_tokens)) > 1  # the ranks really hold different numbers of tokens
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_opt.step()
    out = run_ranks(_dp_rank, world, K, use_ddp, state, all_micro, timeout=90)
    for loss, grads, params in out:
        assert loss == pytest.approx(ref_loss, abs=TOL)
        assert max((g - p.grad).abs().max().item() for g, p in zip(grads, ref.parameters())) < TOL
        assert max((a - b).abs().max().item() for a, b in zip(params, ref.parameters())) < TOL


def _count_collectives(rank, world, K):
    torch.set_default_dtype(torch.float64)
    all_micro = _data(world, K)
    torch.manual_seed(0)
    # DDP with a small bucket cap so that the model spans several buckets
    ddp = DDP(ga.TinyLM(), bucket_cap_mb=0.01)
    counter = ga.count_ddp_collectives(ddp)
    for _ in range(2):  # DDP rebuilds its buckets after the first iteration: measure the steady state
        ga.token_loss(ddp, all_micro[rank][0])[0].backward()
    counter["allreduce"] = 0
    ga.token_loss(ddp, all_micro[rank][0])[0].backward()
    buckets = counter["allreduce"]
    counts = {"buckets": buckets}
    for name in ("right", "none", "trap"):
        counter["allreduce"] = counter["bytes"] = 0
        if name == "right":
            ga.accumulate_gradients(ddp, all_micro[rank], ga.token_loss)
        elif name == "none":
            for mb in all_micro[rank]:
                ga.token_loss(ddp, mb)[0].backward()
        else:
            ga.ddp_sync_trap(ddp, all_micro[rank], ga.token_loss)
        counts[name] = counter["allreduce"]
        counts[name + "_bytes"] = counter["bytes"]
    # the manual path: count every all_reduce issued during one accumulate_and_step
    plain = ga.TinyLM()
    issued = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        issued.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        opt = torch.optim.SGD(plain.parameters(), lr=0.1)
        ga.accumulate_and_step(plain, opt, all_micro[rank], ga.token_loss, dp_group=dist.group.WORLD,
                               bucket_bytes=4096)
    finally:
        dist.all_reduce = real_all_reduce
    counts["manual"] = issued
    counts["manual_buckets"] = len(ga.gradient_buckets(list(plain.parameters()), 4096))
    counts["n_params"] = sum(p.numel() for p in plain.parameters())
    return counts


def test_gradient_collectives_counted():
    K = 4
    for c in run_ranks(_count_collectives, 2, K, timeout=90):
        assert c["buckets"] >= 2
        assert c["right"] == c["buckets"]            # one all-reduce per bucket per step
        assert c["none"] == K * c["buckets"]         # syncing every micro-step
        assert c["trap"] == K * c["buckets"]         # no_sync around the backward only does not help
        # the hook counts bytes, not elements: one synchronised step moves every float64 gradient once
        # (3184 parameters: 25472 bytes; counting numel would give 3184)
        assert c["right_bytes"] == 8 * c["n_params"] and c["none_bytes"] == K * c["right_bytes"]
        # manual: one all-reduce per bucket, plus the 2-number loss/token total
        assert len(c["manual"]) == c["manual_buckets"] + 1 and c["manual_buckets"] >= 2
        assert sum(c["manual"][:-1]) == c["n_params"] and c["manual"][-1] == 2


def test_single_rank_issues_no_gradient_collective():
    model = ga.TinyLM()
    assert ga.sync_gradients(list(model.parameters()), None) == 0


def _sync_counting_all_reduces(rank, world, freeze_embedding):
    torch.manual_seed(0)
    model = ga.TinyLM()
    model.embed.weight.requires_grad_(not freeze_embedding)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.ones_like(p)
    issued = []
    real_all_reduce = dist.all_reduce
    dist.all_reduce = lambda t, *a, **k: issued.append(t.numel()) or real_all_reduce(t, *a, **k)
    try:
        n = ga.sync_gradients(model.parameters(), dist.group.WORLD, bucket_bytes=4096)
    finally:
        dist.all_reduce = real_all_reduce
    return n, len(issued), model.embed.weight.grad is None


def test_a_one_rank_group_issues_no_gradient_collective():
    # a real process group of one rank has nothing to sum: 0 all-reduces (not one per bucket, 5 here)
    assert run_ranks(_sync_counting_all_reduces, 1, False, timeout=60) == [(0, 0, False)]


def test_frozen_parameters_are_not_synced():
    # a frozen embedding keeps .grad None: a zero gradient put there would let AdamW's weight decay move it
    # (0.205 at lr=0.1, weight_decay=0.5, when sync_gradients kept it). The trainable float32 tensors of
    # 4096, 256, 4096, 64+2048+128 bytes make 4 buckets of at most 4096 (with the embedding's 2048: 5)
    for n, issued, frozen_grad_is_none in run_ranks(_sync_counting_all_reduces, 2, True, timeout=60):
        assert frozen_grad_is_none and n == issued == 4


def _none_group_is_local(rank, world):
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(rank)  # different weights per rank: a sync would change the gradients
    model = ga.TinyLM()
    gen = torch.Generator().manual_seed(rank)
    idx, tgt, mask = ga.make_batch(gen, 2, 4)
    ga.accumulate_gradients(model, [(idx, tgt, mask)], ga.token_loss, dp_group=None)
    before = [p.grad.clone() for p in model.parameters()]
    issued = ga.sync_gradients(list(model.parameters()), None)
    return issued, max((a - p.grad).abs().max().item() for a, p in zip(before, model.parameters())), \
        before[0].sum().item()


def test_group_none_means_no_communication_on_several_ranks():
    # group=None is "no communication", not torch.distributed's default group: on 2 ranks nothing is summed
    out = run_ranks(_none_group_is_local, 2, timeout=60)
    assert all(issued == 0 and diff == 0.0 for issued, diff, _ in out)
    assert out[0][2] != out[1][2]  # the ranks kept their own, different gradients


def test_empty_micro_batches_raise():
    with pytest.raises(ValueError, match="micro_batches is empty"):
        ga.accumulate_gradients(ga.TinyLM(), [], ga.token_loss)


def _one_rank_without_micro_batches(rank, world):
    """Rank 1 has no micro-batch this step: it contributes zeros; nobody waits on it."""
    torch.set_default_dtype(torch.float64)
    gen = torch.Generator().manual_seed(0)
    batch = ga.make_batch(gen, 2, 4)
    torch.manual_seed(0)
    model = ga.TinyLM()
    loss = ga.accumulate_gradients(model, [batch] if rank == 0 else [], ga.token_loss, dp_group=dist.group.WORLD)
    torch.manual_seed(0)
    alone = ga.TinyLM()
    alone_loss = ga.accumulate_gradients(alone, [batch], ga.token_loss)  # rank 0's batch on one rank
    diff = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), alone.parameters()))
    return loss - alone_loss, diff


def test_a_rank_without_micro_batches_contributes_zeros():
    # float64, one summation order apart: equal to 1e-12; a rank left waiting would fail on the timeout
    for loss_diff, grad_diff in run_ranks(_one_rank_without_micro_batches, 2, timeout=60):
        assert abs(loss_diff) < 1e-12 and grad_diff < 1e-12


def test_zero_tokens_raise_not_nan():
    gen = torch.Generator().manual_seed(0)
    idx, tgt, mask = ga.make_batch(gen, 2, 4)
    with pytest.raises(ValueError, match="zero tokens"):
        ga.accumulate_gradients(ga.TinyLM(), [(idx, tgt, torch.zeros_like(mask))], ga.token_loss)


def _zero_tokens_somewhere(rank, world, everywhere):
    torch.set_default_dtype(torch.float64)
    gen = torch.Generator().manual_seed(rank)
    idx, tgt, mask = ga.make_batch(gen, 2, 4)
    if everywhere or rank == 0:
        mask = torch.zeros_like(mask)
    try:
        loss = ga.accumulate_gradients(ga.TinyLM(), [(idx, tgt, mask)], ga.token_loss, dp_group=dist.group.WORLD)
    except ValueError as e:
        return str(e)
    return loss


def test_zero_tokens_over_the_global_batch_raise_on_every_rank():
    assert all("zero tokens" in str(r) for r in run_ranks(_zero_tokens_somewhere, 3, True, timeout=60))
    # one rank without tokens is fine: the others' tokens carry the mean
    losses = run_ranks(_zero_tokens_somewhere, 3, False, timeout=60)
    assert all(isinstance(x, float) and x == x for x in losses) and len(set(losses)) == 1


def test_effective_batch_size():
    assert ga.effective_batch_size(4, 8, 16) == 512
    assert ga.effective_batch_size(1, 2, 2, pipeline_micro_batches=8) == 32
    with pytest.raises(ValueError, match="accum_steps"):
        ga.effective_batch_size(4, 8, 0)
    # a float is refused even where it is >= 1 (it would give 2.5 x 2 x 2 = 10.0 sequences), and so is a
    # pipeline with no micro-batch (it would give an effective batch of 0)
    with pytest.raises(ValueError, match="^micro_batch must be a positive integer, got 2.5"):
        ga.effective_batch_size(2.5, 2, 2)
    with pytest.raises(ValueError, match="^pipeline_micro_batches must be a positive integer, got 0"):
        ga.effective_batch_size(4, 8, 16, pipeline_micro_batches=0)


def test_loss_of_a_16_bit_model_is_summed_in_float64():
    # 8 bf16 micro-batch loss sums (41 to 350) added in bf16 lose their low bits: 3.607477 per token instead
    # of 3.596963; added in float64 the returned loss is their float64 sum over the tokens, to rounding
    gen = torch.Generator().manual_seed(0)
    mbs = [ga.make_batch(gen, 2, 64) for _ in range(8)]
    torch.manual_seed(0)
    model = ga.TinyLM().to(torch.bfloat16)
    sums = []

    def recording_loss(m, batch):
        s, n = ga.token_loss(m, batch)
        sums.append(float(s.detach()))
        return s, n

    loss = ga.accumulate_gradients(model, mbs, recording_loss)
    assert loss == pytest.approx(sum(sums) / sum(int(mb[2].sum()) for mb in mbs), abs=1e-9)


def test_make_batch_draws_every_length_from_min_len_to_seq():
    # a full-length row must be possible: over 640 rows of seq 6 every length 1..6 occurs
    gen = torch.Generator().manual_seed(0)
    lengths = torch.cat([ga.make_batch(gen, 64, 6)[2].sum(1) for _ in range(10)])
    assert sorted(set(lengths.tolist())) == [1, 2, 3, 4, 5, 6]


def test_token_count_is_exact_in_a_16_bit_model():
    # 2397 tokens in bf16 would round to 2400; the count comes from the bool mask, an exact int64
    idx = torch.zeros(1, 2400, dtype=torch.long)
    mask = torch.ones(1, 2400, dtype=torch.bool)
    mask[0, :3] = False
    _, n = ga.token_loss(ga.TinyLM().to(torch.bfloat16), (idx, idx, mask))
    assert n.dtype == torch.int64 and int(n) == 2397


def test_buckets_hold_one_dtype_and_stay_under_the_cap_unless_one_tensor_exceeds_it():
    model = ga.TinyLM()
    buckets = ga.gradient_buckets(list(model.parameters()), 4096)
    nbytes = lambda bucket: sum(p.numel() * p.element_size() for p in bucket)
    assert [p for b in buckets for p in b] == list(model.parameters())  # consecutive, every parameter once
    assert all(len(b) == 1 or nbytes(b) <= 4096 for b in buckets) and len(buckets) >= 3
    # a bucket is closed before it would overflow, not after: no two neighbours would fit in one
    assert all(nbytes(a) + nbytes(b[:1]) > 4096 for a, b in zip(buckets, buckets[1:]))
    fp32, bf16 = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    assert [[p.dtype for p in b] for b in ga.gradient_buckets([fp32, bf16])] == [[torch.float32], [torch.bfloat16]]


def _ddp_misuse(rank, world):
    torch.set_default_dtype(torch.float64)
    ddp = DDP(ga.TinyLM())
    other = dist.new_group(list(range(world)))  # the same ranks, but not DDP's group object
    batch = ga.make_batch(torch.Generator().manual_seed(rank), 2, 4)
    return value_errors(lambda: ga.accumulate_gradients(ddp, [batch], ga.token_loss, dp_group=other),
                        lambda: ga.accumulate_gradients(ddp, [], ga.token_loss, dp_group=dist.group.WORLD))


def test_ddp_with_another_group_or_no_micro_batches_is_refused_before_any_collective():
    for wrong_group, empty in run_ranks(_ddp_misuse, 2, timeout=60):
        assert wrong_group is not None and "dp_group differs" in wrong_group
        assert empty is not None and "micro_batches is empty" in empty


def _hooked_ddp_and_manual_sync(rank, world):
    torch.set_default_dtype(torch.float64)
    micro = _data(world, 2)[rank]
    torch.manual_seed(0)
    model, plain = ga.TinyLM(), ga.TinyLM()
    plain.load_state_dict(model.state_dict())
    ddp = DDP(model)
    ga.count_ddp_collectives(ddp)  # the counting hook must average exactly as DDP does
    ga.accumulate_gradients(ddp, micro, ga.token_loss)
    ga.accumulate_gradients(plain, micro, ga.token_loss, dp_group=dist.group.WORLD)
    return _max_grad_diff(model, plain)


def test_the_counting_hook_gives_ddps_gradients():
    assert max(run_ranks(_hooked_ddp_and_manual_sync, 2, timeout=60)) < TOL


def test_the_file_alone_accumulates_k_micro_batches_into_the_one_big_batch_gradient(tmp_path):
    """grad_accum.py is all chapter: the whole file, copied alone into an empty folder (its imports checked first:
    standard library and torch only), accumulates K = 3 micro-batches of uneven token counts into the gradient
    of one big batch, computed here with plain autograd on a model of its own (float64)."""
    with open(os.path.join(chapter_core.ROOT, "grad_accum.py")) as f:
        source = f.read()
    chapter_core.check_imports("grad_accum", source)
    (tmp_path / "grad_accum_alone.py").write_text(source)
    spec = importlib.util.spec_from_file_location("grad_accum_alone", tmp_path / "grad_accum_alone.py")
    alone = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(alone)
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 16))
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    micro_batches = []
    for lengths in ([5, 1], [2, 2], [4, 3]):  # 6, 4 and 7 tokens: a mean of micro-batch means would be off
        idx, targets = torch.randint(16, (2, 5), generator=gen), torch.randint(16, (2, 5), generator=gen)
        micro_batches.append((idx, targets, torch.arange(5)[None, :] < torch.tensor(lengths)[:, None]))

    def summed_token_loss(net, batch):
        idx, targets, mask = batch
        return F.cross_entropy(net(idx)[mask], targets[mask], reduction="sum"), int(mask.sum())

    loss = alone.accumulate_gradients(model, micro_batches, summed_token_loss)
    idx, targets, mask = (torch.cat(parts) for parts in zip(*micro_batches))
    reference_loss = F.cross_entropy(reference(idx)[mask], targets[mask])  # the mean over all 17 tokens
    reference_loss.backward()
    assert loss == pytest.approx(reference_loss.item(), rel=TOL)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert (p.grad - q.grad).abs().max().item() < TOL
