"""Gradient accumulation: a large effective batch from K small micro-batches, one gradient sync per step.

Memory for activations grows with the batch, so a batch that does not fit is cut into K micro-batches
that run forward and backward one after the other; their gradients add up in `param.grad`, and the
optimizer steps once. The effective (global) batch is

    effective batch = micro_batch x DP x K

and under pipeline parallelism a pipeline's m micro-batches already are accumulation steps:
global batch = micro_batch x m x DP, and further accumulation multiplies on top (x K). The chapter writes
micro-batch x K x world size; that holds only when every rank is a data-parallel rank: the TP, PP and CP ranks
of one model replica share its micro-batches, so only DP multiplies the batch.

Two classic mistakes this file teaches away:

1. Syncing gradients on every micro-step. Data parallelism only needs the SUM of the gradients of the
   whole step, so the all-reduce belongs after the last micro-step: 1 collective per bucket per step
   instead of K. With `DistributedDataParallel`, the first K-1 micro-steps run inside `model.no_sync()`,
   forward AND backward: DDP reads the flag in forward (that is where it arms its reducer for the next
   backward), so a forward outside `no_sync()` makes the following backward sync anyway. Without DDP, sum
   the gradients after the last micro-step yourself: flatten them into buckets and all-reduce each bucket
   once (bucketing turns hundreds of small collectives into a few large, bandwidth-bound ones).
   Communication per step: one ring all-reduce of the gradient bytes, 2 (P-1)/P of them sent per rank,
   whatever K is (plus one 2-number all-reduce of the step's loss sum and token count).

2. Normalising per micro-batch. If micro-batch i holds n_i tokens with summed loss S_i, the batch loss
   is sum_i S_i / sum_i n_i (every token weighs the same). Dividing each micro-batch by its own n_i and
   then by K (the "mean of means") gives tokens in short micro-batches more weight: token losses
   [1, 1, 1] and [5] have mean 2.0, but the mean of means is 3.0. So here each micro-step back-propagates
   its loss SUM, and after the step's only reduction the gradients are divided by the number of tokens
   of the whole global batch (all micro-batches, all DP ranks), as Megatron-LM's per-token loss does.
   The chapter's recipe, "divide each micro-batch's mean loss by K" (and by DP, which DDP's averaging
   does), is this exactly when every micro-batch holds the same number of tokens; the code differs because
   padded and packed batches do not.

Conventions: `group=None` means "no communication" (one data-parallel rank), never "the default group";
the gradient sync SUMS, and the one normalisation is the division by the global token count.

Run `python grad_accum.py` (one rank) or `torchrun --nproc_per_node=2 grad_accum.py`.
"""
import contextlib
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

DEFAULT_BUCKET_BYTES = 25 * 2 ** 20  # DDP's default bucket_cap_mb=25


def effective_batch_size(micro_batch, dp, accum_steps, pipeline_micro_batches=1):
    """Sequences per optimizer step: micro_batch x pipeline micro-batches x DP x accumulation steps."""
    for name, v in (("micro_batch", micro_batch), ("dp", dp), ("accum_steps", accum_steps),
                    ("pipeline_micro_batches", pipeline_micro_batches)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return micro_batch * pipeline_micro_batches * dp * accum_steps


def _group_size(group):
    """None is "no communication": one rank."""
    return 1 if group is None else dist.get_world_size(group)


# ---- the manual sync: flat buckets, one all-reduce each ------------------------------------------------
# A bucket, as in DDP: a few consecutive gradients flattened into one buffer of at most 25 MB, reduced by one
# collective (not the whole flat gradient buffer of an optimizer that keeps one).

def gradient_buckets(params, bucket_bytes=DEFAULT_BUCKET_BYTES):
    """Split the parameters into consecutive buckets of at most `bucket_bytes` (one dtype per bucket)."""
    buckets, current, size = [], [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > bucket_bytes or p.dtype != current[0].dtype):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def sync_gradients(params, group=None, bucket_bytes=DEFAULT_BUCKET_BYTES):
    """SUM-all-reduce the gradients over `group`, one collective per bucket; return the collective count
    (0 when `group` is None or has one rank: nothing to sync).

    Every rank must issue the same buckets in the same order, so a parameter without a gradient (unused this
    step) contributes zeros instead of being skipped.
    """
    params = [p for p in params if p.requires_grad]
    if _group_size(group) == 1:
        return 0
    count = 0
    for bucket in gradient_buckets(params, bucket_bytes):
        for p in bucket:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        dist.all_reduce(flat, group=group)
        count += 1
        offset = 0
        for p in bucket:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
    return count


# ---- the accumulation loop ---------------------------------------------------------------------------

def _all_reduce_totals(loss_sum, n_tokens, group, device):
    """Global loss sum and token count of the step: one small all-reduce over the DP group, one host sync."""
    totals = torch.stack([torch.as_tensor(loss_sum, dtype=torch.float64, device=device),
                          torch.as_tensor(n_tokens, dtype=torch.float64, device=device)])
    if _group_size(group) > 1:
        dist.all_reduce(totals, group=group)
    global_loss, global_tokens = totals.tolist()
    return global_loss, global_tokens


def accumulate_gradients(model, micro_batches, loss_fn, dp_group=None, bucket_bytes=DEFAULT_BUCKET_BYTES):
    """Forward and backward every micro-batch, sync once, leave the per-token gradient in `param.grad`.

    `loss_fn(model, batch) -> (loss_sum, n_tokens)`. `model` may be wrapped in DDP (then DDP's own process
    group is the data-parallel group, and `dp_group` must be None or that group) or be a plain module (then
    this function sums the buckets itself over `dp_group`; None: one rank, no communication). Returns the
    global mean loss per token.
    """
    micro_batches = list(micro_batches)
    is_ddp = isinstance(model, DDP)
    # a rank with no micro-batches this step still takes part in the sums (zeros), so its peers are not left
    # waiting in an all-reduce; DDP cannot do that (its all-reduces fire from the backward), nor can one rank
    if not micro_batches and (is_ddp or _group_size(dp_group) == 1):
        raise ValueError("micro_batches is empty: pass at least one micro-batch per optimizer step"
                         + (" on every rank (DDP all-reduces from inside the backward)" if is_ddp else ""))
    if is_ddp:
        if dp_group is not None and dp_group is not model.process_group:
            raise ValueError("dp_group differs from the DDP model's process group: pass dp_group=None (DDP's group "
                             "is used) or the group DDP was built with")
        dp_group = model.process_group
    params = [p for p in model.parameters() if p.requires_grad]
    loss_sum, n_tokens = 0.0, 0
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        # DDP: forward AND backward of every micro-step but the last inside no_sync (the flag is read in forward)
        ctx = model.no_sync() if is_ddp and not last else contextlib.nullcontext()
        with ctx:
            loss, n = loss_fn(model, batch)
            loss.backward()  # the SUM: normalised once below, by the global token count
        loss_sum = loss_sum + loss.detach().double()  # stays on the device: no sync per micro-step
        n_tokens = n_tokens + n
    if not is_ddp:
        sync_gradients(params, dp_group, bucket_bytes)
    device = params[0].device if params else torch.device("cpu")
    global_loss, global_tokens = _all_reduce_totals(loss_sum, n_tokens, dp_group, device)
    if global_tokens == 0:
        # every rank sees the same total, so every rank raises here together: no rank is left in a collective
        raise ValueError("the global batch holds zero tokens (n_tokens summed over all micro-batches and DP "
                         "ranks is 0): check the loss mask or the data loader")
    # DDP averaged over its ranks (sum / P); the manual sync summed. Either way: divide the sum by the tokens.
    scale = (_group_size(dp_group) if is_ddp else 1) / global_tokens
    for p in params:
        if p.grad is not None:
            p.grad.mul_(scale)
    return global_loss / global_tokens


def accumulate_and_step(model, optimizer, micro_batches, loss_fn, dp_group=None,
                        bucket_bytes=DEFAULT_BUCKET_BYTES):
    """K micro-steps, one gradient sync, one optimizer step, gradients cleared. Returns the global mean loss."""
    loss = accumulate_gradients(model, micro_batches, loss_fn, dp_group, bucket_bytes)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


# ---- measuring: count DDP's gradient collectives -------------------------------------------------------

def count_ddp_collectives(ddp_model):
    """Install a DDP communication hook that does DDP's usual averaging all-reduce (over DDP's own group)
    and counts it. Returns a dict whose "allreduce" entry grows by one per bucket per synchronised backward."""
    counter = {"allreduce": 0, "bytes": 0}
    group = ddp_model.process_group
    world = _group_size(group)

    def hook(state, bucket):
        buf = bucket.buffer()
        counter["allreduce"] += 1
        counter["bytes"] += buf.numel() * buf.element_size()
        fut = dist.all_reduce(buf.div_(world), group=group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    ddp_model.register_comm_hook(None, hook)
    return counter


def ddp_sync_trap(ddp_model, micro_batches, loss_fn):
    """The mistake: only the backward inside no_sync(). DDP armed its reducer in the forward, so it syncs."""
    for batch in micro_batches:
        loss, _ = loss_fn(ddp_model, batch)
        with ddp_model.no_sync():
            loss.backward()


# ---- the demo ---------------------------------------------------------------------------------------

class TinyLM(nn.Module):
    """A next-token model small enough to check in float64: embedding -> MLP -> logits."""

    def __init__(self, vocab=32, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.embed(idx)
        return self.head(x + self.mlp(x))


def token_loss(model, batch):
    """Summed next-token cross-entropy over the unmasked tokens, and their count."""
    idx, targets, mask = batch
    logits = model(idx)
    losses = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    mask = mask.flatten()
    # the count: an int64 tensor (exact in any loss dtype), kept on the device: no host sync per micro-batch
    return (losses * mask.to(losses.dtype)).sum(), mask.sum()


def make_batch(gen, batch, seq, vocab=32, min_len=1):
    """Random sequences with random valid lengths (right padding masked out)."""
    idx = torch.randint(vocab, (batch, seq + 1), generator=gen)
    lengths = torch.randint(min_len, seq + 1, (batch,), generator=gen)
    mask = torch.arange(seq)[None, :] < lengths[:, None]
    return idx[:, :-1], idx[:, 1:], mask


def concat_batches(batches):
    return tuple(torch.cat(parts) for parts in zip(*batches))


def _init_single_rank():
    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group("gloo")
        else:  # plain `python grad_accum.py`: a one-rank gloo group, so DDP and the counts still run
            store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def _say(text):
    """Print on rank 0 only: every rank measures, one speaks."""
    if dist.get_rank() == 0:
        print(text)


def show_effective_batch(micro_batch, world, K):
    _say(f"== effective batch = micro_batch x DP x K = {micro_batch} x {world} x {K} = "
         f"{effective_batch_size(micro_batch, world, K)} sequences; under a pipeline of m=8 micro-batches: "
         f"{effective_batch_size(micro_batch, world, K, 8)}")


def show_k_micro_steps_equal_one_big_batch(all_micro):
    """One process on the global batch against K micro-steps on every rank; returns the one-process model,
    whose .grad holds the reference gradient."""
    rank, world, K = dist.get_rank(), len(all_micro), len(all_micro[0])
    torch.manual_seed(0)
    reference = TinyLM()
    model = TinyLM()
    model.load_state_dict(reference.state_dict())
    big = concat_batches([batch for rank_batches in all_micro for batch in rank_batches])
    loss_sum, tokens = token_loss(reference, big)
    (loss_sum / tokens).backward()
    loss = accumulate_gradients(model, all_micro[rank], token_loss, dp_group=None if world == 1 else dist.group.WORLD)
    err = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    _say(f"== equivalence: global batch of {int(tokens)} tokens in one process vs {K} variable-length micro-batches on "
         f"{world} rank(s): loss {loss:.12f} vs {(loss_sum / tokens).item():.12f}, max |grad diff| {err:.2e} (float64)")
    return reference


def _ddp_all_reduces(counter, run):
    """Gradient all-reduces DDP issues while `run()` runs."""
    counter["allreduce"] = 0
    run()
    return counter["allreduce"]


def _backward_without_no_sync(ddp, micro_batches):
    """No no_sync at all: every backward syncs."""
    for batch in micro_batches:
        token_loss(ddp, batch)[0].backward()


def show_one_ddp_sync_per_step(micro_batches):
    """no_sync around forward AND backward of the first K-1 micro-steps: one sync; the other two ways: K."""
    K = len(micro_batches)
    ddp = DDP(TinyLM(), bucket_cap_mb=25)
    counter = count_ddp_collectives(ddp)
    right = _ddp_all_reduces(counter, lambda: accumulate_gradients(ddp, micro_batches, token_loss))
    none = _ddp_all_reduces(counter, lambda: _backward_without_no_sync(ddp, micro_batches))
    trap = _ddp_all_reduces(counter, lambda: ddp_sync_trap(ddp, micro_batches, token_loss))
    _say(f"== DDP gradient all-reduces per step of K={K} micro-steps ({none // K} bucket(s)): no_sync around "
         f"forward+backward: {right}; no no_sync: {none}; no_sync around the backward only (the trap): {trap}; "
         f"{counter['bytes'] // (right + none + trap)} bytes each")


def show_one_all_reduce_per_bucket(world):
    """The manual sync issues one all-reduce per bucket, whatever K is (a spare model: only shapes matter)."""
    params = list(TinyLM().parameters())
    buckets = gradient_buckets(params, bucket_bytes=4096)
    manual = sync_gradients(params, dist.group.WORLD, bucket_bytes=4096)
    nbytes = sum(p.numel() * p.element_size() for p in params)
    _say(f"== manual sync with 4 KiB buckets: {len(buckets)} buckets of {nbytes} gradient bytes -> {manual} "
         f"all-reduces (none on one rank); a ring all-reduce sends 2(P-1)/P x {nbytes} = "
         f"{2 * (world - 1) / world * nbytes:.0f} bytes per rank per step, whatever K is")


def show_mean_of_means_overweights_short_micro_batches():
    token_losses = [[1.0, 1.0, 1.0], [5.0]]
    right_mean = sum(map(sum, token_losses)) / sum(map(len, token_losses))
    mean_of_means = sum(sum(x) / len(x) for x in token_losses) / len(token_losses)
    _say(f"== token losses {token_losses}: per-token mean {right_mean} (this file), mean of micro-batch means "
         f"{mean_of_means} (the mistake)")


def show_mean_of_means_gradient_error(reference, micro_batches):
    """The textbook recipe (each micro-batch's mean / K, DDP's average over ranks) on variable lengths, against
    the one-big-batch gradient left in `reference`."""
    K, world = len(micro_batches), dist.get_world_size()
    naive = TinyLM()
    naive.load_state_dict(reference.state_dict())
    for batch in micro_batches:
        s_i, n_i = token_loss(naive, batch)
        (s_i / n_i / K).backward()
    if world > 1:
        for p in naive.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
    num = sum(((p.grad - q.grad) ** 2).sum() for p, q in zip(naive.parameters(), reference.parameters()))
    den = sum((q.grad ** 2).sum() for q in reference.parameters())
    _say(f"   on the variable-length micro-batches above the mean-of-means gradient is off by "
         f"{(num / den).sqrt().item():.1%} (relative L2) against the one-big-batch gradient")


def demo():
    rank, world = _init_single_rank()
    torch.set_default_dtype(torch.float64)
    K, micro_batch, seq = 4, 2, 8
    gen = torch.Generator().manual_seed(0)
    # every rank draws every rank's micro-batches, keeps its own: the reference sees the global batch
    all_micro = [[make_batch(gen, micro_batch, seq) for _ in range(K)] for _ in range(world)]
    show_effective_batch(micro_batch, world, K)
    reference = show_k_micro_steps_equal_one_big_batch(all_micro)
    show_one_ddp_sync_per_step(all_micro[rank])
    show_one_all_reduce_per_bucket(world)
    show_mean_of_means_overweights_short_micro_batches()
    show_mean_of_means_gradient_error(reference, all_micro[rank])
    dist.barrier()  # gloo aborts a rank that tears down while a peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    demo()
