"""Rank layout of parallel training: which GPU does what, which groups talk, and over which link.

A job on N GPUs splits the work up to five ways. Tensor parallelism (TP) splits every weight matrix of a layer and
pays 4 collectives per layer and micro-batch (2 forward, 2 backward), each an all-reduce of the whole activation
b s h (with sequence parallelism, SP, an all-gather and a reduce-scatter: the same bytes, forward; Megatron-LM's SP
backward gathers each GEMM's input once more instead of keeping it, 10 halves where 8); a ring all-reduce over t
ranks sends 2 (t-1)/t b s h e bytes from each GPU (e = 2 bytes per 16-bit element). Inside a DGX A100 node NVLink
carries about 230 GB/s per GPU; across nodes each GPU has one InfiniBand NIC, about 23 GB/s: ten times less. So TP
stays inside a node. Pipeline parallelism (PP) splits the layers: a stage sends one activation of b s h/t elements
per GPU and micro-batch forward and one gradient back, little enough for InfiniBand, but the pipeline idles: with
m micro-batches per step, 1F1B's bubble is (p-1)/m of the busy time. Data parallelism (DP) replicates the model
and all-reduces the gradients once per step. Context parallelism (CP) splits the sequence and talks only inside
attention; expert parallelism (EP) places the experts of MoE layers on different ranks.

Megatron-LM numbers the ranks so that the chattiest dimension is the closest (order tp-cp-dp-pp, TP fastest):

    rank = tp_rank + TP * (cp_rank + CP * (dp_rank + DP * pp_rank)),      world = TP x CP x DP x PP

A TP group is TP consecutive ranks (inside a node when TP divides the GPUs per node); a CP group strides by TP, a
DP group by TP*CP, a PP group by TP*CP*DP, across nodes. `rank_groups` lists every group of every kind: tp cp dp
pp; dp_cp (the dense gradients' reduction), tp_cp (the ranks sharing one micro-batch's tokens), tp_pp (model
parallel), embedding (first and last stage: the tied embedding's gradient), ep and edp (next paragraph). One
algorithm makes them all (`groups_along`): a kind's groups are the ranks that share every coordinate but the kind's
own. `init_parallel`, Megatron-LM's `initialize_model_parallel` (the chapter's `mpu` call), creates them on the
default process group and returns this rank's `ParallelState`; `rank_map` draws the grid and says which groups
leave a node. (The full file adds hybrid CP's and hybrid sharding's sub-groups: `init_hybrid_parallel`.)

Experts fold over the same ranks (Megatron's MoE parallel folding, expert TP = TP): the expert grid is tp-ep-edp-pp
with EP x EDP = CP x DP, so an EP group is drawn from the data- and context-parallel ranks of one (tp, pp)
position, at stride TP (inside a node while TP x EP fits one), and an EDP group (expert data parallel) holds the
replicas of one expert shard and reduces its gradients.

The chapter's question, plan A or plan B, on a model of this file's choosing: the chapter names none and says the
answer depends on the layers, the model's size and the bandwidths. Here a GPT of L = 40 layers, h = 5120, a = 40
heads, s = 2048, V = 51200 (13B parameters, `EXAMPLE_MODEL`), global batch B = 512, on 64 A100 (8 nodes x 8).
Plan A is TP=8 PP=4 DP=2, plan B TP=4 PP=8 DP=2; both with micro-batch b = 1 (m = B/(d b) = 256 micro-batches per
pipeline), selective recomputation with SP, 1F1B, no ZeRO (`plan_figures`):
    memory   per GPU P = ((12 h^2 + 13 h) L/p + V h)/t + s h parameters (stage 0 also holds the embedding; the
             positions are not split), at 2 + 4 + 12 = 18 bytes each, as mixed_precision.py keeps them: 16-bit
             weight, FP32 main gradient, FP32 master and Adam's two moments (Megatron-LM 2021 counts 20: a 16-bit
             gradient and an FP32 copy of it in the optimizer state).
             Activations (Korthikanti et al. 2022): 34 s b h/t per layer x L/p layers x p micro-batches in flight
             on stage 0, + s b h/t (embedding dropout mask) per micro-batch + 5 a s^2 b/t (the layer recomputed)
    TP       m (L/p) 4 all-reduces of 2 (t-1)/t b s h e per GPU and step, on NVLink in both plans (A's TP=8 fills
             a node, B's TP=4 half): per GPU and micro-batch A sends (L/4)(7/8) = 8.75, B (L/8)(3/4) = 3.75 x 8 b s h e
    DP       2 (d-1)/d 4 P per GPU (the FP32 main gradients): A's DP pair sits 8 ranks apart, in two nodes
             (InfiniBand); B's 4 apart, in one node (NVLink); first and last stage also all-reduce the tied
             embedding's gradient, 4 V h/t
    PP       2 m exchanges of b s h/t e per stage, across nodes in both plans; bubble (p-1)/m: 3/256 for A,
             7/256 for B
B sends less than half of A's TP bytes and keeps its gradient reduction on NVLink; it pays a bubble 7/3 of A's and
holds twice A's activations (8 micro-batches of L/8 layers at 1/4 against 4 of L/4 at 1/8), which still fit. With
256 micro-batches the bubble is small and B is faster. Few micro-batches (a small batch of wide layers) turn the
answer to A. Seconds here are bytes over the link plus each collective's latency; compute is the step's FLOPs at
0.71 of the A100's 312 TFLOP/s, the fraction large GEMMs reach (fitted to Megatron-LM's published A100 runs,
Narayanan et al. 2021, Table 1: the full file's calibration). `python topology.py` prints the groups, the rank map
and both plans. Beyond the chapter, the full file's planner ranks every layout with every knob (memory, step time
term by term); for plans A and B its memory, communication seconds and bubble are these.
"""
import functools
import itertools
import math
import numbers
import os
import warnings
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

GROUP_KINDS = ("tp", "cp", "dp", "pp", "dp_cp", "tp_cp", "tp_pp", "embedding", "ep", "edp")


# ---- the layout: pure arithmetic on rank numbers, no process group needed ------------------------------
def _is_positive_int(value):
    """An integer >= 1: Python's or numpy's, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def _check_positive(**sizes):
    for name, value in sizes.items():
        if not _is_positive_int(value):
            raise ValueError(f"{name} must be a positive integer, got {value!r}; use {name}=1 to disable it")


def _check_count(name, value, fix):
    """A size or a count: an integer >= 1, else a ValueError naming the field, its flag and `fix`."""
    if not _is_positive_int(value):
        raise ValueError(f"{name}={value!r} must be a positive integer (--{name.replace('_', '-')}); {fix}")


def _divisors(n):
    return list(_divisor_tuple(n))


@functools.lru_cache(maxsize=4096)
def _divisor_tuple(n):
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def validate_layout(world_size, tp=1, pp=1, cp=1, ep=1):
    """Check that the sizes tile the world; return dp. Raises ValueError naming the parameter and a fix."""
    if not _is_positive_int(world_size):  # no size 1 "disables" the world, unlike tp..ep
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}: the number of ranks")
    _check_positive(tp=tp, pp=pp, cp=cp, ep=ep)
    model_parallel = tp * pp * cp
    if world_size % model_parallel != 0:
        if world_size % cp:
            fix = f"cp={cp} does not divide {world_size}, so no tp and pp can: choose cp among {_divisors(world_size)}"
        else:
            fits = [(t, p) for t in _divisors(world_size) for p in _divisors(world_size // t)
                    if world_size % (t * p * cp) == 0]
            hint = ", ".join(f"tp={t} pp={p}" for t, p in fits[:6])
            fix = f"choose tp, pp, cp whose product divides {world_size} (with cp={cp}: {hint})"
        raise ValueError(f"world_size={world_size} is not divisible by tp*pp*cp={tp}*{pp}*{cp}={model_parallel}; "
                         + fix)
    dp = world_size // model_parallel
    if (cp * dp) % ep != 0:
        raise ValueError(f"ep={ep} must divide cp*dp={cp}*{dp}={cp * dp} (experts fold over the data- and "
                         f"context-parallel ranks); valid ep values: {_divisors(cp * dp)}")
    return dp


def groups_along(shape, names, vary):
    """Every group of the kind that varies the dims `vary` of the grid `shape` (named `names`, first dim fastest).

    A rank is a number in mixed radix: rank = c0 + n0 (c1 + n1 (c2 + ...)), coordinate c_i of dim i running over
    0..n_i-1, so dim i strides by n0 n1 ... n_{i-1}. A group of the kind is every rank that shares all coordinates
    but those of `vary`: the outer loop fixes the other dims' coordinates (one group each), the inner one runs the
    `vary` dims through all their values. With (tp, cp, dp, pp): vary ["dp"] gives the DP groups (stride tp cp),
    vary ["dp", "cp"] the dp_cp groups. Each group ascending, groups ordered by their first rank (Megatron-LM's
    order)."""
    strides = [math.prod(shape[:i]) for i in range(len(shape))]
    fixed = [i for i, n in enumerate(names) if n not in vary]
    moving = [i for i, n in enumerate(names) if n in vary]
    groups = []
    for fixed_coords in itertools.product(*(range(shape[i]) for i in fixed)):
        base = sum(c * strides[i] for c, i in zip(fixed_coords, fixed))
        ranks = sorted(base + sum(c * strides[i] for c, i in zip(coords, moving))
                       for coords in itertools.product(*(range(shape[i]) for i in moving)))
        groups.append(ranks)
    return sorted(groups)


def rank_groups(world_size, tp=1, pp=1, cp=1, ep=1):
    """Every group of every kind for a Megatron-LM layout, as lists of ranks (GROUP_KINDS; the module docstring).
    `tp_cp` is Megatron-LM's group for MoE router statistics."""
    dp = validate_layout(world_size, tp, pp, cp, ep)
    dense_shape, dense_names = (tp, cp, dp, pp), ("tp", "cp", "dp", "pp")
    expert_shape, expert_names = (tp, ep, cp * dp // ep, pp), ("tp", "ep", "edp", "pp")
    groups = {kind: groups_along(dense_shape, dense_names, [kind])
              for kind in ("tp", "cp", "dp", "pp")}
    groups["dp_cp"] = groups_along(dense_shape, dense_names, ["dp", "cp"])
    groups["tp_cp"] = groups_along(dense_shape, dense_names, ["tp", "cp"])
    groups["tp_pp"] = groups_along(dense_shape, dense_names, ["tp", "pp"])
    groups["embedding"] = [[g[0], g[-1]] if len(g) > 1 else list(g) for g in groups["pp"]]
    groups["ep"] = groups_along(expert_shape, expert_names, ["ep"])
    groups["edp"] = groups_along(expert_shape, expert_names, ["edp"])
    return groups


def rank_coordinates(rank, world_size, tp=1, pp=1, cp=1, ep=1):
    """{kind: coordinate} of one rank, the inverse of the rank formula: tp, cp, dp, pp; ep and edp on the expert
    grid."""
    dp = validate_layout(world_size, tp, pp, cp, ep)
    # the digits below would wrap around silently
    if not (isinstance(rank, numbers.Integral) and not isinstance(rank, bool) and 0 <= rank < world_size):
        raise ValueError(f"rank={rank!r} must be an integer in 0..{world_size - 1} (world_size={world_size})")
    coords = {}
    rest = rank
    for name, size in (("tp", tp), ("cp", cp), ("dp", dp), ("pp", pp)):
        coords[name], rest = rest % size, rest // size
    # the expert grid shares tp and pp; its middle digit cp_rank + cp * dp_rank splits as ep fastest
    middle = coords["cp"] + cp * coords["dp"]
    coords["ep"], coords["edp"] = middle % ep, middle // ep
    return coords


def group_locality(groups, gpus_per_node):
    """For each group kind: True when every group of that kind stays inside one node."""
    return {kind: all(len({r // gpus_per_node for r in g}) == 1 for g in gs) for kind, gs in groups.items()}


def warn_if_tp_crosses_nodes(groups, gpus_per_node):
    if not group_locality({"tp": groups["tp"]}, gpus_per_node)["tp"]:
        warnings.warn(f"a TP group crosses nodes (gpus_per_node={gpus_per_node}, tp group {groups['tp'][0]}): "
                      "TP issues 4 activation-sized collectives per layer and wants NVLink; "
                      f"choose tp <= {gpus_per_node} dividing it, and put the rest into pp or dp", stacklevel=2)


# ---- process groups: one object per rank with its coordinates and its groups ---------------------------
@dataclass
class ParallelState:
    """One rank's place in the layout. `groups[kind]` is the process group of that kind holding this rank,
    `ranks[kind]` its ranks (None and [] for the embedding group of a middle pipeline stage);
    `pp_prev`/`pp_next` are global ranks (None at the ends of the pipeline)."""
    rank: int
    world_size: int
    sizes: dict
    coords: dict
    groups: dict = field(repr=False)
    ranks: dict
    pp_prev: object
    pp_next: object
    is_first_stage: bool
    is_last_stage: bool
    intra_node: dict
    mesh: object = field(default=None, repr=False)

    tp_rank = property(lambda self: self.coords["tp"])
    cp_rank = property(lambda self: self.coords["cp"])
    dp_rank = property(lambda self: self.coords["dp"])
    pp_rank = property(lambda self: self.coords["pp"])
    ep_rank = property(lambda self: self.coords["ep"])
    edp_rank = property(lambda self: self.coords["edp"])


def choose_backend(say=None):
    """NCCL when every process on this node has a GPU of its own, else gloo on CPU processes (with a warning
    where GPUs exist): more processes than GPUs would fail in `torch.cuda.set_device` ("invalid device ordinal").
    `say(message)` speaks the warning (default `warnings.warn`; a trainer passes one that prints on rank 0 only)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if not torch.cuda.is_available():
        return "gloo"
    if torch.cuda.device_count() < local_world:
        (say or warnings.warn)(f"{local_world} processes per node but {torch.cuda.device_count()} GPUs: running on "
                               "CPU processes (gloo); start at most one process per GPU to use them")
        return "gloo"
    return "nccl"


def _timeout(timeout_s):
    """A collective that waits longer than this raises (gloo) or aborts the process (NCCL's watchdog). None: torch's
    default, 30 minutes for a new_group, which is why every group here is given the caller's timeout."""
    return None if timeout_s is None else timedelta(seconds=timeout_s)


def init_distributed(timeout_s=None, say=None):
    """Initialise the default process group from torchrun's environment (`choose_backend`), or a one-process group
    when the program runs as plain `python` (no RANK in the environment)."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        backend = choose_backend(say)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=_timeout(timeout_s))
    return dist.get_rank(), dist.get_world_size()


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parallel_state(rank, world_size, tp=1, pp=1, cp=1, ep=1, gpus_per_node=None, groups=None):
    """One rank's ParallelState from arithmetic alone: coordinates, sizes, the ranks of each of its groups and its
    pipeline neighbours. `groups` (kind -> process group) is filled in by init_parallel; without it every group is
    None, so a one-process program (or a tool that only needs the layout) needs no process group."""
    layout = rank_groups(world_size, tp, pp, cp, ep)  # raises before any communication
    coords = rank_coordinates(rank, world_size, tp, pp, cp, ep)
    # a middle pipeline stage is in no embedding group: None and [] there
    my_ranks = {kind: next((list(g) for g in layout[kind] if rank in g), []) for kind in GROUP_KINDS}
    dp, stage, pp_ranks = world_size // (tp * pp * cp), coords["pp"], my_ranks["pp"]
    return ParallelState(
        rank=rank, world_size=world_size,
        sizes={"tp": tp, "cp": cp, "dp": dp, "pp": pp, "ep": ep, "edp": cp * dp // ep, "dp_cp": dp * cp,
               "tp_cp": tp * cp},
        coords=coords, groups=dict(groups or dict.fromkeys(GROUP_KINDS)), ranks=my_ranks,
        pp_prev=pp_ranks[stage - 1] if stage > 0 else None,
        pp_next=pp_ranks[stage + 1] if stage < pp - 1 else None,
        is_first_stage=stage == 0, is_last_stage=stage == pp - 1,
        intra_node=group_locality(layout, gpus_per_node or world_size))


def init_parallel(tp=1, pp=1, cp=1, ep=1, gpus_per_node=None, with_mesh=True, timeout_s=None):
    """Create every group of the layout on the default process group; return this rank's ParallelState. Megatron-LM
    calls this `initialize_model_parallel` (`mpu.initialize_model_parallel(tp, pp, ...)` in the chapter).

    The layout is validated before any group is created, so a bad layout raises the same ValueError on every
    rank and none of them hangs in `new_group`. `timeout_s` bounds every collective of every group (and of the
    default group, if this call creates it): without it a sub-group would wait torch's default 30 minutes for a
    rank that stopped, whatever the default group's timeout.
    """
    if gpus_per_node is not None and not _is_positive_int(gpus_per_node):
        raise ValueError(f"gpus_per_node={gpus_per_node!r} must be a positive integer; omit it to read "
                         "LOCAL_WORLD_SIZE")
    if timeout_s is not None and not (isinstance(timeout_s, numbers.Real) and 0 < timeout_s < math.inf):
        raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds (or None)")
    rank, world_size = init_distributed(timeout_s)
    groups = rank_groups(world_size, tp, pp, cp, ep)  # raises before any communication
    if gpus_per_node is None:
        gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    warn_if_tp_crosses_nodes(groups, gpus_per_node)

    # new_group is collective over the whole default group: every rank must call it for every group, in the
    # same order, even for the groups it is not in; otherwise group ids disagree across ranks and the next
    # collective deadlocks. Kinds that coincide (dp_cp == dp when cp == 1) reuse one handle.
    handles, mine = {}, dict.fromkeys(GROUP_KINDS)
    for kind in GROUP_KINDS:
        for ranks in groups[kind]:
            key = tuple(ranks)
            if key not in handles:
                handles[key] = dist.new_group(ranks, timeout=_timeout(timeout_s))
            if rank in ranks:
                mine[kind] = handles[key]
    state = parallel_state(rank, world_size, tp, pp, cp, ep, gpus_per_node, groups=mine)
    if with_mesh:
        from torch.distributed.device_mesh import init_device_mesh
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        # mesh dims outermost first: pp, dp, cp, tp (tp fastest) is exactly the rank formula above
        state.mesh = init_device_mesh(device, (pp, state.sizes["dp"], cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
    return state


# ---- the rank map picture ------------------------------------------------------------------------------
def rank_map(nodes, gpus_per_node, tp=1, pp=1, cp=1, ep=1):
    """A node x GPU grid of (tp, cp, dp, pp) coordinates, then the group lists and where each kind lives."""
    # each on its own: -1 nodes x -8 GPUs would make a world of 8 and an empty grid
    _check_count("nodes", nodes, "the number of nodes to draw")
    _check_count("gpus_per_node", gpus_per_node, "the GPUs of one node")
    world = nodes * gpus_per_node
    groups = rank_groups(world, tp, pp, cp, ep)
    dp = world // (tp * pp * cp)
    header = f"world={world} = tp {tp} x cp {cp} x dp {dp} x pp {pp}   (ep {ep}, edp {cp * dp // ep})"
    return draw_rank_map(header, nodes, gpus_per_node, [rank_coordinates(r, world, tp, pp, cp, ep)
                                                        for r in range(world)], groups)


def draw_rank_map(header, nodes, gpus_per_node, coords, groups):
    """The picture: `header`, the grid of every rank's coordinates `coords[rank]`, then each kind of `groups`."""
    lines = [header, "each cell: rank tp.cp.dp.pp"]
    cells = [f"{r:>3d} {c['tp']}.{c['cp']}.{c['dp']}.{c['pp']}" for r, c in enumerate(coords)]
    width = max(len(cell) for cell in cells) + 1  # at least one space between cells, however many digits
    lines.append(("        " + "".join(f"gpu{g}".ljust(width) for g in range(gpus_per_node))).rstrip())
    for n in range(nodes):
        row = cells[n * gpus_per_node:(n + 1) * gpus_per_node]
        lines.append(f"node{n:<3d} " + "".join(cell.ljust(width) for cell in row).rstrip())
    local = group_locality(groups, gpus_per_node)
    lines.append("")
    name_width = max(9, *(len(kind) for kind in groups))
    for kind, gs in groups.items():
        shown = " ".join(str(g) for g in gs[:8]) + (f" ... ({len(gs)} groups)" if len(gs) > 8 else "")
        where = "inside a node" if local[kind] else "CROSSES nodes"
        lines.append(f"{kind:>{name_width}s} [{where}]: {shown}")
    if not local["tp"]:
        lines.append("WARNING: TP crosses nodes; TP wants NVLink, put the extra factor into pp or dp")
    return "\n".join(lines)


# ---- plan A against plan B on 64 GPUs, in closed form ----------------------------------------------------

GB = 1e9
MEMORY_HEADROOM = 0.9       # usable fraction of GPU memory: CUDA context, allocator fragmentation, buffers
ACT_BYTES = 2               # 16-bit activations and gradients on the wire
# Model states per parameter as mixed_precision.py keeps them: 16-bit weight, FP32 main gradient (accumulated and
# all-reduced in FP32), FP32 master weight and Adam's two FP32 moments: 2 + 4 + 12 = 18 bytes
STATE_BYTES = {"weights": 2, "grads": 4, "optimizer": 12}
# One DGX A100 80 GB: datasheet peak; 0.71 of it, what large GEMMs reach (fitted to Megatron-LM's published A100
# runs, Narayanan et al. 2021, Table 1, by the full file's planner); the achieved bus bandwidth of an all-reduce on
# NVLink, InfiniBand per GPU (HDR, one NIC each), latency per collective and per pipeline exchange
A100 = dict(gpu_mem_gb=80, peak_tflops=312, efficiency=0.71, nvlink_gbps=230, ib_gbps=23, collective_latency_us=10,
            p2p_latency_us=50)
# plan A against B needs a model, and the chapter names none: this file's choice, a GPT of 13B parameters
EXAMPLE_MODEL = dict(layers=40, hidden=5120, heads=40, seq=2048, vocab=51200, global_batch=512)
CHAPTER_PLANS = {"A": dict(tp=8, pp=4, dp=2), "B": dict(tp=4, pp=8, dp=2)}


def dense_layer_parameters(hidden):
    """12 h^2 + 13 h: attention 4 h^2 + 4 h, MLP 8 h^2 + 5 h, two LayerNorms 4 h."""
    return 12 * hidden * hidden + 13 * hidden


def layer_activation_bytes(seq, hidden, heads, micro_batch, tp, cp=1, recompute="selective", sequence_parallel=True,
                           flash_attention=False):
    """Korthikanti et al. 2022, 16-bit, one layer and micro-batch, the sequence split cp ways (the scores keep one s):
    without SP  none s b h (10 + 24/t + 5as/(ht)), selective s b h (10 + 24/t), full 2 s b h;
    with SP     none s b h/t (34 + 5as/h),        selective 34 s b h/t,       full 2 s b h/t.
    A flash attention kernel stores no scores: its "none" is "selective"."""
    s_local, s, h, a, t = seq // cp, seq, hidden, heads, tp
    sbh = s_local * micro_batch * h
    scores = 0 if flash_attention else 5 * a * s / (h * t)
    if sequence_parallel:
        return {"none": sbh / t * (34 + scores * t), "selective": 34 * sbh / t, "full": 2 * sbh / t}[recompute]
    return {"none": sbh * (10 + 24 / t + scores), "selective": sbh * (10 + 24 / t), "full": 2 * sbh}[recompute]


def ring_allreduce_bytes(tokens, hidden, ranks, bytes_per_element=ACT_BYTES):
    """Bytes each GPU sends in a ring all-reduce of a tokens x hidden tensor over `ranks`: 2 (n-1)/n of it."""
    return 2 * (ranks - 1) / ranks * tokens * hidden * bytes_per_element


def plan_figures(tp, pp, dp, layers, hidden, heads, seq, vocab, global_batch, micro_batch=1, gpus_per_node=8,
                 machine=A100):
    """The docstring's closed form for one layout of a dense GPT (cp 1, 1F1B, selective recomputation with SP, no
    ZeRO): stage 0's memory in bytes, what each GPU sends per step and over which link, the bubble, and seconds."""
    micro_batches, stage_layers = global_batch // (dp * micro_batch), layers // pp
    # memory of a stage-0 GPU: its layers' and the embedding's parameters, and the activations of the micro-batches
    # in flight (1F1B: p before their backward; GPipe would hold all m)
    params = (dense_layer_parameters(hidden) * stage_layers + vocab * hidden) / tp + seq * hidden
    out = {"params": params, "micro_batches": micro_batches, "in_flight": min(pp, micro_batches),
           **{f"{kind}_bytes": size * params for kind, size in STATE_BYTES.items()}}
    kept = stage_layers * layer_activation_bytes(seq, hidden, heads, micro_batch, tp)
    working = 5 * heads * seq * seq * micro_batch / tp  # the scores of the layer being recomputed
    embedding = seq * micro_batch * hidden / tp  # the embedding's dropout mask, split by SP
    logits = 4 * seq * micro_batch * vocab / tp if pp == 1 else 0.0  # fp32 logits when stage 0 is also the last
    out["activations_bytes"] = kept * out["in_flight"] + working + embedding * out["in_flight"] + logits
    out["memory_bytes"] = sum(out[f"{kind}_bytes"] for kind in STATE_BYTES) + out["activations_bytes"]
    out["fits"] = out["memory_bytes"] <= MEMORY_HEADROOM * machine["gpu_mem_gb"] * GB
    # what each GPU sends per step, and over which link its group runs
    out["inside_node"] = inside = group_locality(rank_groups(tp * pp * dp, tp=tp, pp=pp), gpus_per_node)
    link = {kind: (machine["nvlink_gbps"] if inside[kind] else machine["ib_gbps"]) * GB for kind in ("tp", "dp", "pp")}
    tp_collectives = micro_batches * stage_layers * 4 if tp > 1 else 0  # 2 forward, 2 backward
    out["tp_bytes"] = tp_collectives * ring_allreduce_bytes(seq * micro_batch, hidden, tp)
    pp_exchanges = 2 * micro_batches if pp > 1 else 0  # an activation forward, its gradient back
    out["pp_bytes"] = pp_exchanges * seq * micro_batch * hidden / tp * ACT_BYTES  # each TP rank sends 1/t
    out["dp_bytes"] = 2 * (dp - 1) / dp * STATE_BYTES["grads"] * params
    # first and last stage all-reduce the tied embedding's gradient: 2 (n-1)/n = 1 for n = 2
    out["embedding_bytes"] = STATE_BYTES["grads"] * vocab * hidden / tp if pp > 1 else 0.0
    # seconds: bytes over the link plus a latency per collective or exchange; compute at the large-GEMM efficiency
    out["tp_s"] = out["tp_bytes"] / link["tp"] + tp_collectives * machine["collective_latency_us"] * 1e-6
    out["pp_s"] = out["pp_bytes"] / link["pp"] + pp_exchanges * machine["p2p_latency_us"] * 1e-6
    out["dp_s"] = out["dp_bytes"] / link["dp"] + out["embedding_bytes"] / link["pp"]
    # model FLOPs 72 B s L h^2 (1 + s/6h + V/12Lh) and the attention core selective recomputation redoes, 4 B s^2 h L
    # (the paper's count, QK^T and xV; checkpointing.py measures 2 B s^2 h L where only QK^T is redone)
    flops = (72 * global_batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))
             + 4 * global_batch * seq ** 2 * hidden * layers)
    out["compute_s"] = flops / (tp * pp * dp) / (machine["peak_tflops"] * 1e12 * machine["efficiency"])
    out["bubble"] = (pp - 1) / micro_batches  # of the busy time
    out["bubble_s"] = out["bubble"] * (out["compute_s"] + out["tp_s"] + out["pp_s"])
    out["step_s"] = out["compute_s"] + out["tp_s"] + out["pp_s"] + out["bubble_s"] + out["dp_s"]
    return out


def chapter_plans(model=EXAMPLE_MODEL, plans=CHAPTER_PLANS, gpus_per_node=8, machine=A100):
    """plan_figures of each plan, and the name of the faster one that fits."""
    figures = {name: plan_figures(**layout, **model, gpus_per_node=gpus_per_node, machine=machine)
               for name, layout in plans.items()}
    return figures, min((n for n in figures if figures[n]["fits"]), key=lambda n: figures[n]["step_s"])


def print_chapter_plans(model=EXAMPLE_MODEL, plans=CHAPTER_PLANS):
    figures, best = chapter_plans(model, plans)
    print(f"L={model['layers']} h={model['hidden']} a={model['heads']} s={model['seq']} V={model['vocab']} "
          f"B={model['global_batch']}, b=1, selective recomputation + SP, 1F1B, on 64 A100 (8 nodes x 8)")
    link = lambda plan, kind: " NVLink" if plan["inside_node"][kind] else " IB"  # noqa: E731
    rows = [("parameters per GPU, M", lambda plan: f"{plan['params'] / 1e6:.1f}"),
            ("weights+grads+Adam GB", lambda plan: f"{sum(plan[k + '_bytes'] for k in STATE_BYTES) / GB:.2f}"),
            ("activations GB", lambda plan: f"{plan['activations_bytes'] / GB:.2f}")]
    rows += [(f"{kind.upper()} GB per step, link", lambda plan, kind=kind: f"{plan[kind + '_bytes'] / GB:.2f}"
              + link(plan, kind)) for kind in ("tp", "dp", "pp")]
    rows += [("bubble (p-1)/m", lambda plan: f"{plan['bubble']:.4f}")]
    rows += [(f"{key[:-2]} s", lambda plan, key=key: f"{plan[key]:.3f}")
             for key in ("compute_s", "tp_s", "pp_s", "bubble_s", "dp_s", "step_s")]
    print(f"{'':24s}" + "".join(f"{name}: TP{p['tp']} PP{p['pp']} DP{p['dp']}".rjust(20) for name, p in plans.items()))
    for label, show in rows:
        print(f"{label:24s}" + "".join(show(figures[name]).rjust(20) for name in plans))
    a, b = figures["A"], figures["B"]
    print(f"answer: plan {best}. B sends {b['tp_bytes'] / a['tp_bytes']:.2f} of A's TP bytes "
          f"({a['tp_s'] - b['tp_s']:.2f} s less) and reduces its gradients on{link(b, 'dp')} "
          f"({a['dp_s'] - b['dp_s']:.3f} s less); it pays a bubble of {b['bubble']:.4f} against {a['bubble']:.4f} of "
          f"the busy time ({b['bubble_s'] - a['bubble_s']:.3f} s more), {b['pp_s'] - a['pp_s']:.3f} s more in "
          f"exchanges and {b['activations_bytes'] / a['activations_bytes']:.1f}x the activations, which fit in 80 GB.")


def chapter_demo():
    """The chapter in one read: the groups of a small layout, the rank maps of plans A and B, the two compared."""
    groups = rank_groups(16, tp=2, pp=2, cp=2, ep=2)
    print("rank_groups(16, tp=2, pp=2, cp=2, ep=2):")
    for kind in ("tp", "cp", "dp", "pp", "dp_cp", "embedding", "ep", "edp"):
        print(f"{kind:>11s}: " + " ".join(str(g) for g in groups[kind]))
    for name, layout in CHAPTER_PLANS.items():
        print(f"\nplan {name}: " + rank_map(8, 8, tp=layout["tp"], pp=layout["pp"]))
    print()
    print_chapter_plans()


# Run as a program, the chapter alone prints its demo; the whole file (a banner follows) runs `main` at its end.
if __name__ == "__main__" and not any(line.startswith("# BEYOND THE CHAPTER") for line in open(__file__)):
    chapter_demo()


# BEYOND THE CHAPTER: hybrid CP and HSDP groups; the planner (every layout and knob), calibration, CLI
"""The planner estimates, for every layout that divides the cluster and the model, the memory of the most loaded
GPU and the time of one training step, chooses the knobs a practitioner chooses besides (TP, PP, CP, and EP for a
MoE model) -- the recomputation (none, selective, full: the cheapest that fits), the micro-batch size b, the
pipeline schedule (1F1B, interleaved with v chunks per stage, zero bubble ZB-H1 with v >= 1, the V-shaped ZB-V
and DualPipeV with two chunks per GPU), sequence parallelism
(SP), the ZeRO level (0-3) and its shard size (HSDP), and CP's Ulysses size u (hybrid CP) -- ranks the layouts that
fit by step time, and says why the winner wins; `plan --command` prints the torchrun line that runs the top row
with train_gpt.py. It models Megatron-LM (GPT, 4h MLP, tied embeddings, unfused attention core, 16-bit), the
implementation Narayanan et al. 2021 measured. Notation: s b h a L V t p c d as usual, m = B / (d b) micro-batches
per pipeline, M = b s / c tokens per GPU, n = d c the gradient-reduction group, k the ZeRO shard size (n, or less
with HSDP), u the Ulysses size of CP (c = u r, r the ring's size).

Memory of the most loaded GPU (fits when <= 0.9 x GPU memory: CUDA context, allocator, buffers):
    parameters   ((12 h^2 + 13 h) L/p + V h) / t + s h            (embedding on stage 0, positions not split)
    states       2 + 2 + 16 bytes per parameter (16-bit weight, 16-bit gradient, fp32 master, Adam moments
                 and fp32 gradient copy: Megatron-LM's accounting; grad_bytes 4: 2 + 4 + 12); ZeRO (Rajbhandari
                 et al. 2020, FSDP) shards over k: ZeRO-1 the optimizer state, 4 + 16/k (6 + 12/k); ZeRO-2 the
                 gradients too, 2 + 18/k (2 + 16/k); ZeRO-3 the parameters too, 20/k (18/k); ZeRO-2 and 3 add
                 the full gradient of the unit (a layer, or the embedding) being reduce-scattered, ZeRO-3 the
                 16-bit parameters of two units (the one computing and the next one, prefetched)
    activations  per layer and micro-batch, Korthikanti et al. 2022; under CP the s of s b h is s/c and the
                 scores keep one s (5as/h: s/c queries against s keys; hybrid CP holds as many elements, s/r
                 tokens of 1/u of the heads):
                   SP      none s b h/t (34 + 5as/h)       selective 34 s b h/t        full 2 s b h/t
                   no SP   none s b h (10 + 24/t + 5as/(ht)) selective s b h (10 + 24/t) full 2 s b h
                 x L/p layers x the micro-batches in flight on stage 0: 1F1B p (GPipe would keep m),
                 interleaved p + (p-1)/v (Korthikanti section 4.2.3), never more than m; plus one layer in
                 full while it is recomputed, the embedding's dropout mask (s b h, / t with SP, per micro-batch
                 in flight), and with p = 1 the fp32 logits 4 s b V / t.
                 ZB-H1 keeps rank r's k_r chunks before their B as its base order does (1F1B k_r = p - r,
                 interleaved 2 (p - r - 1) + (v - 1) p + 1, at most v m) and d_r = min(k_r + r, v m) - k_r
                 chunks whose W is deferred (rank 0: none), each holding A_w: every linear's input and output
                 gradient, as train_gpt.py keeps them for W, per layer s b h (8 + 24/t) with multi-head
                 attention (`deferred_w_bytes`); rank r holds (k_r A + d_r A_w) / v + max(0, A_w - A)/v (right
                 after a B, before the next F) with A a stage's kept activations: the most loaded rank is stage
                 0 while A_w <= A, a later one under full recomputation (A = 2 s b h/t).
                 ZB-V and DualPipeV (v = 2, chunks of L/2p layers in a V: rank r holds stages r and 2p - 1 - r, so
                 rank 0 holds the first and the last stage: its parameters count both ends, the tied embedding
                 once, and its activations the logits): per chunk A/2 and A_w/2, the most of (k, 0), (2p - 1, 1)
                 right after a B, and the last rank's drain, (0, 2p - 1) for ZB-V, (0, p) for DualPipeV, with k =
                 2p (ZB-V) or 2p + 1 (DualPipeV: a pair's forward beside its backward); 2p embedding masks on rank
                 0 (`v_activation_points`).
                 offload, selective+offload (train_gpt.py's --recompute; tried with Cluster.offload, --offload): the
                 layers' saved tensors wait in host memory, K a layer (none's or selective's bytes above) copied
                 each way; the GPU keeps X = 2 s b h/t (no SP: 2 s b h) per model chunk and micro-batch in flight,
                 the chunk's input, and once 2 K (+ selective's core): the layer in its backward and the one
                 prefetched (`offload_bytes_per_layer`, the comment above it).

Time of one layer's forward for one micro-batch on one GPU (measured constants below):
    GEMMs        QKV (M, h, 3h/t), projection (M, h/t, h), MLP (M, h, 4h/t), (M, 4h/t, h):
                 2 M N K / (peak e(x)), e(x) = e_max x / (x + x0), x = min(M, N, K): every output tile pays
                 a fixed prologue/epilogue and small M or N leave SMs idle in the last wave (NVIDIA,
                 "Matrix Multiplication Background", tile and wave quantisation), so TP, which divides N or
                 K by t, makes the GEMMs less efficient
    attention    the s x s scores of a/t heads (n_s = b a s^2 / (t c)): max(4 (h/a) n_s / (peak e_max),
                 13 n_s / HBM): QK^T writes them, the fused softmax and the dropout read and write them,
                 AV reads them (memory-bound for head sizes h/a < 13 peak e_max / (4 HBM), over 400
                 with every preset below)
    elementwise  M h (22 / t_SP + 16 / t) / HBM bytes: 2 LayerNorms and 2 fused bias-dropout-adds (22,
                 split t ways only with SP), the fused bias-GeLU on 4h/t (16); plus 20 kernel launches
    TP           2 all-reduces (SP: all-gather + reduce-scatter, the same bytes) of M h 16-bit values:
                 2 (2 (t-1)/t M h e / B + latency), B the NVLink bus bandwidth (a TP group given across
                 nodes, k GPUs per node: k NICs' worth)
    CP ring      K and V shards (2 M h / t values) passed r-1 times; backward 2r-1 times (K, V and dK, dV);
                 each step also pays a collective latency and 3 kernel launches, and each later block
                 merges its partial output into the fp32 accumulator (12 bytes per output element)
    CP Ulysses   hybrid CP (USP, Fang and Zhao 2024; Megatron-Core's a2a+p2p): u > 1 consecutive CP ranks
                 trade sequence for heads first, 4 all-to-alls forward and 4 backward, together (u-1)/u
                 b s/(u r) (2 h + 2 h_kv)/t e per GPU (`hybrid_comm_bytes`, long_seq.py's formula), not
                 overlapped; the ring then runs over r = c/u ranks on s/r tokens of 1/u of the heads (as many
                 elements per step, r-1 steps). u divides c and the (KV) heads per TP rank; u = 1 is the ring,
                 u = c Ulysses; the search takes the u with the least CP seconds (nothing else depends on it)
    backward = 2 x the forward's work with the same TP collectives; full recomputation adds the forward,
    selective the attention core (offload: none's, selective+offload: selective's, and the step waits for the copies:
    per layer and micro-batch max(0, C - F) + max(0, C - B), C = K / B_pcie, F the layer's forward compute, B its
    backward's (zb-h1: less W), and per model chunk and micro-batch min(C, B) more: its top layer's copy back has
    nothing to hide behind, `offload_layer_seconds`); the output layer (last stage): 3 GEMMs (M, h, V/t) and a
    48-byte fp32 cross-entropy per logit; a stage = its L/p layers, the output layer (the last stage is the slowest)
    and 2v pipeline exchanges of M h / t values (scatter-gather: each TP rank sends 1/t, then without SP an
    all-gather over NVLink) plus p2p latency each. ZB-H1 splits each backward into B (input gradients, the
    attention core, the elementwise work, the communication, the recomputation) and W (one weight-gradient GEMM
    per forward GEMM, of its shape: W = the forward's GEMM time, the output layer's one of its three), so that
    W <= F and W <= B always, about half of the backward's work where GEMMs dominate.
Step time = m x stage (compute + TP + CP + offload wait + p2p) + bubble + gradient reduction + the tied embedding's
all-reduce between first and last stage + the optimizer step (48 bytes of HBM traffic per parameter updated, / k
with ZeRO).
    bubble       1F1B (p-1) stage, interleaved (p-1)/v stage (Narayanan et al. 2021); ZB-H1 (Qi et al. 2023)
                 per chunk (p-1)(F + B) - (min(m, p) - 1) W, i.e. (p-1)(F + B - W) for m >= p: (p-1)/v (stage -
                 2 W_stage), a third of 1F1B's when F = B = W (`pipeline_bubble`, exact for W <= min(F, B));
                 per chunk of a V, exact for W <= F <= B: ZB-V (p-1) max(B, 2 (B - W)), DualPipeV max((p-1)(2F + B
                 - W), (p-1)(F + 2B - W) - F), its pairs' overlap of communication with compute not counted (so
                 never below ZB-V's); neither all-reduces the tied embedding (one parameter on rank 0)
    DP           in (n-1)/n of the gradient bytes each (a ring; across nodes a group with k members per node
                 moves k NICs' worth, NCCL runs one ring per NIC): ZeRO-0 an all-reduce (2 per step), ZeRO-1
                 reduce-scatter + all-gather (2 per step), ZeRO-2 a reduce-scatter per micro-batch (its gradients
                 go to their owners as its backward makes them) + 1 all-gather, ZeRO-3 per micro-batch an
                 all-gather for the forward, one for the backward and the reduce-scatter (with m
                 micro-batches ZeRO-2/3 pay per micro-batch); the parameter all-gathers are counted at the
                 gradient's bytes, as ZeRO-1's always were (exact for 16-bit gradients, twice the 16-bit
                 parameters' bytes with fp32 main grads). HSDP (k < n): those over k consecutive ranks of the DP x
                 CP group (one node's, when the search chooses), and an all-reduce of the 1/k shard over the n/k
                 replicas once per step. Experts over the GPUs holding the same ones (no HSDP for them).
Each row also splits compute_s into gemm_s, attention_s, elementwise_s and output_layer_s. The pipeline part, m
(stage + 2v exchanges) + (p-1)/v stage with the output layer on the last stage, is checked in
tests/test_topology.py against a rank-by-rank replay of Megatron-LM 2021's 1F1B and interleaved schedules
(megatron/schedules.py of the SC'21 artifact: every exchange one blocking batch_isend_irecv, finished when the
neighbours have posted theirs): it overstates the replay by 0.2-0.6%, because the 2021 steady state sends both
directions in one exchange. The bubble and in-flight formulas of every schedule are checked against train_gpt.py's
replay of the very lists its executor runs (`pipeline_schedule`, `replay_pipeline`) over a grid of p, m, v.

What overlaps compute, as Megatron-LM does it: the CP ring's exchanges hide behind the attention core (only
the excess counts); the gradient reduction hides behind the last micro-batch's backward only with
`overlap_grad_reduce` (torch DDP, Megatron-Core's --overlap-grad-reduce; not Megatron-LM's 2021 "local"
DDP, which Table 1's pipelined runs used); with it ZeRO-2 and 3 hide each micro-batch's collectives behind that
micro-batch's backward (ZeRO-3's, with its forward all-gather, behind forward and backward: 1.5 x the backward),
the once-per-step ones behind the last backward. Not overlapped: TP collectives (each feeds the next GEMM;
Megatron-Core's --tp-comm-overlap is not modelled), pipeline exchanges (the 2021 schedule blocks on each
batch_isend_irecv and synchronises), Ulysses' all-to-alls, the embedding all-reduce, the optimizer step. The
interleaved schedule, and ZB-H1 with v > 1, needs m to be a multiple of p and p >= `interleave_min_pp`: 2 today, 3
in 2021 (Megatron-LM's arguments.py then asserted PP > 2; PP = 2 interleaving came with "Enable virtual pipelining
and P2P communication overlap at PP=2", 2023). The search tries the schedules and ZeRO levels the implementation
offers (`Cluster.schedules`, `Cluster.zero_levels`: all of them by default; CLUSTER_2021 1F1B and interleaved with
ZeRO off, MEGATRON_CORE_2025 1F1B and interleaved with ZeRO-0/1), HSDP over every DP x CP rank or one node's, every
Ulysses size; a fixed knob is taken as given. ZeRO-0 is left out where ZeRO-1 can run (the same bytes, more memory, a
slower optimizer step).

Constants (flags of `plan`; presets `--gpu a100|h100|h200`). A100 80 GB: peak 312 TFLOP/s (datasheet), HBM 1730
GB/s achieved (85% of 2039), NVLink all-reduce bus bandwidth 230 GB/s (nccl-tests, DGX A100, of 300), InfiniBand
23 GB/s per GPU (HDR 25), 4 us per kernel launch, 10 us per collective, 50 us per pipeline exchange, x0 = 128
(one tile edge of the A100 GEMM kernels) and e_max = 0.71, chosen once: with x0 fixed, the e_max in 0.60..0.90
(steps of 0.01) that minimises the largest error over the ten rows of Narayanan et al. 2021, Table 1
(`fit_efficiency` repeats the choice; `python topology.py calibrate`); worst error -5.3% (the 1T run), all rows
within 5.3%. H100 / H200: peak 989, HBM 2850 / 4080 (85% of 3350 / 4800), NVLink 360 (of 450), NDR 45 GB/s (of
50), memory 80 / 141 GB; e_max and x0 carried over from A100, not calibrated (no published table with its
configurations). PCIe host link per GPU and direction (activation offloading): 25 GB/s on A100, 50 on H100 / H200
(about 78% of Gen4 x16's 32, Gen5 x16's 64: a typical pinned-copy figure, assumed, not measured here).

Against Table 1 (`python topology.py calibrate`): every published run fits in 80 GB (full recomputation, at most
62 GB); the predicted TFLOP/s per GPU are within 5.3% of the measured ones on all ten rows. With the authors'
software (full recomputation, no SP, ZeRO or CP, interleaving from PP = 3; the planner picks b and v), the
published (TP, PP) is the planner's top choice in 7 rows and within 5% of its step time in 8 (worst: 145.6B,
+3.7%). Not for 18.4B and 39.1B: keeping t p, the planner trades TP for PP, TP2 PP4 (b 2, v 5) 8.05 s against the
published TP8 PP1's 9.17 s (+13.8%) and TP2 PP8 (b 2, v 6) 12.55 s against TP8 PP2's 14.39 s (+14.7%). Term by
term (calibrate prints them) TP8 pays 1.26 / 1.54 s more in exposed TP all-reduces and 0.59 / 0.88 s more in the
LayerNorm, dropout and residual work every TP rank repeats without SP; the deeper pipelines pay back only 0.85 /
0.66 s (p2p, bubble, their logits beside fewer layers, DP). These terms are checked: the pipeline ones against
the replay of the 2021 schedules, TP at t = 1, 2, 4, 8 by rows 1-4 (errors +2.2..+2.9%). To come within 5% the
pipelines' costs would have to double, and no cost of the 2021 implementation examined does that while Table 1
stays within 6%: `python topology.py calibrate --scan` refits e_max for each variant (pipeline exchanges at 15 or
4 GB/s, 1 or 4 ms per exchange, both extremes at once, TP all-reduces at 600 GB/s) and prints the worst error and
the two rows' gaps; the 4 GB/s exchanges, for one, leave +7.1% / +9.6% with the worst error already 5.5%, and 600
GB/s brings 18.4B in but not 39.1B, with the 1T row 8.2% off. So the disagreement is the model's prediction, not
a missing term: at 18-39B without SP, TP8 repeats the LayerNorms 8 times and exposes its all-reduces, which the
paper's rule (TP up to a node, then PP) accepts; sequence parallelism (2022) removes the former, and with every
knob the planner keeps TP2 with SP there. With every knob (ZeRO-1 and SP let smaller TP fit, zero bubble shrinks
the bubble) it moves further from the 2021 layouts: zero bubble on every pipelined top choice but the 1T row's
(interleaved, v = 8), ZB-V's two chunks in a V at 18.4B (now PP 2), 39.1B and 310.1B, ZB-H1 on the others, ZeRO-1
throughout (without the overlapped reduction ZeRO-2/3 pay their per-micro-batch collectives in full).

TFLOP/s per GPU are counted as Narayanan et al. count them, 96 B s L h^2 (1 + s/6h + V/16Lh) per step
(every layer 4 x its forward, as with full recomputation), divided by step time and GPUs, whatever the plan
recomputes: a throughput in Table 1's units. `mfu` uses the model FLOPs, 72 B s L h^2 (1 + s/6h + V/12Lh);
`hfu` the hardware FLOPs, the model FLOPs plus what the plan recomputes (Korthikanti et al. 2022: full
recomputation adds 24 B s L h^2 (1 + s/6h), selective the attention core's 4 B s^2 h L).

MoE (ModelShape with train_gpt.py's names: every `moe_every`-th layer's MLP is E = `experts` expert MLPs of hidden
f = `expert_hidden`, k = `top_k` per token, a router of E h weights, optionally a shared expert of hidden f_s that
every token passes; train_gpt.py's block is moe_ep.MoE(h, 4h, E, k): f = 4h, GeLU, f_s = 0, no expert or router
biases). With n = 2 matrices per expert MLP (3 with SwiGLU) and h_kv the K/V width (h; less with GQA):
    parameters   a dense layer 12 h^2 + 13 h; a MoE layer 2 h^2 + 2 h h_kv + (h + 2 h_kv) + h + 4 h (attention, its
                 biases, LayerNorms) + E h + n h f_s + E n h f; + V h (twice untied) + s h. Active per token: k of
                 the E experts
    FLOPs        6 N + 12 L h s per token (train_gpt.py's model_flops_per_token), N = V h + per layer 2 h^2 + 2 h h_kv
                 and 8 h^2 (dense) or E h + k n h f + k h + n h f_s (MoE: router, k experts, the weighted sum of
                 their outputs, the shared expert)
    layout       experts whole (expert TP 1), sharded over EP and replicated over EDP: the expert grid tp-ep-edp-pp,
                 ep x edp = cp x dp, EP at stride tp (Cluster.expert_folding "dp_cp": topology.rank_groups and
                 train_gpt.py, whose TP ranks each hold the EP shard's experts and split the MoE tokens), or
                 Megatron-Core's MoE parallel folding (Liu et al. 2025; "tp_dp_cp"): ep x edp = tp x cp x dp, EP
                 fastest. A MoE layer sees T = b s / (t c) tokens per GPU (SP: Megatron-Core requires it with MoE
                 and TP), R = T k F copies of which reach this GPU's E/ep experts
    load factor  F: the busiest EP rank's copies over the uniform T k; `imbalance` (>= 1, stated: 1 for balanced
                 routing; load_imbalance(copies per EP rank) of a measured routing), capped by `capacity_factor`
                 when tokens are dropped, 1 without EP (one GPU holds every expert)
    memory       E/ep experts per MoE layer, their optimizer states sharded by ZeRO-1 over EDP (cp dp/ep; tp cp dp/ep
                 folded), the dense ones over dp cp; kept per MoE layer and micro-batch (15 + 5 a s/h) s b h/t
                 (attention and LayerNorms as Korthikanti; the scores not with selective or flash) + 2 T h + 4 T E +
                 T h + 4 R h + 2 (g + 1)(R f + T f_s) (router input and fp32 probabilities, dropout mask, each copy's
                 expert input and output, the expert activations; g = 2 with SwiGLU, 1 with GeLU); full: 2 s b h/t
    all-to-all   per MoE layer and micro-batch: dispatch and combine forward, both again backward (the forward pair
                 again under full recomputation), each sending T k h e (P - 1)/P x F bytes from the busiest GPU
                 (a copy stays home with probability 1/P; F times that returns from the busiest rank
                 in the combine and the dispatch's backward), `moe_a2a_bytes`. With g of the P members on this GPU's
                 node, (g - 1)/(P - 1) of the bytes go over NVLink and (P - g)/(P - 1) over this GPU's own NIC, at once:
                 max(inside / NVLink, across / IB) + a latency (`a2a_seconds`); the counts exchange adds a latency.
                 Not overlapped (Megatron-Core's alltoall dispatcher of 2025); a shared expert's overlap is not
                 modelled
    time         the router (T, h, E); each local expert's GEMMs (r, h, g f) and (r, f, h) on its r = R/(E/ep)
                 rows, x = min(r, h, f): many experts at a small load run below e_max; the shared expert
                 as a TP-split MLP; PERMUTE_BYTES = 8 per element of T k h (permutation, un-permutation and weighted
                 sum) and EXPERT_ACT_BYTES 4 (GeLU) or 6 (SwiGLU) per element of R f through HBM, 6 more kernels;
                 one TP pair (the attention's) instead of two, two with a shared expert; gradients of the dense weights
                 over dp cp, of the experts over the tp cp dp/ep GPUs holding the same ones. The slowest stage is the
                 last (the output layer), or one with more MoE layers when that one is slower.
Implementation switches besides the presets (Cluster): `flash_attention` (Megatron-Core, Transformer Engine: the
attention core is the causal half of 4 (h/a) FLOPs per score at e_max, 2.5x that in backward, no scores kept),
`grad_bytes` 4 (fp32 main grads: 2 + 4 + 12 bytes per parameter, 6 + 12/n with ZeRO-1, 4-byte gradient reduction),
`expert_folding`. The search tries every EP that divides E and the folding's ranks.

Against published MoE runs (`python topology.py calibrate`, after Table 1). Liu et al. 2025, "MoE Parallel Folding"
(arXiv 2504.14960), report 49.3% MFU for Mixtral 8x22B on 128 H100 and 39.0% for Qwen2-57B-A14B on 64, in
Megatron-Core's FLOP count (`megatron_flops_per_token`: without the router and the weighted sum, 0.01% and 0.05% less
than ours). Their layouts are the authors' benchmark configurations of April 2025 (github.com/yanring/Megatron-MoE-
ModelZoo: runtime.conf, model_configs/benchmarking): Mixtral 8x22B (56 layers, h 6144, 48 heads, 8 KV
groups, 8 SwiGLU experts of 16384, top-2, V 32000) TP2 PP8 EP8 (expert TP 1) DP8, v 1; Qwen2-57B-A14B (28 layers, h
3584, 28 heads, 4 KV groups, 64 experts of 2560, top-8, a shared expert of 20480, V 151936) TP2 PP4 EP4 DP8, v 7; both
sequence 4096, global batch 256, micro-batch 1, untied embeddings, no recomputation, SP, distributed optimizer,
overlapped gradient reduction, flash attention, bf16 (MEGATRON_CORE_2025, MOE_RUN_KNOBS); load factor 1 (balanced:
the benchmark mode drops tokens at capacity factor 1, so no expert exceeds its share). With the H100 preset
unchanged (e_max and x0 carried over from Table 1, nothing fitted to these rows) the published layouts are predicted
at 46.0% (-6.7%) and 39.8% (+2.1%) MFU, worst error -6.7%, and fit (69.6 and 63.5 GB of 72): counted conservatively
(positions as learned, 25 M parameters; dropout masks although the runs had no dropout; K and V at full width in
Korthikanti's 11 s b h). The planner's own top choice with the same software (1F1B or interleaved, ZeRO-0/1, ring,
Ulysses or hybrid CP): Mixtral TP1 PP8 CP4 EP8 v7 with CP as Ulysses over 4 (the published layout +4.8% slower),
Qwen2 TP2 PP2 EP8 DP16 v7 (+4.7%). With every schedule and ZeRO level the planner knows, which those runs did not use:
Mixtral the published layout under ZB-H1 (+10.4%: its 1F1B bubble, 0.78 s, halves), Qwen2 TP1 PP1 EP1 DP64 under
ZeRO-3 with full recomputation (+14.4%; its per-micro-batch gathers hidden behind the overlapped compute).
The authors' later Mixtral layout (July 2025, v 7) is predicted at +3.1% but does not fit under that count (74.7 GB).
DeepSeek-V3 (technical report, arXiv 2412.19437: 2,048 H800, PP16 with DualPipe, EP64 over 8 nodes, ZeRO-1, 180K H800
GPU hours per trillion tokens, i.e. 1,543 tokens/s per GPU) is not in the table: its MLA attention, FP8 GEMMs,
DualPipe's overlapped all-to-alls and node-limited routing are outside this cost model.

`python topology.py` prints the chapter (the groups, the rank maps of plans A and B, the closed form); `python
topology.py --nodes 8 --gpus-per-node 8 --tp 8 --pp 4` draws a rank map (`--help`); `python topology.py plan ...`
plans (`--moe-every --experts --top-k --ep ...` for MoE; `--pp-schedule --zero --zero-shard-size --cp-ulysses` fix
the new knobs; `--offload` lets it try activation offloading, `--pcie-gbps` its bus; `--command` prints the torchrun
line of the top row); `python topology.py calibrate` prints Table 1 and the MoE runs beside the planner; `python
topology.py example` prints the chapter's closed form, then the planner's rows for the two 64-GPU plans on two model
shapes, then EP inside a node against EP across nodes.
"""
import argparse
import json
import shlex
import sys
from dataclasses import replace
from typing import NamedTuple


# ----------------------------------------------------------------------------------------------------
# Hybrid CP and hybrid sharding (HSDP): each CP group and each dp_cp group split in two
# ----------------------------------------------------------------------------------------------------
# Each CP group splits for hybrid attention (long_seq.hybrid_attention, train_gpt.py's --cp-impl hybrid) into
# cp_ulysses x cp_ring, the CP rank being `ulysses_rank + cp_ulysses * ring_rank` (Megatron-LM's hierarchical CP:
# the inner size takes consecutive CP ranks): a `cp_ulysses` group is TP x cp_ulysses consecutive ranks in all
# (inside a node when that fits one), and a `cp_ring` group strides by TP x cp_ulysses. Hybrid sharded data
# parallelism (HSDP, train_gpt.py's --zero-shard-size, `zero_shard` = k, default all of DP x CP) splits each dp_cp
# group into `dp_cp_shard` groups of k consecutive DP x CP ranks (the weights sharded over them: one node, say) and
# `dp_cp_replicate` groups of the ranks at the same place in every shard group (the shards replicated across).
# Without them (cp_ulysses 1, no zero_shard) cp_ulysses and dp_cp_replicate are single ranks, cp_ring is cp and
# dp_cp_shard is dp_cp. Each function here is the core's of the same name with the four kinds added.

SPLIT_KINDS = ("cp_ulysses", "cp_ring", "dp_cp_shard", "dp_cp_replicate")
HYBRID_GROUP_KINDS = GROUP_KINDS + SPLIT_KINDS


def validate_hybrid_layout(world_size, tp=1, pp=1, cp=1, ep=1, cp_ulysses=1, zero_shard=None):
    """`validate_layout` and the two splits' sizes; returns dp."""
    _check_positive(cp_ulysses=cp_ulysses)
    if _is_positive_int(cp) and cp % cp_ulysses:
        raise ValueError(f"cp_ulysses={cp_ulysses} must divide cp={cp} (the hybrid's CP = Ulysses size x ring "
                         f"size); valid cp_ulysses values: {_divisors(cp)}")
    dp = validate_layout(world_size, tp, pp, cp, ep)
    if zero_shard is not None and not (_is_positive_int(zero_shard) and (cp * dp) % zero_shard == 0):
        raise ValueError(f"zero_shard={zero_shard!r} must divide cp*dp={cp * dp} (hybrid sharding shards over "
                         f"groups of that many DP x CP ranks); valid values: {_divisors(cp * dp)}")
    return dp


def hybrid_rank_groups(world_size, tp=1, pp=1, cp=1, ep=1, cp_ulysses=1, zero_shard=None):
    """`rank_groups` and the four split kinds (HYBRID_GROUP_KINDS)."""
    dp = validate_hybrid_layout(world_size, tp, pp, cp, ep, cp_ulysses, zero_shard)
    groups = rank_groups(world_size, tp, pp, cp, ep)
    hybrid_shape = (tp, cp_ulysses, cp // cp_ulysses, dp, pp)  # the cp digit split, ulysses fastest
    hybrid_names = ("tp", "cp_ulysses", "cp_ring", "dp", "pp")
    for kind in ("cp_ulysses", "cp_ring"):
        groups[kind] = groups_along(hybrid_shape, hybrid_names, [kind])
    k = zero_shard or cp * dp
    shard_shape, shard_names = (tp, k, cp * dp // k, pp), ("tp", "dp_cp_shard", "dp_cp_replicate", "pp")
    for kind in ("dp_cp_shard", "dp_cp_replicate"):
        groups[kind] = groups_along(shard_shape, shard_names, [kind])
    return groups


def hybrid_rank_coordinates(rank, world_size, tp=1, pp=1, cp=1, ep=1, cp_ulysses=1, zero_shard=None):
    """`rank_coordinates` and the rank's place in its four split groups."""
    dp = validate_hybrid_layout(world_size, tp, pp, cp, ep, cp_ulysses, zero_shard)
    coords = rank_coordinates(rank, world_size, tp, pp, cp, ep)
    coords["cp_ulysses"], coords["cp_ring"] = coords["cp"] % cp_ulysses, coords["cp"] // cp_ulysses
    middle, k = coords["cp"] + cp * coords["dp"], zero_shard or cp * dp
    coords["dp_cp_shard"], coords["dp_cp_replicate"] = middle % k, middle // k
    return coords


class HybridParallelState(ParallelState):
    """A ParallelState whose sizes, coords, groups, ranks and intra_node also hold the four split kinds."""
    cp_ulysses_rank = property(lambda self: self.coords["cp_ulysses"])
    cp_ring_rank = property(lambda self: self.coords["cp_ring"])


def hybrid_parallel_state(rank, world_size, tp=1, pp=1, cp=1, ep=1, gpus_per_node=None, groups=None, cp_ulysses=1,
                          zero_shard=None):
    """`parallel_state` with the four split kinds: a HybridParallelState."""
    layout = hybrid_rank_groups(world_size, tp, pp, cp, ep, cp_ulysses, zero_shard)  # raises before anything else
    state = parallel_state(rank, world_size, tp, pp, cp, ep, gpus_per_node)
    k = zero_shard or state.sizes["dp_cp"]
    split = {kind: layout[kind] for kind in SPLIT_KINDS}
    return HybridParallelState(**{
        **vars(state), "groups": dict(groups or dict.fromkeys(HYBRID_GROUP_KINDS)),
        "sizes": {**state.sizes, "cp_ulysses": cp_ulysses, "cp_ring": cp // cp_ulysses, "dp_cp_shard": k,
                  "dp_cp_replicate": state.sizes["dp_cp"] // k},
        "coords": hybrid_rank_coordinates(rank, world_size, tp, pp, cp, ep, cp_ulysses, zero_shard),
        "ranks": {**state.ranks, **{kind: next((list(g) for g in gs if rank in g), []) for kind, gs in split.items()}},
        "intra_node": {**state.intra_node, **group_locality(split, gpus_per_node or world_size)}})


def init_hybrid_parallel(tp=1, pp=1, cp=1, ep=1, gpus_per_node=None, with_mesh=True, cp_ulysses=1, timeout_s=None,
                         zero_shard=None):
    """`init_parallel` (Megatron-LM's initialize_model_parallel), then the four split kinds' groups; returns this
    rank's HybridParallelState. The layout is checked before any group is created."""
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    layout = hybrid_rank_groups(world_size, tp, pp, cp, ep, cp_ulysses, zero_shard)  # raises before any group
    state = init_parallel(tp, pp, cp, ep, gpus_per_node, with_mesh, timeout_s)
    # every rank creates every group in the same order, as init_parallel does; a rank list that already is a group
    # of the core (cp_ring when cp_ulysses is 1, dp_cp_shard without HSDP, ...) reuses that group's handle
    made = {tuple(g) for gs in rank_groups(state.world_size, tp, pp, cp, ep).values() for g in gs}
    handles = {tuple(state.ranks[kind]): state.groups[kind] for kind in GROUP_KINDS if state.ranks[kind]}
    mine = {}
    for kind in SPLIT_KINDS:
        for ranks in layout[kind]:
            key = tuple(ranks)
            if key not in made:
                made.add(key)
                handles[key] = dist.new_group(ranks, timeout=_timeout(timeout_s))
            if state.rank in ranks:
                mine[kind] = handles[key]
    gpus_per_node = gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", state.world_size))  # as init_parallel
    hybrid = hybrid_parallel_state(state.rank, state.world_size, tp, pp, cp, ep, gpus_per_node,
                                   {**state.groups, **mine}, cp_ulysses, zero_shard)
    hybrid.mesh = state.mesh
    return hybrid


def hybrid_rank_map(nodes, gpus_per_node, tp=1, pp=1, cp=1, ep=1, cp_ulysses=1):
    """`rank_map`, with the hybrid's cp_ulysses and cp_ring kinds where cp_ulysses > 1 (else they are single ranks
    and cp itself); no HSDP groups."""
    _check_count("nodes", nodes, "the number of nodes to draw")
    _check_count("gpus_per_node", gpus_per_node, "the GPUs of one node")
    world = nodes * gpus_per_node
    groups = hybrid_rank_groups(world, tp, pp, cp, ep, cp_ulysses)
    dp = world // (tp * pp * cp)
    hybrid = f", cp {cp} = ulysses {cp_ulysses} x ring {cp // cp_ulysses}" if cp_ulysses > 1 else ""
    header = f"world={world} = tp {tp} x cp {cp} x dp {dp} x pp {pp}   (ep {ep}, edp {cp * dp // ep}{hybrid})"
    shown = GROUP_KINDS + (("cp_ulysses", "cp_ring") if cp_ulysses > 1 else ())
    coords = [hybrid_rank_coordinates(r, world, tp, pp, cp, ep, cp_ulysses) for r in range(world)]
    return draw_rank_map(header, nodes, gpus_per_node, coords, {kind: groups[kind] for kind in shown})


# ----------------------------------------------------------------------------------------------------
# The planner: memory and step time of Megatron-LM training, from published formulas and measured constants
# ----------------------------------------------------------------------------------------------------

GRAD_BYTES = 4              # FP32 main grads, as train_gpt.py keeps them (Table 1's fp16 buffers: 2, CLUSTER_2021)
# 16-bit gradients (grad_bytes 2): the ZeRO paper's (Rajbhandari et al. 2020) 16 bytes of optimizer state leave out
# the fp32 gradient copy; a distributed optimizer (ZeRO-1) shards the 16 over DP x CP
# HBM traffic of the kernels that are not GEMMs, counted from Megatron-LM's fused kernels, in bytes per element:
LAYERNORM_DROPOUT_BYTES = 22  # per element of b s h, one layer forward: 2 LayerNorms (read + write, 4 each) and
#                               2 fused bias-dropout-adds (read 2 tensors, write 1, a 1-byte mask: 7 each);
#                               replicated over TP without sequence parallelism, split t ways with it
GELU_BYTES = 16               # per element of b s h: fused bias-GeLU reads and writes the 4h/t MLP activation
SCORE_BYTES = 13              # per attention score: QK^T writes it (2), fused softmax reads and writes (4),
#                               dropout reads, writes and keeps a 1-byte mask (5), AV reads it (2)
RING_MERGE_BYTES = 12        # per element of the attention output (b s h / (t cp)), per CP ring step: read the
#                               16-bit partial output (2), read and write the fp32 accumulator (8), the
#                               log-sum-exp rescaling (2)
LOSS_BYTES = 48               # per logit: the fp32 vocab-parallel cross-entropy, forward (30) and backward (18)
OPTIMIZER_STEP_BYTES = 48     # per parameter updated: grad to fp32 (6), unscale and check (8), norm (4),
#                               Adam (read p g m v, write p m v: 28), master back to 16 bits (6)
KERNELS_PER_LAYER = 20        # kernels in one layer's forward (4 GEMMs, 2 batched GEMMs, 2 LayerNorms, softmax,
#                               dropout, GeLU, 2 bias-dropout-adds, 2 TP collectives, copies); backward twice that
# MoE layers (the MoE prose above): HBM traffic of the token permutation and of the experts'
# activation function, and the extra kernels of the dispatch
PERMUTE_BYTES = 8             # per element of the T k h token copies, forward: the permutation before the
#                               dispatch (read and write 16 bits: 4), the un-permutation and weighted sum after the
#                               combine (4)
EXPERT_ACT_BYTES = {False: 4, True: 6}  # per element of the R x f expert activation: GeLU reads and writes (2 + 2);
#                               SwiGLU reads the two halves and writes their product (2 + 2 + 2)
MOE_EXTRA_KERNELS = 6         # router GEMM, softmax and top-k, histogram, counts all-to-all, permutation and its
#                               inverse (a MoE layer's forward: KERNELS_PER_LAYER + these)
MAX_MICRO_BATCH = 16          # the search tries micro-batch sizes up to this (Table 1 uses 1 to 16)
MAX_VIRTUAL_STAGES = 8        # and interleaved schedules of up to this many model chunks per GPU
SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")  # train_gpt.py's --pp-schedule: 1F1B, Megatron-LM's
#                               interleaved 1F1B, zero bubble ZB-H1 (Qi et al. 2023; on 1F1B's order, or on the
#                               interleaved one, v > 1), and the V-shaped ZB-V (Qi et al. 2023) and DualPipeV
V_SCHEDULES = ("zbv", "dualpipev")  # two chunks per GPU in a V: rank r holds stages r and 2p - 1 - r (v = 2)
SPLIT_SCHEDULES = ("zb-h1",) + V_SCHEDULES  # backwards split into B (input gradients) and a deferrable W
ZERO_LEVELS = (0, 1, 2, 3)    # train_gpt.py's --zero: replicated, sharded optimizer, + gradients, + parameters

# Per GPU: datasheet peak, achieved bandwidths, the GEMM efficiency curve (e_max = `efficiency`, x0 =
# `gemm_half_dim`), fixed costs per kernel launch, TP collective and pipeline exchange. Sources and how e_max
# was chosen: the prose under the banner. H100 and H200 carry the A100's e_max and x0 over (not calibrated). The A100's
# are the chapter's (A100) and its HBM bandwidth, GEMM tile edge and launch cost.
GPU_PRESETS = {
    "a100": dict(A100, hbm_gbps=1730, gemm_half_dim=128, launch_us=4, pcie_gbps=25),
    "h100": dict(gpu_mem_gb=80, peak_tflops=989, hbm_gbps=2850, nvlink_gbps=360, ib_gbps=45,
                 efficiency=0.71, gemm_half_dim=128, launch_us=4, collective_latency_us=10, p2p_latency_us=50,
                 pcie_gbps=50),
    "h200": dict(gpu_mem_gb=141, peak_tflops=989, hbm_gbps=4080, nvlink_gbps=360, ib_gbps=45,
                 efficiency=0.71, gemm_half_dim=128, launch_us=4, collective_latency_us=10, p2p_latency_us=50,
                 pcie_gbps=50),
}
_A100 = GPU_PRESETS["a100"]
DEFAULT_GPU_MEM_GB = _A100["gpu_mem_gb"]


@dataclass
class Cluster:
    """The machine and the program. Defaults: DGX A100 80 GB nodes on HDR InfiniBand running train_gpt.py (FP32 main
    grads, 18 bytes a parameter under BF16 with Adam; fused attention; no dropout); CLUSTER_2021 describes Megatron-LM
    as in Table 1 (16-bit gradients, the unfused attention, dropout); `Cluster.for_gpu("h100", gpus)` takes another
    preset."""
    gpus: int
    gpus_per_node: int = 8
    gpu_mem_gb: float = _A100["gpu_mem_gb"]
    nvlink_gbps: float = _A100["nvlink_gbps"]
    ib_gbps: float = _A100["ib_gbps"]
    peak_tflops: float = _A100["peak_tflops"]
    efficiency: float = _A100["efficiency"]
    gemm_half_dim: float = _A100["gemm_half_dim"]
    hbm_gbps: float = _A100["hbm_gbps"]
    launch_us: float = _A100["launch_us"]
    collective_latency_us: float = _A100["collective_latency_us"]
    p2p_latency_us: float = _A100["p2p_latency_us"]
    # a pipeline exchange's bandwidth per GPU; None: its link's (NVLink inside a node, InfiniBand across). NCCL's
    # send/recv can reach less than its collectives; `calibrate --scan` tries lower values
    p2p_gbps: float = None
    # the gradient reduction overlaps the backward of the last micro-batch (True: torch DDP, Megatron-Core's
    # --overlap-grad-reduce) or runs after it (False: Megatron-LM's 2021 "local" DDP); "without_pp": overlapped
    # only when PP = 1, as in 2021, when Megatron-LM could use torch DDP only without a pipeline (Table 1)
    overlap_grad_reduce: object = False
    # the smallest pipeline the interleaved schedule accepts: 2 in Megatron-LM since 2023 ("Enable virtual pipelining
    # and P2P communication overlap at PP=2"); 3 in 2021, whose arguments.py asserts "pipeline-model-parallel size
    # should be greater than 2 with interleaved schedule" (Table 1's 39.1B run, PP = 2, could not interleave)
    interleave_min_pp: int = 2
    # the attention core: unfused (False: Megatron-LM 2021, the s x s scores through HBM) or a flash kernel (True:
    # Megatron-Core with --use-flash-attn / Transformer Engine, train_gpt.py's SDPA: no scores stored, compute-bound,
    # 2.5x in backward)
    flash_attention: bool = True
    # bytes per gradient element, held and reduced: 2 (Megatron-LM 2021's fp16 gradient buffers; the distributed
    # optimizer then keeps an fp32 copy in its shard) or 4 (Megatron-Core's and train_gpt.py's fp32 main grads)
    grad_bytes: int = GRAD_BYTES
    # dropout after the attention and MLP projections and the embedding (Megatron-LM 2021): its 1-byte masks are kept
    # for the backward (train_gpt.py has none)
    dropout: bool = False
    # which ranks an EP group is drawn from (the MoE prose above): "dp_cp", the dp x cp ranks of one
    # (tp, pp) position, as topology.rank_groups builds them and train_gpt.py runs them; or "tp_dp_cp", Megatron-
    # Core's MoE parallel folding with expert TP 1 (Liu et al. 2025): all tp x cp x dp ranks of a stage, EP fastest
    expert_folding: str = "dp_cp"
    # the pipeline schedules and ZeRO levels the implementation offers, which the search tries where the knob is free
    # (a knob fixed in the ModelShape is taken as given): Megatron-LM 2021 had 1F1B and the interleaved schedule
    # (CLUSTER_2021), Megatron-Core's MoE runs of 2025 those and its distributed optimizer, ZeRO-1 (MEGATRON_CORE_2025)
    schedules: tuple = SCHEDULES
    zero_levels: tuple = ZERO_LEVELS
    # activation offloading (train_gpt.py's --recompute offload and selective+offload): True lets the search try both
    # (a recompute knob fixed to one is taken either way); each GPU copies over its own host link at `pcie_gbps` GB/s
    # per direction (the presets: about 78% of PCIe Gen4 x16's 32 GB/s on A100, of Gen5 x16's 64 on H100 / H200, a
    # typical pinned-copy figure, assumed, not measured here)
    offload: bool = False
    pcie_gbps: float = _A100["pcie_gbps"]

    def __post_init__(self):
        # `not value > 0` rather than `value <= 0`: NaN fails it too; and no rate is infinite
        for name in ("gpus", "gpus_per_node", "gpu_mem_gb", "nvlink_gbps", "ib_gbps", "peak_tflops", "efficiency",
                     "hbm_gbps", "p2p_gbps", "pcie_gbps"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value!r} must be > 0 ({_flag(name)})")
            if value is not None and not math.isfinite(value):
                raise ValueError(f"{name}={value!r} must be finite ({_flag(name)})")
        # 0: a cost left out on purpose (gemm_half_dim 0: GEMMs at e_max whatever their size)
        for name in ("gemm_half_dim", "launch_us", "collective_latency_us", "p2p_latency_us"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"{name}={value!r} must be >= 0 ({_flag(name)})")
        if not self.efficiency <= 1:  # a fraction of the datasheet peak: above 1, GEMMs would beat the hardware
            raise ValueError(f"efficiency={self.efficiency!r} must be in (0, 1] ({_flag('efficiency')})")
        _check_count("interleave_min_pp", self.interleave_min_pp, "2 today, 3 for Megatron-LM 2021")
        if self.grad_bytes not in (2, 4):
            raise ValueError(f"grad_bytes={self.grad_bytes!r} must be 2 (16-bit gradients) or 4 (fp32 main grads)")
        if self.expert_folding not in EXPERT_FOLDINGS:
            raise ValueError(f"expert_folding={self.expert_folding!r}; choose one of {', '.join(EXPERT_FOLDINGS)}")
        unknown = [x for x in self.schedules if x not in SCHEDULES]
        if unknown or "1f1b" not in self.schedules:
            raise ValueError(f"schedules={self.schedules!r} must hold '1f1b' and only {', '.join(SCHEDULES)}")
        if 0 not in self.zero_levels or any(z not in ZERO_LEVELS for z in self.zero_levels):
            raise ValueError(f"zero_levels={self.zero_levels!r} must hold 0 and only levels of {ZERO_LEVELS}")
        if not isinstance(self.offload, bool):
            raise ValueError(f"offload={self.offload!r} must be True or False (--offload)")

    @classmethod
    def for_gpu(cls, gpu, gpus, **overrides):
        if gpu not in GPU_PRESETS:
            raise ValueError(f"gpu={gpu!r} is unknown; choose one of {sorted(GPU_PRESETS)} or pass every constant")
        return cls(gpus=gpus, **{**GPU_PRESETS[gpu], **overrides})


RECOMPUTE_POLICIES = ("none", "selective", "full")  # cheapest first
# activation offloading, train_gpt.py's --recompute spellings: the policy -> the recomputation it runs underneath
OFFLOAD_POLICIES = {"offload": "none", "selective+offload": "selective"}
RECOMPUTE_KNOBS = RECOMPUTE_POLICIES + tuple(OFFLOAD_POLICIES)  # every value of the recompute knob
# the search's order with Cluster.offload, and what a policy that fits with the fastest ZeRO choice rules out: the
# policies never faster than it (each adds time to it: recomputation, or an exposed copy); offload against selective
# or full depends on the bus, so each is tried
SEARCH_ORDER_WITH_OFFLOAD = ("none", "offload", "selective", "selective+offload", "full")
NEVER_FASTER_THAN = {"none": RECOMPUTE_KNOBS[1:], "selective": ("selective+offload", "full")}
EXPERT_FOLDINGS = ("dp_cp", "tp_dp_cp")


@dataclass
class ModelShape:
    """A GPT (4h MLP, learned positions, tied embeddings) and a global batch. The knobs `micro_batch`,
    `recompute`, `sequence_parallel`, `zero` (the ZeRO level 0-3; True and False mean 1 and 0), `virtual_stages`,
    `pp_schedule` (SCHEDULES), `zero_shard_size` (HSDP: shard over k of the DP x CP ranks, replicate over the rest;
    None: shard over all of them) and `cp_ulysses` (the Ulysses size u of hybrid CP: 1 ring, cp Ulysses) are fixed
    when given and chosen by the planner when None. A `virtual_stages` given without a `pp_schedule` keeps its
    first meaning: 1F1B for 1, the interleaved schedule above.

    MoE, with train_gpt.py's names: every `moe_every`-th layer (layer i when (i + 1) % moe_every == 0; 0: a dense
    model) replaces its MLP by `experts` expert MLPs of hidden size `expert_hidden` (None: 4h), `top_k` per token,
    a router of experts x h weights and optionally a shared expert MLP of hidden size `shared_expert_hidden` (0:
    none) that every token passes. train_gpt.py's MoE block is moe_ep.MoE(h, 4h, E, k): expert_hidden None,
    swiglu False, shared_expert_hidden 0, no biases in the router or the experts. `capacity_factor` (None:
    dropless) caps and `imbalance` (>= 1) states the load of the busiest EP rank over the uniform one (the
    docstring's f). `swiglu` gates the expert and shared MLPs (3 matrices each; the dense MLPs stay 4h GeLU),
    `kv_heads` (None: heads) is grouped-query attention, `tied_embeddings` False gives the last stage its own
    output layer: the shapes of the published MoE runs."""
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    global_batch: int  # sequences per optimizer step
    micro_batch: int = None
    recompute: str = None          # none | selective | full | offload | selective+offload
    sequence_parallel: bool = None
    zero: int = None               # ZeRO level over the DP x CP ranks: 0 replicated, 1 optimizer, 2 + grads, 3 + params
    virtual_stages: int = None     # model chunks per GPU (1: one; interleaved or zero-bubble schedules: more)
    moe_every: int = 0
    experts: int = 8
    top_k: int = 2
    expert_hidden: int = None
    shared_expert_hidden: int = 0
    capacity_factor: float = None
    imbalance: float = 1.0
    swiglu: bool = False
    kv_heads: int = None
    tied_embeddings: bool = True
    pp_schedule: str = None        # 1f1b | interleaved | zb-h1 | zbv | dualpipev
    zero_shard_size: int = None    # HSDP: ZeRO shards over this many DP x CP ranks (None: all of them)
    cp_ulysses: int = None         # hybrid CP: Ulysses over u consecutive CP ranks, a ring over cp / u

    def __post_init__(self):
        # a size of 0 would otherwise surface as a ZeroDivisionError deep in the cost model
        for name in ("layers", "hidden", "heads", "seq", "vocab"):
            _check_count(name, getattr(self, name), "give the model's size")
        _check_count("global_batch", self.global_batch, "give the sequences per optimizer step")
        for name in ("micro_batch", "virtual_stages", "zero_shard_size", "cp_ulysses"):  # None: the planner chooses
            if getattr(self, name) is not None:
                _check_count(name, getattr(self, name), "omit it to let the planner choose")
        if isinstance(self.zero, bool):  # the knob was ZeRO-1 on or off
            self.zero = int(self.zero)
        if self.zero is not None and self.zero not in ZERO_LEVELS:
            raise ValueError(f"zero={self.zero!r} must be a ZeRO level 0, 1, 2 or 3 (--zero); omit it to let the "
                             "planner choose")
        if self.zero == 0 and self.zero_shard_size is not None:
            raise ValueError(f"zero_shard_size={self.zero_shard_size} needs zero >= 1 (--zero-shard-size shards "
                             "the ZeRO states); omit it, or choose --zero 1, 2 or 3")
        if self.pp_schedule is not None and self.pp_schedule not in SCHEDULES:
            raise ValueError(f"pp_schedule={self.pp_schedule!r}; choose one of {', '.join(SCHEDULES)} "
                             "(--pp-schedule), or omit it to let the planner choose")
        if self.pp_schedule == "interleaved" and self.virtual_stages == 1:
            raise ValueError("pp_schedule='interleaved' needs virtual_stages >= 2 (--virtual-stages): model chunks "
                             "per GPU")
        if self.pp_schedule == "1f1b" and (self.virtual_stages or 1) > 1:
            raise ValueError(f"virtual_stages={self.virtual_stages} needs pp_schedule interleaved or zb-h1 "
                             "(--pp-schedule); 1f1b runs one chunk per GPU")
        if self.pp_schedule in V_SCHEDULES and self.virtual_stages not in (None, 2):
            raise ValueError(f"pp_schedule={self.pp_schedule!r} places two chunks per GPU in a V: virtual_stages "
                             f"must be 2 (--virtual-stages), not {self.virtual_stages}")
        if self.kv_heads is not None:
            _check_count("kv_heads", self.kv_heads, "omit it for multi-head attention")
            if self.heads % self.kv_heads:
                raise ValueError(f"kv_heads={self.kv_heads} must divide heads={self.heads} ({_flag('kv_heads')})")
        if not (isinstance(self.moe_every, numbers.Integral) and not isinstance(self.moe_every, bool)
                and 0 <= self.moe_every <= self.layers):
            raise ValueError(f"moe_every={self.moe_every!r} must be an integer in 0..layers={self.layers} "
                             "(--moe-every; 0: a dense model)")
        if self.moe_every:
            _check_count("experts", self.experts, "give the experts per MoE layer")
            _check_count("top_k", self.top_k, "give the experts each token goes to")
            if self.top_k > self.experts:
                raise ValueError(f"top_k={self.top_k} exceeds experts={self.experts} (--top-k): choose at most "
                                 f"{self.experts}")
            if self.expert_hidden is not None:
                _check_count("expert_hidden", self.expert_hidden, "omit it for 4 x hidden")
            if not (isinstance(self.shared_expert_hidden, numbers.Integral) and self.shared_expert_hidden >= 0):
                raise ValueError(f"shared_expert_hidden={self.shared_expert_hidden!r} must be an integer >= 0 "
                                 "(--shared-expert-hidden; 0: no shared expert)")
            if self.capacity_factor is not None and not (math.isfinite(self.capacity_factor)
                                                         and self.capacity_factor > 0):
                raise ValueError(f"capacity_factor={self.capacity_factor!r} must be positive and finite "
                                 "(--capacity-factor); omit it for dropless routing")
            if not (math.isfinite(self.imbalance) and self.imbalance >= 1):
                raise ValueError(f"imbalance={self.imbalance!r} must be >= 1 (--imbalance): the busiest EP rank's "
                                 "tokens over the uniform share, 1 for balanced routing")


# ---- the model's parameters and FLOPs ------------------------------------------------------------------

def _kv_width(model):
    """Width of K (and of V): h for multi-head attention, h kv_heads / heads with grouped-query attention."""
    return model.hidden if model.kv_heads is None else model.hidden * model.kv_heads // model.heads


def expert_hidden(model):
    return 4 * model.hidden if model.expert_hidden is None else model.expert_hidden


def moe_layers_between(model, first, last):
    """MoE layers among layers first .. last-1: layer i is one when (i + 1) % moe_every == 0 (train_gpt.py)."""
    return last // model.moe_every - first // model.moe_every if model.moe_every else 0


def stage_layer_counts(model, pp, stage):
    """(dense, MoE) layers of pipeline stage `stage` (each stage holds L/p consecutive layers)."""
    per = model.layers // pp
    moe = moe_layers_between(model, stage * per, (stage + 1) * per)
    return per - moe, moe


def rank_layer_counts(model, pp, rank, v_shape=False):
    """(dense, MoE) layers of pipeline rank `rank`: stage `rank` (L/p consecutive layers), or under a V schedule
    (`v_shape`) its two chunks, stages rank and 2p - 1 - rank of the 2p (L/2p layers each)."""
    if not v_shape:
        return stage_layer_counts(model, pp, rank)
    per = model.layers // (2 * pp)
    moe = sum(moe_layers_between(model, s * per, (s + 1) * per) for s in (rank, 2 * pp - 1 - rank))
    return 2 * per - moe, moe


def layer_parameters(model):
    """Parameters of one layer, by kind: a dense layer (12 h^2 + 13 h with multi-head attention: attention 4 h^2
    + 4 h, MLP 8 h^2 + 5 h, 2 LayerNorms 4 h); the part of a MoE layer that is not an expert (attention,
    LayerNorms, router E h, the shared expert); one expert (2 h f weights, 3 h f with SwiGLU; no biases)."""
    h, kv, mats = model.hidden, _kv_width(model), 3 if model.swiglu else 2
    attention = 2 * h * h + 2 * h * kv + (h + 2 * kv) + h  # QKV and projection weights and biases
    dense = attention + 4 * h + 8 * h * h + 5 * h
    return {"dense": dense,
            "moe_shared": attention + 4 * h + model.experts * h + mats * h * model.shared_expert_hidden,
            "expert": mats * h * expert_hidden(model)}


def _embedding_parameters(model, both_ends):
    """Token embedding (and, untied and when one GPU holds both ends, the output layer): V h each."""
    return model.vocab * model.hidden * (2 if both_ends and not model.tied_embeddings else 1)


def parameter_count(model):
    """Every parameter. Dense: Narayanan et al. 2021, P = 12 L h^2 (1 + 13/(12h) + (V + s)/(12 L h)); a MoE layer
    holds all E experts; untied embeddings add the output layer's V h."""
    dense, moe = model.layers - moe_layers_between(model, 0, model.layers), moe_layers_between(model, 0, model.layers)
    p = layer_parameters(model)
    return (dense * p["dense"] + moe * (p["moe_shared"] + model.experts * p["expert"])
            + _embedding_parameters(model, True) + model.seq * model.hidden)


def active_parameter_count(model):
    """The parameters one token uses: every layer's dense part, its MoE layers' top-k experts (and the shared
    expert and router), the embeddings (input and output)."""
    dense, moe = model.layers - moe_layers_between(model, 0, model.layers), moe_layers_between(model, 0, model.layers)
    p = layer_parameters(model)
    return (dense * p["dense"] + moe * (p["moe_shared"] + model.top_k * p["expert"])
            + _embedding_parameters(model, True) + model.seq * model.hidden)


def _first_stage_parameters(model, tp, pp, ep, v_shape=False):
    """(dense part, expert part) of the parameters of one first-stage GPU: its L/p layers and the token
    embedding split t ways, the position embedding whole (Megatron-LM does not split it; the few replicated
    LayerNorm and router weights, < 0.1%, are counted as split); E/ep experts of each MoE layer, whole (expert
    TP 1). The last stage holds the output layer instead of the embedding: the same count. Under a V schedule
    (`v_shape`) rank 0 holds the first and the last stage: its two chunks' layers and both ends (tied: one V h)."""
    dense, moe = rank_layer_counts(model, pp, 0, v_shape)
    p = layer_parameters(model)
    shared = ((p["dense"] * dense + p["moe_shared"] * moe + _embedding_parameters(model, pp == 1 or v_shape)) / tp
              + model.seq * model.hidden)
    return shared, moe * (model.experts // ep) * p["expert"]


def params_on_first_stage(model, tp, pp, ep=1, v_shape=False):
    """Parameters held by one GPU of the first stage (`_first_stage_parameters`, both parts; rank 0 of a V with
    `v_shape`)."""
    shared, experts = _first_stage_parameters(model, tp, pp, ep, v_shape)
    return shared + experts


def _is_plain(model):
    """A dense GPT with multi-head attention: the published closed forms below hold exactly."""
    return model.moe_every == 0 and _kv_width(model) == model.hidden


def _matmul_weights_per_token(model):
    """Weights of the matmuls one token passes in the layers (train_gpt.py's count): attention 2 h^2 + 2 h h_kv, a
    dense MLP 8 h^2, a MoE MLP E h (router) + k (2|3) h f (its top-k experts) + k h (the router-weighted sum of the
    k outputs, a (1 x k)(k x h) product) + (2|3) h f_s (the shared expert)."""
    h, kv, mats = model.hidden, _kv_width(model), 3 if model.swiglu else 2
    moe = moe_layers_between(model, 0, model.layers)
    attention = 2 * h * h + 2 * h * kv
    moe_mlp = (model.experts * h + model.top_k * mats * h * expert_hidden(model) + model.top_k * h
               + mats * h * model.shared_expert_hidden)
    return model.layers * attention + (model.layers - moe) * 8 * h * h + moe * moe_mlp


def flops_per_token(model):
    """Training FLOPs per token (PaLM appendix B, as train_gpt.py's `model_flops_per_token`): 6 N + 12 L h s, N
    the weights of every matmul a token passes (`_matmul_weights_per_token`) and the output layer V h."""
    return (6 * (_matmul_weights_per_token(model) + model.vocab * model.hidden)
            + 12 * model.layers * model.hidden * model.seq)


def paper_flops(model):
    """FLOPs of one step as Narayanan et al. 2021 count them (their Table 1's TFLOP/s): every layer 4 x its
    forward (forward, backward 2x, the recomputed forward), the logits 3 x: 96 B s L h^2 (1 + s/6h + V/16Lh);
    for MoE or grouped-query shapes the same rule on `_matmul_weights_per_token`: B s (8 N + 16 L h s + 6 V h)."""
    B, s, L, h, V = model.global_batch, model.seq, model.layers, model.hidden, model.vocab
    if _is_plain(model):
        return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    return B * s * (8 * _matmul_weights_per_token(model) + 16 * L * h * s + 6 * V * h)


def model_flops(model):
    """FLOPs of one step without recomputation (Korthikanti et al. 2022's model FLOPs, for MFU):
    72 B s L h^2 (1 + s/6h + V/12Lh); MoE or grouped-query shapes: B s x `flops_per_token`."""
    B, s, L, h, V = model.global_batch, model.seq, model.layers, model.hidden, model.vocab
    if _is_plain(model):
        return 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    return B * s * flops_per_token(model)


def _knob_value(name, given, from_model, default):
    """A knob given to the call, else the model's, else the default. None means "not given": a 0 or an empty
    string is a value, and a wrong one."""
    value = given if given is not None else from_model if from_model is not None else default
    if name == "recompute" and value not in RECOMPUTE_KNOBS:
        raise ValueError(f"recompute={value!r}; choose one of {', '.join(RECOMPUTE_KNOBS)}")
    if name == "micro_batch":
        _check_count(name, value, "give the sequences per micro-batch, or omit it for 1")
    return value


def recomputation(policy):
    """What the backward recomputes under `policy`: an offload policy's recomputation underneath, else itself."""
    return OFFLOAD_POLICIES.get(policy, policy)


def training_flops(model, recompute=None):
    """Hardware FLOPs of one step: model FLOPs plus what the recomputation redoes: full redoes each layer's
    forward, 24 B s L h^2 (1 + s/6h) (giving the 96 formula; MoE: B s (2 N + 4 L h s)); selective redoes the
    attention core, 4 B s^2 h L. Offloading redoes nothing: an offload policy counts its recomputation's."""
    recompute = recomputation(_knob_value("recompute", recompute, model.recompute, "none"))
    B, s, L, h = model.global_batch, model.seq, model.layers, model.hidden
    full = (24 * B * s * L * h * h * (1 + s / (6 * h)) if _is_plain(model)
            else B * s * (2 * _matmul_weights_per_token(model) + 4 * L * h * s))
    extra = {"none": 0, "selective": 4 * B * s * s * h * L, "full": full}[recompute]
    return model_flops(model) + extra


def activation_bytes_per_layer(model, tp, cp, recompute=None, micro_batch=None, sequence_parallel=None,
                               flash_attention=False):
    """The chapter's `layer_activation_bytes` (Korthikanti et al. 2022) of a ModelShape. Knobs not given come from
    `model` (then: no recomputation, micro-batch 1, SP on). An offload policy's are `offload_bytes_per_layer`."""
    recompute = _knob_value("recompute", recompute, model.recompute, "none")
    _not_offloaded(recompute)
    b = _knob_value("micro_batch", micro_batch, model.micro_batch, 1)
    if sequence_parallel is None:
        sequence_parallel = model.sequence_parallel is not False
    return _dense_layer_bytes(model, tp, cp, recompute, b, sequence_parallel, flash_attention)


def _not_offloaded(recompute, moe=""):
    if recompute in OFFLOAD_POLICIES:  # its layers keep nothing on the GPU: a layer's bytes would mislead
        raise ValueError(f"recompute={recompute!r} keeps a chunk's input on the GPU, not a layer's activations: its "
                         f"bytes are offload_bytes_per_layer(...{moe})")


def _dense_layer_bytes(model, tp, cp, recompute, b, sequence_parallel, flash_attention):
    return layer_activation_bytes(model.seq, model.hidden, model.heads, b, tp, cp, recompute, sequence_parallel,
                                  flash_attention)


def moe_load_factor(model, ep):
    """The docstring's f: tokens (copies) of the busiest EP rank over the uniform share T k: `imbalance` across an
    EP group, 1 without EP (one rank holds every expert), capped by the capacity factor when tokens are dropped."""
    factor = model.imbalance if ep > 1 else 1.0
    return factor if model.capacity_factor is None else min(factor, model.capacity_factor)


def moe_activation_bytes_per_layer(model, tp, cp, ep, recompute=None, micro_batch=None, flash_attention=False):
    """A MoE layer's kept bytes for one micro-batch (sequence parallelism: Megatron-Core requires it with MoE and
    TP; train_gpt.py splits the MoE tokens over TP anyway). Attention and LayerNorms as Korthikanti (11 + 4) s b h/t
    (+ the scores unless recomputed or flash); the MoE MLP on the T = s b/(t cp) tokens of this GPU, R = T k f
    copies of which reach its experts: the router input 2 T h and its fp32 probabilities 4 T E, the dropout mask
    T h, each copy's expert input and output 2 + 2 bytes per element of R h, the expert activation's input and
    output 2 R f (2 + 1) with SwiGLU, 2 R f (1 + 1) with GeLU, and the shared expert's likewise on T x f_s. Full
    recomputation keeps the layer input, 2 s b h/t. An offload policy's are `offload_bytes_per_layer(..., moe=True)`."""
    recompute = _knob_value("recompute", recompute, model.recompute, "none")
    _not_offloaded(recompute, ", moe=True")
    b = _knob_value("micro_batch", micro_batch, model.micro_batch, 1)
    return _moe_layer_bytes(model, tp, cp, ep, recompute, b, flash_attention)


def _moe_layer_bytes(model, tp, cp, ep, recompute, b, flash_attention):
    s_local, h, a, t = model.seq // cp, model.hidden, model.heads, tp
    sbh = s_local * b * h
    if recompute == "full":
        return 2 * sbh / t
    tokens = s_local * b / t
    copies = tokens * model.top_k * moe_load_factor(model, ep)
    gates = 2 if model.swiglu else 1
    mlp = (2 * tokens * h + 4 * tokens * model.experts + tokens * h + 4 * copies * h
           + 2 * (gates + 1) * (copies * expert_hidden(model) + tokens * model.shared_expert_hidden))
    scores = 0 if flash_attention or recompute == "selective" else 5 * a * s_local * model.seq * b / t
    return 15 * sbh / t + scores + mlp


def moe_a2a_bytes(tokens, hidden, top_k, ep, bytes_per_element=ACT_BYTES, imbalance=1.0):
    """Bytes one rank sends in each all-to-all of one MoE layer and micro-batch, by name: dispatch and combine,
    forward and backward. T tokens on the rank, k copies each, uniform routing: a copy stays home with
    probability 1/P, so each all-to-all sends T k h e (P - 1)/P; the busiest rank (load f x T k, the others routing
    as it does) receives, and sends back in the combine and in the dispatch's backward, f times that."""
    sent = tokens * top_k * hidden * bytes_per_element * (ep - 1) / ep * imbalance
    return {f"{kind}_{phase}": sent for kind in ("dispatch", "combine") for phase in ("fwd", "bwd")}


def hybrid_comm_bytes(b, s, q_width, kv_width, ulysses, ring, e, e_acc=None):
    """Bytes one rank sends per attention layer under hybrid CP (USP: Ulysses over u ranks inside, a ring over r
    across, CP = u r), by group and direction; a copy of long_seq.hybrid_comm_bytes (this file imports no other
    file of the repository; a test checks that the two agree). q_width and kv_width are this rank's query and KV
    widths (heads x head_dim, / t under TP), e bytes per element, e_acc those of the ring's dK/dV (default e).
    The 4 all-to-alls (q, k, v, out; backward dout, dq, dk, dv) each keep 1/u of a tensor of b s/(u r) tokens at
    home: (u-1)/u b s/(u r) (2 H + 2 H_kv) e. After them the rank holds s/r tokens of H_kv/u, and the ring passes K
    and V r - 1 times, 2 (r-1) b (s/r) (H_kv/u) e, and backward returns dK and dV r times more at e_acc."""
    e_acc = e if e_acc is None else e_acc
    u, r = ulysses, ring
    a2a = (u - 1) / u * b * s / (u * r) * (2 * q_width + 2 * kv_width) * e
    kv_block = 2 * b * (s / r) * (kv_width / u)  # K and V of one ring shard, elements
    return {"ulysses_fwd": a2a, "ulysses_bwd": a2a,
            "ring_fwd": (r - 1) * kv_block * e,
            "ring_bwd": (r - 1) * kv_block * e + (r * kv_block * e_acc if r > 1 else 0)}


def load_imbalance(load_per_rank):
    """The factor f of a routing: the copies that reach the busiest EP rank over the mean (1: balanced)."""
    load = list(load_per_rank)
    return max(load) / (sum(load) / len(load))


# ---- where each group lives ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=65536)
def _members_per_node(stride, size, gpus, gpus_per_node):
    """Ranks of one group (base + stride * k, k < size) that share a node; `size` when the group never leaves
    a node. Exact when the group's span divides the node or is a multiple of it (the usual powers of two);
    otherwise some groups straddle a node boundary and the group counts as crossing."""
    span = stride * size
    if gpus <= gpus_per_node or (span <= gpus_per_node and gpus_per_node % span == 0):
        return size
    return max(1, min(size - 1, gpus_per_node // stride))


def layout_locality(cluster, tp, pp, cp, dp, ep=1):
    """Members per node of one group of each kind, by arithmetic on the rank formula (no group lists: planning
    16,384 GPUs must not build 16,384-rank groups for every candidate). `ep` and `edp` (the ranks that reduce
    one expert's gradient: the EDP replicas and, with experts whole on every TP rank, the TP ranks) follow
    `cluster.expert_folding`."""
    g, n = cluster.gpus_per_node, cluster.gpus
    per_node = {"tp": _members_per_node(1, tp, n, g), "cp": _members_per_node(tp, cp, n, g),
                "dp_cp": _members_per_node(tp, cp * dp, n, g), "pp": _members_per_node(tp * cp * dp, pp, n, g)}
    sizes = {"tp": tp, "cp": cp, "dp_cp": cp * dp, "pp": pp, "ep": ep, "edp": tp * cp * dp // ep}
    if cluster.expert_folding == "dp_cp":  # expert grid tp-ep-edp: EP at stride tp, EDP at stride tp ep
        per_node["ep"] = _members_per_node(tp, ep, n, g)
        per_node["edp"] = min(sizes["edp"], per_node["tp"] * _members_per_node(tp * ep, cp * dp // ep, n, g))
    else:  # Megatron-Core's folding with expert TP 1: ep-edp over the tp x cp x dp ranks, EP fastest
        per_node["ep"] = _members_per_node(1, ep, n, g)
        per_node["edp"] = _members_per_node(ep, sizes["edp"], n, g)
    return per_node, {k: per_node[k] == sizes[k] for k in per_node}


def _bus_gbps(cluster, members_per_node, size):
    """Achieved ring bandwidth of a collective: NVLink inside a node; across nodes NCCL runs one ring per NIC,
    so a group with k members per node moves k NICs' worth (capped by NVLink)."""
    if members_per_node >= size:
        return cluster.nvlink_gbps
    return min(cluster.nvlink_gbps, members_per_node * cluster.ib_gbps)


def a2a_seconds(cluster, sent_bytes, size, members_per_node):
    """One all-to-all sending `sent_bytes` from each rank to the other size-1 members of its group, g of which
    share its node: (g-1)/(size-1) of the bytes go over NVLink, the rest over this GPU's own NIC, both at once."""
    if size == 1:
        return 0.0
    inside = sent_bytes * (members_per_node - 1) / (size - 1) / (cluster.nvlink_gbps * GB)
    across = sent_bytes * (size - members_per_node) / (size - 1) / (cluster.ib_gbps * GB)
    return max(inside, across) + cluster.collective_latency_us * 1e-6


# ---- time of one layer on one GPU ----------------------------------------------------------------------

def gemm_efficiency(cluster, x):
    """Fraction of peak reached by a GEMM whose smallest dimension (M, N or K) is x: e_max x / (x + x0).
    Each output tile pays a fixed prologue/epilogue worth about x0 steps of its K loop, and small M or N leave
    SMs idle in the last wave (NVIDIA, "Matrix Multiplication Background": tile and wave quantisation);
    both penalties behave like x / (x + x0). TP divides N or K by t, so TP makes every GEMM less efficient."""
    return cluster.efficiency * x / (x + cluster.gemm_half_dim)


def gemm_seconds(cluster, M, N, K):
    return 2 * M * N * K / (cluster.peak_tflops * 1e12 * gemm_efficiency(cluster, min(M, N, K)))


def _moe_mlp_forward(cluster, model, tokens, t, ep, layout):
    """A MoE MLP's forward on one GPU: (GEMMs, memory-bound work, EP all-to-alls) in seconds. T = tokens/t token
    copies k each, R = T k f of which reach this GPU's E/ep experts: the router (T, h, E), each local expert's
    grouped GEMMs on R/(E/ep) rows, the shared expert as a TP-split MLP on all `tokens`; the permutation and
    un-permutation (PERMUTE_BYTES per element of T k h), the expert activation (EXPERT_ACT_BYTES per element of
    R f); dispatch and combine (`moe_a2a_bytes`, `a2a_seconds`) and the small counts all-to-all (a latency)."""
    h, f, gates = model.hidden, expert_hidden(model), 2 if model.swiglu else 1
    shared_hidden = model.shared_expert_hidden
    mine = tokens / t
    local = model.experts // ep
    copies = mine * model.top_k * moe_load_factor(model, ep)
    rows = copies / local
    gemms = (gemm_seconds(cluster, mine, h, model.experts)
             + local * (gemm_seconds(cluster, rows, h, gates * f) + gemm_seconds(cluster, rows, f, h)))
    if shared_hidden:
        gemms += (gemm_seconds(cluster, tokens, h, gates * shared_hidden // t)
                  + gemm_seconds(cluster, tokens, shared_hidden // t, h))
    act = EXPERT_ACT_BYTES[model.swiglu]
    memory = ((PERMUTE_BYTES * mine * model.top_k * h + act * (copies * f + tokens * shared_hidden / t))
              / (cluster.hbm_gbps * GB))
    sent = moe_a2a_bytes(mine, h, model.top_k, ep, ACT_BYTES, moe_load_factor(model, ep))["dispatch_fwd"]
    a2a = 0.0
    if ep > 1:
        a2a = (2 * a2a_seconds(cluster, sent, ep, layout.per_node["ep"])
               + cluster.collective_latency_us * 1e-6)
    return gemms, memory, a2a


def layer_forward(cluster, model, tp, cp, b, sp, layout, moe=False, ulysses=1):
    """Seconds of one layer's forward on one GPU for one micro-batch of b sequences, by kind (a MoE layer with
    `moe`: its MLP from `_moe_mlp_forward`, and `ep_fwd` its all-to-alls); CP as a ring over cp / `ulysses` ranks
    after the Ulysses all-to-alls over `ulysses` (1: the ring alone, cp: Ulysses alone)."""
    h, a, s, t = model.hidden, model.heads, model.seq, tp
    kv = _kv_width(model)
    tokens = b * s // cp
    hbm = cluster.hbm_gbps * GB
    ep_fwd = 0.0
    if moe:
        mlp_gemms, mlp_memory, ep_fwd = _moe_mlp_forward(cluster, model, tokens, t, layout.ep, layout)
        gemms = (gemm_seconds(cluster, tokens, h, (h + 2 * kv) // t) + gemm_seconds(cluster, tokens, h // t, h)
                 + mlp_gemms)
    else:
        gemms = (gemm_seconds(cluster, tokens, h, (h + 2 * kv) // t) + gemm_seconds(cluster, tokens, h // t, h)
                 + gemm_seconds(cluster, tokens, h, 4 * h // t) + gemm_seconds(cluster, tokens, 4 * h // t, h))
    # attention core: the s x s scores of a/t heads; with CP this GPU's s/cp queries against all s keys. Unfused
    # (Korthikanti's activation count): memory-bound while h/a < 13 peak e_max / (4 HBM). Flash: the causal half
    # of QK^T and AV at the GEMMs' e_max, nothing through HBM
    scores = b * (a // t) * (s // cp) * s
    if cluster.flash_attention:
        attention = 2 * (h // a) * scores / (cluster.peak_tflops * 1e12 * cluster.efficiency)
    else:
        attention = max(4 * (h // a) * scores / (cluster.peak_tflops * 1e12 * cluster.efficiency),
                        SCORE_BYTES * scores / hbm)
    replicated = t if sp else 1  # sequence parallelism splits LayerNorm and dropout t ways
    if moe:
        elementwise = (tokens * h * LAYERNORM_DROPOUT_BYTES / replicated / hbm + mlp_memory
                       + (KERNELS_PER_LAYER + MOE_EXTRA_KERNELS) * cluster.launch_us * 1e-6)
    else:
        elementwise = (tokens * h * (LAYERNORM_DROPOUT_BYTES / replicated + GELU_BYTES / t) / hbm
                       + KERNELS_PER_LAYER * cluster.launch_us * 1e-6)
    # TP: 2 all-reduces of b s h (or all-gather + reduce-scatter with SP: the same bytes), exposed: Megatron-LM
    # issues them between the GEMMs that need their results. A MoE layer has the attention's pair only (its experts
    # are whole, its tokens already split over TP), and the shared expert's when it has one
    tp_comm = 0.0
    if t > 1:
        bus = _bus_gbps(cluster, layout.per_node["tp"], t)
        pairs = (1 + (model.shared_expert_hidden > 0)) if moe else 2
        tp_comm = pairs * (ring_allreduce_bytes(tokens, h, t) / (bus * GB) + cluster.collective_latency_us * 1e-6)
    # CP ring: K and V shards (2 b s h_kv / (t cp) elements) passed cp - 1 times forward; backward passes them
    # again and returns dK, dV cp times. The ring overlaps each exchange with the previous block's attention
    # (Megatron-Core / Transformer Engine), so only what exceeds the attention core is exposed. Each step also
    # pays a latency and the launches of its partial attention and rescaling kernels (3), and each of the cp - 1
    # later blocks merges its partial output into the fp32 accumulator (forward; twice in the backward: dQ, and
    # dK dV travelling with the ring)
    cp_fwd, cp_bwd = _cp_seconds(cluster, model, tp, cp, b, layout, attention, ulysses)
    return {"gemm": gemms, "attention": attention, "elementwise": elementwise, "tp": tp_comm,
            "cp_fwd": cp_fwd, "cp_bwd": cp_bwd, "ep_fwd": ep_fwd, "flash": cluster.flash_attention}


def _cp_seconds(cluster, model, t, cp, b, layout, attention, ulysses):
    """(forward, backward) seconds of CP's exposed communication in one layer, one micro-batch (layer_forward)."""
    h, s, kv, hbm = model.hidden, model.seq, _kv_width(model), cluster.hbm_gbps * GB
    tokens = b * s // cp
    # Hybrid CP (u = `ulysses` > 1): Ulysses over u consecutive CP ranks first, 4 all-to-alls forward (q, k, v, out)
    # and 4 backward, `hybrid_comm_bytes`, not overlapped (each feeds the next step); the ring then runs over the
    # r = cp/u ranks at stride t u on s/r tokens of 1/u of the heads: as many elements per step as the plain ring's,
    # r - 1 steps. The attention core's work is the same at every u
    cp_fwd = cp_bwd = 0.0
    ring = cp // ulysses
    if ring > 1:
        kv_bytes = 2 * tokens * kv / t * ACT_BYTES
        ring_local = layout.local["cp"] if ulysses == 1 else (
            _members_per_node(t * ulysses, ring, cluster.gpus, cluster.gpus_per_node) == ring)
        link = (cluster.nvlink_gbps if ring_local else cluster.ib_gbps) * GB
        per_step = cluster.collective_latency_us * 1e-6 + 3 * cluster.launch_us * 1e-6
        merge = RING_MERGE_BYTES * tokens * h / t / hbm
        cp_fwd = max(0.0, (ring - 1) * kv_bytes / link - attention) + (ring - 1) * (per_step + merge)
        cp_bwd = (max(0.0, (2 * ring - 1) * kv_bytes / link - 2 * attention) + (2 * ring - 1) * per_step
                  + 2 * (ring - 1) * merge)
    if ulysses > 1:
        sent = hybrid_comm_bytes(b, s, h / t, kv / t, ulysses, ring, ACT_BYTES)["ulysses_fwd"]
        inner = _members_per_node(t, ulysses, cluster.gpus, cluster.gpus_per_node)
        a2a = a2a_seconds(cluster, sent, ulysses, inner) + 3 * cluster.collective_latency_us * 1e-6
        cp_fwd, cp_bwd = cp_fwd + a2a, cp_bwd + a2a
    return cp_fwd, cp_bwd


def layer_step(forward, recompute):
    """One layer, one micro-batch: forward, backward (2x the forward's work, the same TP collectives; a flash
    attention core's backward is 2.5x its forward: it recomputes the scores), and what the recomputation redoes
    (full: the whole forward; selective: the attention core; an offload policy: its recomputation's, the copies'
    wait is `offload_layer_seconds`)."""
    recompute = recomputation(recompute)
    work = forward["gemm"] + forward["attention"] + forward["elementwise"]
    compute = 3 * work + {"none": 0.0, "selective": forward["attention"], "full": work}[recompute]
    if forward.get("flash"):
        compute += 0.5 * forward["attention"]
    tp = (3 if recompute == "full" else 2) * forward["tp"]
    cp = (1 if recompute == "none" else 2) * forward["cp_fwd"] + forward["cp_bwd"]
    return compute, tp, cp


def ep_step(forward, recompute):
    """EP all-to-alls of one MoE layer and micro-batch: dispatch and combine forward, both again backward, and
    forward once more under full recomputation (never under an offload policy); none are overlapped (Megatron-Core's
    alltoall dispatcher)."""
    return (3 if recompute == "full" else 2) * forward.get("ep_fwd", 0.0)


def output_layer_seconds(cluster, model, tp, cp, b):
    """Logits (forward + backward, never recomputed: 3 x 2 b s h V/t FLOPs) and the fp32 cross-entropy."""
    tokens = b * model.seq // cp
    return (3 * gemm_seconds(cluster, tokens, model.hidden, model.vocab // tp)
            + LOSS_BYTES * tokens * model.vocab / tp / (cluster.hbm_gbps * GB))


def p2p_exchange_seconds(cluster, model, tp, cp, b, sp, pp_local):
    """One activation (or its gradient) between neighbouring stages: b s h/(t cp) elements per GPU over the
    link (Megatron-LM's scatter-gather: each TP rank sends 1/t), then without SP an all-gather over NVLink."""
    elements = b * model.seq // cp * model.hidden
    link = cluster.p2p_gbps if cluster.p2p_gbps is not None else (cluster.nvlink_gbps if pp_local else cluster.ib_gbps)
    seconds = cluster.p2p_latency_us * 1e-6 + elements / tp * ACT_BYTES / (link * GB)
    if not sp and tp > 1:
        seconds += (tp - 1) / tp * elements * ACT_BYTES / (cluster.nvlink_gbps * GB)
    return seconds


# ---- activation offloading: what stays on the GPU, what crosses PCIe, what the step waits for ---------------
# Under `offload` and `selective+offload` (checkpointing.py's ActivationOffload, train_gpt.py's --recompute) every
# tensor a layer's autograd saves is copied to host memory in its forward and back before its backward. Per layer and
# micro-batch on one GPU, with K the bytes the policy underneath keeps (none or selective: `layer_activation_bytes`, a
# MoE layer's `_moe_layer_bytes`) and X = 2 s b h/t a chunk's input (2 s b h without SP: what full keeps a layer):
#     copied     K to the host in the forward, K back in the backward (`offload_bytes_per_layer`)
#     kept       X per model chunk and micro-batch in flight, the input the pipeline holds to send its gradient back;
#                the layers keep nothing else; once, the working set 2 K, the layer running its backward and the
#                next one prefetched behind it (+ the attention core being recomputed under selective+offload)
#     time       C = K / B_pcie each way (B_pcie = Cluster.pcie_gbps). The copy out hides behind the layer's forward
#                compute F. Each model chunk and micro-batch runs its layers' backwards top down, and a layer's first
#                unpack starts the copy back of the layer below, so that copy hides behind this layer's backward
#                window B: its compute (2 F; + the recomputed core under selective+offload, + flash's recomputed
#                scores), under zb-h1 less its weight-gradient GEMMs W (deferred: B holds the input gradients only,
#                `_stage_parts`' split). The chunk's top layer has nothing in front of it: it waits its whole C.
#                Per chunk of n layers and micro-batch the step waits n max(0, C - F) for the copies out and
#                C + (n - 1) max(0, C - B) for the copies back, i.e. per layer max(0, C - F) + max(0, C - B) and per
#                chunk min(C, B) more (`offload_layer_seconds`; a stage of both kinds counts the larger min(C, B))
# The memory is counted for copies that keep pace: one that falls behind costs its wait and, in train_gpt.py, holds
# its layer's tensors on the GPU until it is done. Against full recomputation, which redoes each layer's forward R
# (its compute, TP collectives, CP exchanges, EP all-to-alls): `offload` redoes nothing and wins while its wait is
# less than R; `selective+offload` redoes the attention core and its CP exchanges, and wins while its wait is less
# than R less those. checkpointing.py's offload_or_recompute gives one layer's steady wait, max(0, C - F) +
# max(0, C - 2 F), F its forward's FLOPs at one rate: the planner's per-layer term with B = 2 F. Equal for `offload`
# without flash under 1F1B or interleaving; no longer where B holds more (selective+offload's core, flash), no
# shorter where it holds less (zb-h1 takes W off: below 2 F when W exceeds those); the top layer's min(C, B) per
# chunk is the planner's alone.

def offload_bytes_per_layer(model, tp, cp, recompute, micro_batch=None, sequence_parallel=None, flash_attention=False,
                            ep=1, moe=False):
    """Under an offload policy, one layer (a MoE layer with `moe`) and micro-batch on one GPU, in bytes:
    device_resident X (per model chunk: its input, the layers' nothing), to_host K and to_device K (the comment
    above). Knobs not given come from `model` (then: micro-batch 1, SP on)."""
    if recompute not in OFFLOAD_POLICIES:
        raise ValueError(f"recompute={recompute!r}; offloading is one of {', '.join(OFFLOAD_POLICIES)}")
    b = _knob_value("micro_batch", micro_batch, model.micro_batch, 1)
    if sequence_parallel is None:
        sequence_parallel = model.sequence_parallel is not False
    return _offload_bytes(model, tp, cp, ep, recompute, b, sequence_parallel, flash_attention, moe)


def _offload_bytes(model, tp, cp, ep, recompute, b, sp, flash, moe):
    underneath = OFFLOAD_POLICIES[recompute]
    copied = (_moe_layer_bytes(model, tp, cp, ep, underneath, b, flash) if moe
              else _dense_layer_bytes(model, tp, cp, underneath, b, sp, flash))
    return {"device_resident": _dense_layer_bytes(model, tp, cp, "full", b, sp, flash), "to_host": copied,
            "to_device": copied}


def offload_layer_seconds(cluster, forward, recompute, copied_bytes, schedule="1f1b"):
    """(PCIe seconds, exposed seconds, top-block seconds) of one layer and micro-batch copying `copied_bytes` each way
    under the offload policy `recompute` (the comment above): 2 C with C = K / B_pcie; max(0, C - F) + max(0, C - B)
    when its copy back was prefetched, F the forward's compute (`layer_forward`'s GEMMs, attention core and
    elementwise work), B the backward window (`layer_step`'s rest; under zb-h1 less W, the forward's GEMM time:
    `_stage_parts`' split); and min(C, B), what it waits more as its chunk's top block (C instead of max(0, C - B))."""
    copy = copied_bytes / (cluster.pcie_gbps * GB)
    forward_s = forward["gemm"] + forward["attention"] + forward["elementwise"]
    window = layer_step(forward, recompute)[0] - forward_s - (forward["gemm"] if schedule in SPLIT_SCHEDULES else 0.0)
    return 2 * copy, max(0.0, copy - forward_s) + max(0.0, copy - window), min(copy, window)


def _offload_terms(cluster, model, layout, b, sp, recompute, forwards, schedule="1f1b"):
    """offload_layer_seconds of each kind of layer of `forwards` (`_layer_forwards`), (0, 0, 0) unless offloaded."""
    if recompute not in OFFLOAD_POLICIES:
        return {kind: (0.0, 0.0, 0.0) for kind in forwards}
    return {kind: f and offload_layer_seconds(cluster, f, recompute, _offload_bytes(
        model, layout.tp, layout.cp, layout.ep, recompute, b, sp, cluster.flash_attention, kind == "moe")["to_host"],
                                              schedule)
            for kind, f in forwards.items()}


def _stage_offload_bytes(cluster, model, tp, pp, cp, ep, b, recompute, sp, v_shape=False):
    """(a chunk's input, the most one of its layers copies each way) on stage 0 (rank 0 of a V), per micro-batch."""
    kinds = [moe for moe, n in zip((False, True), rank_layer_counts(model, pp, 0, v_shape)) if n]
    layer_bytes = [_offload_bytes(model, tp, cp, ep, recompute, b, sp, cluster.flash_attention, moe) for moe in kinds]
    return layer_bytes[0]["device_resident"], max(m["to_host"] for m in layer_bytes)


def _offload_parts(cluster, model, tp, pp, cp, ep, b, recompute, sp, v, v_shape=False):
    """(kept per micro-batch in flight, working set) of stage 0 under an offload policy: its v chunks' inputs, and
    two of its layers' copied bytes (the larger kind's) with the recomputed attention core's scores."""
    chunk_input, copied_bytes = _stage_offload_bytes(cluster, model, tp, pp, cp, ep, b, recompute, sp, v_shape)
    flash = cluster.flash_attention
    core = 0.0 if flash or recompute == "offload" else 5 * model.heads * (model.seq // cp) * model.seq * b / tp
    return v * chunk_input, 2 * copied_bytes + core


# ---- memory of the most loaded GPU -------------------------------------------------------------------

def in_flight_microbatches(pp, v, micro_batches, schedule=None):
    """Micro-batches whose activations stage 0 holds at the peak: 1F1B keeps p (GPipe would keep m); the
    interleaved schedule keeps p (1 + (p-1)/(p v)) (Korthikanti et al. 2022, section 4.2.3), never more than m.
    ZB-H1 on either order keeps as many before their B on stage 0 (rank r defers r W's: rank 0 none). A V schedule's
    rank 0: its chunks in flight (`in_flight_chunks`) over its v = 2, p for ZB-V (1F1B's), p + 1/2 for DualPipeV."""
    if schedule in V_SCHEDULES:
        return in_flight_chunks(schedule, pp, micro_batches, v)[0][0] / v
    if v == 1:
        return min(pp, micro_batches)
    return min(float(micro_batches), pp + (pp - 1) / v)


@functools.lru_cache(maxsize=4096)
def in_flight_chunks(schedule, pp, micro_batches, v=1):
    """Per pipeline rank r, at its activation peak: (k, d), k the model chunks (of micro-batches) whose activations
    wait for their backward B, d the chunks whose B has run but whose deferred W has not. 1F1B: k = min(p - r, m);
    interleaved (Megatron-LM's order): k = min(2 (p - r - 1) + (v - 1) p + 1, v m); d = 0. ZB-H1 runs the same order
    with rank r deferring r W's through the steady state: the same k, d = min(k + r, v m) - k. The V schedules (v = 2
    chunks of L/2p layers): ZB-V k = min(2p, m + r + 1, 2m), DualPipeV 2p + 1 (2p, and a pair's forward beside its
    backward), d = 0: each W follows its B but in the drain, where fewer chunks wait (`v_activation_points`).
    tests/test_topology.py and tests/test_vpipe.py replay train_gpt.py's lists against these counts."""
    if schedule == "zbv":
        return tuple((min(2 * pp, micro_batches + r + 1, 2 * micro_batches), 0) for r in range(pp))
    if schedule == "dualpipev":
        return ((2 * pp + 1, 0),) * pp
    if v == 1:
        before_b = [min(pp - r, micro_batches) for r in range(pp)]
    else:
        before_b = [min((pp - r - 1) * 2 + (v - 1) * pp + 1, micro_batches * v) for r in range(pp)]
    if schedule != "zb-h1":
        return tuple((k, 0) for k in before_b)
    return tuple((k, min(k + r, micro_batches * v) - k) for r, k in enumerate(before_b))


@functools.lru_cache(maxsize=256)
def v_activation_points(schedule, pp):
    """(k, d) pairs, k chunks before their B and d whose W waits, where k A + d A_w peaks on some rank of a V
    schedule (A, A_w per chunk; m >= 2p - 1 for ZB-V, 2p for DualPipeV), the most of any rank taken: the steady
    state's k (`in_flight_chunks`, d = 0); right after a B, one chunk fewer before it and its W waiting (2p - 1, 1);
    and the drain, where rank r runs its B's ahead of their W's: ZB-V's rank p - 1 ends with 2p - 1 W's waiting,
    DualPipeV's with p (on rank r: (p - r - 1, 2r + 1) and (p - r - 1, r + 1), the last rank's the largest)."""
    k = in_flight_chunks(schedule, pp, 4 * pp, 2)[0][0]
    return (k, 0), (2 * pp - 1, 1), (0, 2 * pp - 1 if schedule == "zbv" else pp)


@functools.lru_cache(maxsize=4096)
def _zb_candidate_ranks(pp, micro_batches, v):
    """The ranks 1..p-1 where a * k + b * d (a, b >= 0) can peak: (k, d) is piecewise linear in r, so the ends and
    the ranks where its slope changes."""
    chunks = in_flight_chunks("zb-h1", pp, micro_batches, v)
    ranks = {1, pp - 1} if pp > 1 else set()
    for r in range(2, pp - 1):
        slope = [chunks[r][i] - chunks[r - 1][i] for i in (0, 1)]
        if slope != [chunks[r + 1][i] - chunks[r][i] for i in (0, 1)]:
            ranks.add(r)
    return tuple(sorted(ranks))


def deferred_w_bytes(model, tp, cp, ep, b, moe=False):
    """Bytes the deferred W of one layer and one micro-batch holds under ZB-H1: every linear's input and output
    gradient in 16 bits, as train_gpt.py's _TPLinear keeps them for W (the input gathered over TP under SP, so that W
    sends nothing). Per token of this CP rank: attention 2 h + (h + 2 h_kv)/t + h/t (QKV: whole input, split
    gradient; projection: split input, whole gradient), a dense MLP 2 h + 8 h/t; a MoE layer the same attention,
    its router (h + E) and each routed copy's expert linears (2 h + (g + 1) f) on its T = tokens/t, a shared expert
    2 h + (g + 1) f_s/t on every token. (train_gpt.py defers only the _TPLinear GEMMs: there the experts' and the
    router's weight gradients stay in B.)"""
    h, kv, t = model.hidden, _kv_width(model), tp
    tokens = b * model.seq // cp
    elements = tokens * (2 * h + (h + 2 * kv) / t + h / t)
    if not moe:
        return ACT_BYTES * (elements + tokens * (2 * h + 8 * h / t))
    gates = 2 if model.swiglu else 1
    mine = tokens / t
    copies = mine * model.top_k * moe_load_factor(model, ep)
    elements += (mine * (h + model.experts) + copies * (2 * h + (gates + 1) * expert_hidden(model))
                 + (tokens * (2 * h + (gates + 1) * model.shared_expert_hidden / t) if model.shared_expert_hidden
                    else 0))
    return ACT_BYTES * elements


def _state_bytes(cluster):
    """Bytes per parameter: (weight, gradient, optimizer state). 16-bit gradients: 2, 2 and 16 (fp32 master,
    Adam's two moments, the fp32 copy of the gradient); fp32 main grads: 2, 4 and 12."""
    if cluster.grad_bytes == 2:
        return 2, 2, 16  # Megatron-LM 2021's accounting
    return STATE_BYTES["weights"], STATE_BYTES["grads"], STATE_BYTES["optimizer"]  # mixed_precision.py's 18


def state_bytes_per_parameter(cluster, zero, shard):
    """(weight, gradient, optimizer) bytes per parameter at ZeRO level `zero` over `shard` ranks, without the
    working set: BF16 with fp32 main grads 18, 6 + 12/d, 2 + 16/d, 18/d; 16-bit gradients 20, 4 + 16/d, 2 + 18/d,
    20/d."""
    w, g, o = _state_bytes(cluster)
    return (w / shard if zero >= 3 else w, g / shard if zero >= 2 else g, o / shard if zero >= 1 else o)


def expert_shard(cluster, tp, cp, dp, ep):
    """Ranks over which a distributed optimizer shards one expert's states: its EDP replicas (cp dp / ep with
    train_gpt.py's folding, whose TP ranks each keep a copy; tp cp dp / ep with Megatron-Core's)."""
    return (cp * dp if cluster.expert_folding == "dp_cp" else tp * cp * dp) // ep


def _unit_parameters(model, tp, ep):
    """Parameters of the largest unit ZeRO-3 gathers at once on one GPU: a layer (a MoE layer with its E/ep local
    experts) or the token embedding with the positions, split t ways as held."""
    p = layer_parameters(model)
    moe = moe_layers_between(model, 0, model.layers)
    units = [model.vocab * model.hidden / tp + model.seq * model.hidden]
    if model.layers > moe:
        units.append(p["dense"] / tp)
    if moe:
        units.append(p["moe_shared"] / tp + (model.experts // ep) * p["expert"])
    return max(units)


def _activation_parts(cluster, model, tp, pp, cp, ep, b, recompute, sp, v=1, v_shape=False):
    """Bytes of one first-stage GPU's activations: (its layers' per micro-batch in flight, the working set of the
    layer being recomputed, the embedding's dropout mask per micro-batch in flight, the fp32 logits). An offload
    policy's first two are `_offload_parts` (of `v` chunks per stage). Under a V schedule (`v_shape`) rank 0's two
    chunks, and the logits: it holds the last stage too."""
    flash = cluster.flash_attention
    s_local = model.seq // cp
    embedding = s_local * b * model.hidden / (tp if sp else 1)  # embedding dropout mask (Korthikanti)
    logits = _logits_bytes(model, tp, cp, b) if pp == 1 or v_shape else 0.0  # stage 0 is also the last
    if recompute in OFFLOAD_POLICIES:
        return _offload_parts(cluster, model, tp, pp, cp, ep, b, recompute, sp, v, v_shape) + (embedding, logits)
    dense_layers, moe_layers = rank_layer_counts(model, pp, 0, True) if v_shape else stage_layer_counts(model, pp, 0)
    kept = dense_layers * _dense_layer_bytes(model, tp, cp, recompute, b, sp, flash) if dense_layers else 0.0
    if moe_layers:
        kept += moe_layers * _moe_layer_bytes(model, tp, cp, ep, recompute, b, flash)
    # the layer being recomputed in the backward holds its activations in full for one micro-batch
    if recompute == "full":
        working = (_moe_layer_bytes(model, tp, cp, ep, "none", b, flash) if moe_layers
                   else _dense_layer_bytes(model, tp, cp, "none", b, sp, flash))
    else:
        working = {"none": 0.0,
                   "selective": 0.0 if flash else 5 * model.heads * s_local * model.seq * b / tp}[recompute]
    return kept, working, embedding, logits


def _logits_bytes(model, tp, cp, b):
    """The fp32 logits of one micro-batch on the last stage, split over TP (4 s b V / t)."""
    return 4 * (model.seq // cp) * b * model.vocab / tp


def _stage_deferred_bytes(model, tp, pp, cp, ep, b, v_shape=False):
    """deferred_w_bytes of stage 0's layers (rank 0's two chunks under a V schedule), one micro-batch."""
    dense_layers, moe_layers = rank_layer_counts(model, pp, 0, v_shape)
    return ((dense_layers * deferred_w_bytes(model, tp, cp, ep, b) if dense_layers else 0.0)
            + (moe_layers * deferred_w_bytes(model, tp, cp, ep, b, moe=True) if moe_layers else 0.0))


def first_stage_memory(cluster, model, tp, pp, cp, dp, b, v, recompute, sp, zero, micro_batches, ep=1, parts=None,
                       split=None, schedule="1f1b", shard=None):
    """(parameters held, micro-batches in flight on stage 0, GB by kind) of the most loaded GPU: one of the first
    stage, or under ZB-H1 the rank whose deferred W's hold the most (`_activations_gb`). `parts` and `split`:
    `_activation_parts` and `_first_stage_parameters` when the caller has them already (the search)."""
    v_shape = schedule in V_SCHEDULES
    split = split or _first_stage_parameters(model, tp, pp, ep, v_shape)
    parts = parts or _activation_parts(cluster, model, tp, pp, cp, ep, b, recompute, sp, v, v_shape)
    in_flight = in_flight_microbatches(pp, v, micro_batches, schedule)
    deferred = _stage_deferred_bytes(model, tp, pp, cp, ep, b, v_shape) if schedule in SPLIT_SCHEDULES else 0.0
    states = _states_gb(cluster, split, tp, cp, dp, ep, zero, shard, _unit_parameters(model, tp, ep))
    mem = dict(zip(("weights_gb", "grads_gb", "optimizer_gb"), states))
    mem["activations_gb"] = _activations_gb(parts, in_flight, schedule, pp, micro_batches, v, deferred)
    return split[0] + split[1], in_flight, mem


def _states_gb(cluster, split, tp, cp, dp, ep, zero, shard=None, unit=0.0):
    """GB of (weights, gradients, optimizer states) of a GPU holding `split` = (dense, expert) parameters at ZeRO
    level `zero`: the dense ones sharded over `shard` of the DP x CP ranks (None: all), the experts over their EDP
    ranks (HSDP is not applied to them); ZeRO-2 and 3 hold one unit's full gradient while it is reduce-scattered,
    ZeRO-3 two units' parameters (the one computing, the next one prefetched), `unit` = `_unit_parameters`."""
    shared, experts = split
    params = shared + experts
    weight_bytes, grad_bytes, optimizer_bytes = _state_bytes(cluster)
    shard = (shard or dp * cp) if zero else 1
    expert_shards = expert_shard(cluster, tp, cp, dp, ep) if zero else 1
    optimizer = (optimizer_bytes * shared / shard + optimizer_bytes * experts / expert_shards) / GB
    if zero < 2:
        return weight_bytes * params / GB, grad_bytes * params / GB, optimizer
    grads = (grad_bytes * shared / shard + grad_bytes * experts / expert_shards + grad_bytes * unit) / GB
    if zero < 3:
        return weight_bytes * params / GB, grads, optimizer
    weights = (weight_bytes * shared / shard + weight_bytes * experts / expert_shards + 2 * weight_bytes * unit) / GB
    return weights, grads, optimizer


def _activations_gb(parts, in_flight, schedule="1f1b", pp=1, micro_batches=1, v=1, deferred=0.0):
    """GB of activations. 1F1B and interleaved: stage 0's, `in_flight` micro-batches. ZB-H1: the most of any rank r,
    k chunks of its layers' kept activations A and d deferred W's of A_w each (`in_flight_chunks`, per chunk A / v and
    A_w / v; rank 0 defers none, so it holds what it holds under the schedule's base order), plus max(0, A_w - A):
    right after each B one chunk is already a deferred W and the next F has not run (with A_w > A, as under full
    recomputation, that instant is the peak). Stage 0 also holds the embedding's masks and, without a pipeline, the
    logits; its layers stand for every stage's (L/p each). A V schedule: the most of `v_activation_points` (per chunk
    A / 2 and A_w / 2), rank 0's 2p embedding masks (chunk 0's micro-batches in flight there) and its logits."""
    kept, working, embedding, logits = parts
    if schedule in V_SCHEDULES:
        most = max(k * kept / v + d * deferred / v for k, d in v_activation_points(schedule, pp))
        return (most + working + embedding * 2 * pp + logits) / GB
    first = kept * in_flight + working + embedding * in_flight + logits
    if schedule != "zb-h1":
        return first / GB
    chunks = in_flight_chunks(schedule, pp, micro_batches, v)
    most = first
    for r in _zb_candidate_ranks(pp, micro_batches, v):
        most = max(most, kept * chunks[r][0] / v + deferred * chunks[r][1] / v + working)
    return (most + max(0.0, (deferred - kept) / v)) / GB


# ---- each rank's peak, instant by instant: what train_gpt.py holds during a step --------------------------
# The peak of a rank is the most its live tensors hold at any instant of a step after the first (the optimizer's
# states exist then), the maximum over the instants where it can peak, not a sum of separate maxima. Per rank
# (pipeline stage r; every TP, CP and DP rank of a stage holds as much, EP ranks at the stated load factor F):
#     states      parameters P_r at e bytes (e = 2 for 16-bit, 4 FP32), FP32 main grads 4 P_r (grad_bytes 2:
#                 16-bit gradients 2 P_r), optimizer states: an FP32 master where e < 4 and Adam's two moments,
#                 4 + 8 (grad_bytes 2: + 4, the FP32 gradient copy), sharded over k ranks by ZeRO-1; ZeRO-2 and 3
#                 shard the blocks' main grads and, ZeRO-3, their weights (the embedding, the final LayerNorm and
#                 the LM head keep ZeRO-1's treatment); the batch's token ids, 8 B (s + 1) (and CP's shards of them)
#     a chunk     what one micro-batch keeps through one model chunk (L / (p v) blocks) until its backward B, per
#                 block with X = T_h h e the residual stream (T = b s / c tokens of this CP rank, T_h = T / t under
#                 SP), Q = T h e / t, KV = T h_kv e / t:
#                   block input, LayerNorm outputs, the two residual sums  4 X (each the next one's input)
#                   attention: Q, K, V and the output Q + 2 KV + Q, the log-sum-exp T a / t x 4 (a fused kernel
#                     keeps no scores; unfused: the softmax a T s e / t, and with dropout its mask and output),
#                     one more Q under CP (the output is copied for the projection)
#                   MLP: the GeLU's input and output 8 T h e / t; LayerNorm statistics 4 T_h e_ln (e_ln = 4 on
#                     CUDA, e on CPU); dropout: 2 T_h h mask bytes
#                   MoE block: its attention as above, and on T_m = T / t tokens with R = T_m k copies of which
#                     F R reach this rank's experts: router probabilities 3 T_m E 4, routing 2 T_m 4 + T_m k
#                     (28 + e) + 16 F R, the expert rows F R h e and activations 2 F R f e, the combined copies
#                     2 R h e
#                   full recomputation keeps each block's input X; selective drops the log-sum-exp (or the
#                   scores); offload keeps only what outside the blocks needs (the input of the final LayerNorm)
#                   NVFP4 (train_gpt.py's emulated GEMMs, the blocks before the last --nvfp4-bf16-last): each
#                   linear's quantised weight, N K + N K / 256 + 4 bytes (E2M1 in a byte, E4M3 and FP32 scales)
#                 the first virtual stage adds the embedding's output (X; under TP its masks T 9), the last its
#                 LM head's: the final LayerNorm X + 2 T_h e_ln and the loss's FP32 softmax N V / t x 4 (N = T)
#     buffers     every receive posted and not yet read, and the received inputs of chunks in flight, X each;
#                 each output sent and not yet freed (X); under ZB-H1 each chunk whose W waits keeps every linear's
#                 input and output gradient (`deferred_w_bytes`), and the graph to its received input and its grad
#     instants    (F) the end of a forward, with the LM head's logits N V e / t and the loss's FP32 copies on the
#                 last virtual stage; (B) the start of a backward: the cross-entropy's backward (t = 1: two more FP32
#                 N V; t > 1: the gradient N V e / t), the LM head's backward (the logits' gradient, the gathered
#                 input and its gradient), or the top block's MLP backward (the GeLU output's gradient 4 T h e / t and
#                 the second MLP weight's gradient 4 h^2 e / t; under ZB-H1 the GeLU's input gradient instead); the
#                 gradient that comes in (X); full recomputation recomputes one block; offload brings one block's
#                 tensors back (two on CUDA: the next one is prefetched); the unfused attention's backward, its
#                 scores' gradients 2 a T s e / t (selective: beside the probabilities and masks redone); NVFP4: the
#                 highest NVFP4 block's emulated weight-gradient GEMM, 3 (T/16) N K 4 of partial products beside the
#                 FP32 operands, their Hadamard transforms and quantised copies; (S) the optimizer step: Adam's
#                 temporaries, 4 B per parameter of its largest group (torch's foreach AdamW on CUDA), or 12 B per
#                 element of the largest parameter (the single-tensor form on CPU)
#     ZeRO        ZeRO-2 and 3 hold one block's FP32 gradient and its reduce-scatter output in flight, (4 + 4/k)
#                 P_block; ZeRO-3 two blocks' gathered weights in a forward, one in a backward
# Which instants a rank passes through, with how many chunks in flight, receives posted and sends not yet freed,
# comes from replaying its executor's list (train_gpt.py's `run_schedule` and `Pipeline`: a receive is posted one
# action ahead, with every earlier message of the same peer; a send is freed once a later message from the peer
# shows that it posted the matching receive). The planner (_PlanMemory) prices the same instants with the
# schedules' closed-form counts (in_flight_chunks) instead of the replay: equal under 1F1B, at most a few X above
# otherwise, and for ZB-V and DualPipeV, which rank_peaks does not replay, a bound at v_activation_points. Left out
# (MEMORY_HEADROOM keeps them): the allocator's cache and fragmentation, the CUDA context and workspaces, the
# communication backend's own buffers, a kernel's scratch.

MEMORY_PARTS = ("weights", "main grads", "optimizer states", "activations", "LM head and loss", "backward",
                "receive buffers", "ZeRO gathered", "ZeRO grad buffers", "step temporaries", "other")
PROGRAM_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 2, "nvfp4": 2, "float64": 8}


@dataclass(frozen=True)
class Program:
    """What the training program does beyond the model, the layout and the knobs, with train_gpt.py's names: its
    --dtype (the weights' and activations' bytes e; FP32 masters and main grads below 32 bits), the device whose
    kernels it runs (CUDA: FP32 LayerNorm statistics, torch's foreach AdamW; CPU: the single-tensor AdamW), its
    --optimizer (adamw, or sgd: no state but the master) and --cp-impl (None: ring, Ulysses or hybrid as the
    Ulysses size says). The Cluster's flash_attention, dropout and grad_bytes describe other programs."""
    dtype: str = "bfloat16"
    device: str = "cuda"
    optimizer: str = "adamw"
    cp_impl: str = None
    nvfp4_bf16_last: int = None  # --dtype nvfp4: the last K blocks stay BF16 (None: the last 15 %, rounded)

    def __post_init__(self):
        if self.dtype not in PROGRAM_DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; choose one of {', '.join(PROGRAM_DTYPES)} (--dtype)")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device={self.device!r}; choose cuda or cpu (--device)")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer={self.optimizer!r}; choose adamw or sgd (--optimizer)")


class _Action(NamedTuple):
    kind: str
    micro: int
    chunk: int = 0


def _order_1f1b(p, m, r):
    warmup = min(p - r - 1, m)
    steady = [x for j in range(m - warmup) for x in (_Action("F", warmup + j), _Action("B", j))]
    return [_Action("F", i) for i in range(warmup)] + steady + [_Action("B", j) for j in range(m - warmup, m)]


def _order_interleaved(p, m, v, r):
    def place(k, forward):
        group, within = divmod(k, p * v)
        return group * p + within % p, within // p if forward else v - 1 - within // p
    total, warmup = m * v, min((p - r - 1) * 2 + (v - 1) * p, m * v)
    steady = [x for k in range(total - warmup) for x in (_Action("F", *place(warmup + k, True)),
                                                          _Action("B", *place(k, False)))]
    return ([_Action("F", *place(k, True)) for k in range(warmup)] + steady
            + [_Action("B", *place(k, False)) for k in range(total - warmup, total)])


def _order_zero_bubble(order, r):
    out, waiting = [], []
    steady_ends = max(i for i, x in enumerate(order) if x.kind == "F")
    for i, x in enumerate(order):
        out.append(x)
        if x.kind == "B":
            waiting.append(_Action("W", x.micro, x.chunk))
            if len(waiting) > (r if i < steady_ends else 0):
                out.append(waiting.pop(0))
    return out + waiting


def pipeline_order(schedule, p, m, v, r):
    """Rank r's list of actions as train_gpt.py's executor runs it: F (a micro-batch's forward through a chunk), B
    (its backward; the input gradients only under zb-h1) and W (zb-h1's weight gradients). A copy of train_gpt.py's
    SCHEDULES (this file imports no other file of the repository; tests/test_memory.py checks that they agree)."""
    order = _order_interleaved(p, m, v, r) if v > 1 else _order_1f1b(p, m, r)
    if schedule == "zb-h1":
        return _order_zero_bubble(order, r)
    if schedule not in ("1f1b", "interleaved"):  # ZB-V, DualPipeV: the planner's counts bound them (_PlanMemory)
        raise ValueError(f"pp_schedule={schedule!r}: rank by rank, the memory model replays 1f1b, interleaved and "
                         "zb-h1; `topology.py plan` bounds the V schedules")
    return order


def _virtual_stage(p, r, chunk, v_shape=False):
    """The virtual stage of rank r's chunk: chunk c of rank r is stage c p + r (interleaved placement); in a V
    (`v_shape`: ZB-V, DualPipeV) chunk 0 is stage r and chunk 1 stage 2p - 1 - r."""
    return (2 * p - 1 - r if chunk else r) if v_shape else chunk * p + r


def _chunk_kind(stages, vs):
    """The kind of virtual stage vs of `stages`: what it holds beyond its blocks (CHUNK_KINDS)."""
    return "only" if stages == 1 else "first" if vs == 0 else "last" if vs == stages - 1 else "middle"


class Held(NamedTuple):
    """What a rank holds while one action runs (counts): the chunks whose activations wait for their B, by kind
    (CHUNK_KINDS), the chunks whose W waits (zb-h1), the receives posted and not yet read, the outputs and input
    gradients sent and not yet freed; and the action (F at its end, B and W at their start) and its chunk's kind."""
    action: str
    kind: str
    kept: tuple
    waiting: tuple
    posted: int
    sent_outputs: int
    sent_grads: int
    reduced: bool = False  # a block's gradients were reduce-scattered before (ZeRO-2/3: one is in flight)


# a chunk's kind: the first virtual stage (with the embedding), the last (with the LM head), both (one stage), another
CHUNK_KINDS = ("first", "middle", "last", "only")


def _memory_micro_batches(p, m, v):
    """The micro-batches a replay needs: a rank's states repeat once its list is in its steady state, so 2 p of
    them (a multiple of p with v > 1) give every distinct state of m (tests/test_memory.py checks it on a grid)."""
    return min(m, 2 * p) if v == 1 else p * min(m // p, 2)


@functools.lru_cache(maxsize=8192)
def pipeline_holdings(schedule, p, m, v, r):
    """The distinct Held states rank r passes through in one step, each with the first (action, micro-batch,
    chunk) that reaches it (`_pipeline_holdings_of` on the micro-batches that show them all)."""
    return _pipeline_holdings_of(schedule, p, _memory_micro_batches(p, m, v), v, r)


def _pipeline_holdings_of(schedule, p, m, v, r):
    """Rank r's list replayed as train_gpt.py's executor runs it (its `Pipeline`): before each action the next
    action's receive is posted, with every earlier message of the same peer (in that peer's sending order); a sent
    tensor is freed once a message from its peer shows, by its sender's place in the peer's list, that the peer
    posted the matching receive (the peer posts the next action's receive before each action)."""
    stages = p * v
    neighbours = {q: pipeline_order(schedule, p, m, v, q) for q in {r, (r - 1) % p, (r + 1) % p}}
    where = {q: {x: i for i, x in enumerate(order)} for q, order in neighbours.items()}

    def peer(q, x, step):  # (rank, index in its list) of the action that x sends to (step 1) or reads from (-1)
        vs = _virtual_stage(p, q, x.chunk) + (step if x.kind == "F" else -step)
        if x.kind == "W" or not 0 <= vs < stages:
            return None
        return vs % p, where[vs % p][_Action(x.kind, x.micro, vs // p)]

    incoming = {}  # peer -> the actions of rank r that read its messages, in its sending order
    for q in {(r - 1) % p, (r + 1) % p}:
        for x in neighbours[q]:
            vs = _virtual_stage(p, q, x.chunk) + (1 if x.kind == "F" else -1)
            if x.kind != "W" and 0 <= vs < stages and vs % p == r:
                incoming.setdefault(q, []).append(_Action(x.kind, x.micro, vs // p))
    posted, posted_by, sending, saved, waiting, states = set(), {}, [], {}, {}, {}
    kept, waits = [0] * len(CHUNK_KINDS), [0] * len(CHUNK_KINDS)  # chunks in flight, W's waiting, by kind
    reduced = False

    def post(x):
        src = peer(r, x, -1)
        while src is not None and x not in posted:
            posted.add(incoming[src[0]].pop(0))

    order = neighbours[r]
    for i, x in enumerate(order):
        if i + 1 < len(order):
            post(order[i + 1])
        src = peer(r, x, -1)
        if src is not None:
            post(x)
            posted.discard(x)
            posted_by[src[0]] = max(posted_by.get(src[0], -1), src[1] + 1)
        vs, key = _virtual_stage(p, r, x.chunk), (x.chunk, x.micro)
        kind = 3 if stages == 1 else 0 if vs == 0 else 2 if vs == stages - 1 else 1  # CHUNK_KINDS' index
        if x.kind == "F":
            saved[key] = kind
            kept[kind] += 1
        outputs = sum(1 for s in sending if s[2] == "F")
        held = Held(x.kind, CHUNK_KINDS[kind], tuple(kept), tuple(waits), len(posted), outputs,
                    len(sending) - outputs - sum(1 for s in sending if s[2] == "B" and s[3] in waiting), reduced)
        states.setdefault(held, (x.kind, x.micro, x.chunk))
        reduced = reduced or x.kind == ("W" if schedule == "zb-h1" else "B")
        if x.kind == "B":
            kept[saved.pop(key)] -= 1
            if schedule == "zb-h1":
                waiting[key] = kind
                waits[kind] += 1
        elif x.kind == "W":
            waits[waiting.pop(key)] -= 1
        to = peer(r, x, 1)
        if to is not None:
            sending.append((to[0], to[1], x.kind, key))
        if sending:
            sending = [s for s in sending if s[1] > posted_by.get(s[0], -1)]
    return tuple(states.items())


class _StepBytes:
    """The sizes a step's tensors are made of, in bytes, for one layout and its knobs (the comment above)."""

    def __init__(self, cluster, model, layout, knobs, program):
        self.model, self.layout, self.knobs, self.program, self.cluster = model, layout, knobs, program, cluster
        e = self.e = PROGRAM_DTYPES[program.dtype]
        self.acc = 8 if program.dtype == "float64" else 4  # FP32, or float64 for float64 runs
        self.e_ln = e if program.device == "cpu" else max(e, 4)  # LayerNorm statistics: FP32 on CUDA
        t, c, b = layout.tp, layout.cp, knobs.micro_batch
        self.t, self.c, self.p, self.v = t, c, layout.pp, knobs.virtual_stages
        self.h, self.a, self.s, self.V = model.hidden, model.heads, model.seq, model.vocab
        self.sp = knobs.sequence_parallel and t > 1
        self.T = T = b * model.seq // c                  # tokens of one micro-batch on this CP rank
        self.Th = T // t if self.sp else T                # ... between the TP regions
        self.X = self.Th * self.h * e                     # the residual stream: a block's input or output
        self.Q = T * self.h // t * e
        self.KV = T * _kv_width(model) // t * e
        self.m = model.global_batch // (layout.dp * b)
        self.policy = recomputation(knobs.recompute)
        self.offload = knobs.recompute in OFFLOAD_POLICIES
        self.layers = model.layers // (self.p * self.v)
        # sqrt (checkpointing.py's): segments of round(sqrt(n)) of a chunk's n blocks, each keeping its input
        self.segment = max(1, round(math.sqrt(self.layers))) if self.policy == "sqrt" else 1
        self.cp_impl = program.cp_impl or "ring"  # the planner's CP: zigzag shards whatever its Ulysses size
        self.zigzag = c > 1 and self.cp_impl != "ulysses"  # the zigzag shards are copies (the others views)
        self.flash, self.dropout = cluster.flash_attention, getattr(cluster, "dropout", False)
        # NVFP4 (train_gpt.py's emulated GEMMs): the blocks before the last K, the rest BF16 as the LM head
        bf16_last = program.nvfp4_bf16_last if program.nvfp4_bf16_last is not None else round(0.15 * model.layers)
        self.nvfp4_below = model.layers - bf16_last if program.dtype == "nvfp4" else 0

    def nvfp4_linears(self, moe):
        """(N, K) of each NVFP4 linear of a block on this rank (a MoE block's experts stay BF16)."""
        h, kv, t = self.h, _kv_width(self.model), self.t
        linears = [((h + 2 * kv) // t, h), (h, h // t)]
        return linears + ([] if moe else [(4 * h // t, h), (h, 4 * h // t)])

    def nvfp4_kept(self, moe):
        """What an NVFP4 block keeps besides its BF16 activations: each linear's weight as quantised, its E2M1
        elements in one byte each, its E4M3 block scales (one per 16 x 16) and FP32 tensor scale."""
        return sum(n * k + n * k // 256 + 4 for n, k in self.nvfp4_linears(moe))

    def nvfp4_backward(self, n, k):
        """An NVFP4 linear's emulated backward at its largest moment (the weight gradient's GEMM, emulated by the
        token blocks' exact products in FP32, scaled twice: 3 (M/16) N K 4 for M tokens): beside them G in FP32, G^T
        and x^T Hadamard-transformed, the quantised G, G^T, x^T (FP32 values, E4M3 scales) and W (quantised again),
        the input's gradient, and the two block scales' FP32 copies and the emulation's expansions of them."""
        m, e = self.T, self.e
        return (3 * (m // 16) * n * k * 4 + 16 * m * n + 8 * m * k + 4 * n * k + e * m * k + 8 * (n + k) * m // 16
                + 2 * m * n // 16 + k * m // 16 + n * k // 256)

    def nvfp4_instant(self, above):
        """By part, beyond a chunk's kept bytes and what came in: the backward of its highest NVFP4 block, the BF16
        blocks over it keeping `above` bytes (their backward done: those and the NVFP4 block's output freed), at its
        first MLP GEMM's weight gradient: the GeLU's input and output and the second GEMM's quantised weight are freed,
        the GeLU's input gradient, the block's output gradient (the block above's input gradient) and the
        emulation's working set are there."""
        h, t, T, e = self.h, self.t, self.T, self.e
        fc2 = h * 4 * h // t + h * 4 * h // t // 256 + 4
        freed = above + 8 * T * h // t * e + fc2
        return {"activations": -freed,
                "backward": 4 * T * h // t * e + (self.X if above else 0) + self.nvfp4_backward(4 * h // t, h)}

    def layers_of(self, v):
        """Blocks per chunk with v chunks per stage."""
        return self.model.layers // (self.p * v)

    # -- one micro-batch through one block --
    def attention(self, policy):
        """What a block's attention keeps for its backward, its input and LayerNorm aside."""
        h, a, t, T, e = self.h, self.a, self.t, self.T, self.e
        out = self.Q + 2 * self.KV + self.Q + (self.Q if self.c > 1 else 0)
        if self.cp_impl == "allgather" and self.c > 1:  # the whole sequence's K and V, gathered
            out += 2 * (self.c - 1) * self.KV
        if self.flash:
            return out + (0 if policy == "selective" else a // t * T * self.acc)
        scores = a // t * T * self.s  # this rank's queries against every key
        return out + (0 if policy == "selective" else scores * (e + (e + 1 if self.dropout else 0)))

    def moe_terms(self):
        """A MoE layer's (kept, backward working set) on T_m = T / t tokens, R = T_m k copies, F R of them here."""
        if not hasattr(self, "_moe"):
            self._moe = self._moe_terms()
        return self._moe

    def _moe_terms(self):
        model, e, h = self.model, self.e, self.h
        Tm, k, E = self.T // self.t, model.top_k, model.experts
        R = Tm * k
        Rh = moe_load_factor(model, self.layout.ep) * R
        f, gates = expert_hidden(model), 2 if model.swiglu else 1
        router = 3 * Tm * E * 4 + 2 * Tm * 4 + Tm * k * (8 + 4 + e) + 8 * (E + 1)
        routing = 2 * Tm * k * 8 + (2 * Rh * 8 if self.layout.ep > 1 else 0)
        experts = Rh * h * e + (gates + 1) * Rh * f * e
        combine = R * h * e * (2 if self.layout.ep > 1 else 1)
        shared = (gates + 1) * Tm * model.shared_expert_hidden * e + (Tm * h * e if model.shared_expert_hidden else 0)
        kept = Tm * h * e + router + routing + experts + combine + shared
        local = E // self.layout.ep
        working = Rh * f * e + local * f * h * e + Rh * h * e
        return kept, working

    def moe_combined(self):
        """What a MoE layer's backward frees before its experts' backward: the combined copies (and, with EP, the
        rows the combine received)."""
        R = self.T // self.t * self.model.top_k
        return R * self.h * self.e * (2 if self.layout.ep > 1 else 1)

    def block(self, moe, policy=None, offloaded=None):
        """Bytes one block keeps for its backward, its output (the next block's input) included, its input not; on
        the device: nothing under an offload policy (`offloaded` False: what it keeps, wherever)."""
        key = (moe, policy, offloaded)
        cache = self.__dict__.setdefault("_blocks", {})
        if key not in cache:
            cache[key] = self._block(moe, policy, offloaded)
        return cache[key]

    def _block(self, moe, policy, offloaded):
        policy = policy or self.policy
        if self.offload if offloaded is None else offloaded:
            return 0
        if policy in ("full", "sqrt"):
            return self.X
        h, t, T, e = self.h, self.t, self.T, self.e
        masks = 2 * self.Th * h if self.dropout else 0
        mlp = self.moe_terms()[0] - T // t * h * e if moe else 8 * T * h // t * e
        return 4 * self.X + self.attention(policy) + mlp + 4 * self.Th * self.e_ln + masks

    def chunk(self, kind, moe_layers, layers=None):
        """What one micro-batch keeps through a chunk of `kind` of `layers` blocks (default: the knobs'), `moe_layers`
        of them MoE blocks, by part."""
        layers = self.layers if layers is None else layers
        first, last = kind in ("first", "only"), kind in ("last", "only")
        X = self.X
        blocks = (layers - moe_layers) * self.block(False) + moe_layers * self.block(True)
        if self.policy == "sqrt":  # the segments' inputs (and the chunk's output)
            blocks = -(-layers // self.segment) * self.X
        act = (X if last else 0) + 8 if self.offload else blocks - (0 if last else X) + 8
        out = {"activations": act}
        if first:
            out["activations"] += (0 if self.offload else X) + (9 * self.T if self.t > 1 else 0)
            out["activations"] += self.Th * self.h if self.dropout else 0
        else:
            out["receive buffers"] = X
        if last:
            out["LM head and loss"] = self.head()
        return out

    # -- the LM head and the loss --
    def head(self):
        """The final LayerNorm's output and statistics, the loss's FP32 softmax (t > 1: and its indices)."""
        N, V, t = self.T, self.V, self.t
        loss = N * V * self.acc if t == 1 else N * V // t * self.acc + 9 * N
        return self.X + 2 * self.Th * self.e_ln + loss + 28

    def head_forward(self):
        """At the loss's largest moment, beyond head(): the logits and the FP32 copies the loss makes of them."""
        N, V, t, e = self.T, self.V, self.t, self.e
        targets = 0 if self.zigzag else 8 * N  # the targets made contiguous for the loss
        if t == 1:
            return N * V * e + (N * V * 4 if e < 4 else 0) + N * self.acc + targets
        return N * V // t * (e + 4) + 4 * N + targets - 9 * N

    def ce_backward(self):
        """The cross-entropy's backward, beyond head(): t = 1 two more FP32 N x V (the gradients of the NLL and of
        the log-softmax); t > 1 the logits' gradient in e (the FP32 softmax becomes the gradient in place)."""
        N, V, t, e = self.T, self.V, self.t, self.e
        if t == 1:
            return 2 * N * V * self.acc
        return N * V // t * e if e != self.acc else 0

    def head_backward(self):
        """The LM head's backward, beyond head() less the loss's softmax: the logits' gradient, the GEMM's input
        gradient and (t = 1 or no SP) the weight's; under SP the input gathered again and the scattered gradient."""
        N, V, t, e, h, T = self.T, self.V, self.t, self.e, self.h, self.T
        softmax = N * V // t * self.acc
        if t == 1:
            return N * V * e + T * h * e + V * h * e - softmax
        if self.sp:
            return N * V // t * e + 3 * T * h * e + self.X - softmax - 9 * N
        return N * V // t * e + T * h * e + V // t * h * e - softmax - 9 * N

    # -- backward --
    def block_backward(self, moe):
        """The top block's backward at its largest moment, MLP first (the gradient that came in aside)."""
        h, t, T, e = self.h, self.t, self.T, self.e
        zb = self.knobs.pp_schedule in SPLIT_SCHEDULES
        if moe:
            work = self.moe_terms()[1]
        elif zb:  # W deferred: the GeLU output waits for it while the GeLU's input gradient is made
            work = 2 * T * 4 * h // t * e
        else:
            work = T * 4 * h // t * e + 4 * h // t * h * e + (h * e if t == 1 else 0)
        if self.sp:
            work += T * h * e  # the gradient gathered over TP for the row-parallel GEMM
        if self.policy in ("full", "sqrt"):  # the block (sqrt: the segment) recomputed, its input aside
            work += self.segment * self.block(moe, "none") - self.X
        if self.offload:  # the block's saved tensors back on the device (on CUDA the next block's prefetched too)
            work += (2 if self.program.device == "cuda" else 1) * self.block(moe, offloaded=False)
        return work

    def waiting_w(self, kind, moe_layers, layers=None):
        """zb-h1: what a chunk whose W waits holds, by part: every deferred linear's input (under SP the input
        gathered over TP) and output gradient; the top block's second MLP GEMM keeps the gradient that came in; the
        graph kept by the linears' inputs keeps the received input and its gradient (`deferred_w_bytes`)."""
        layers = self.layers if layers is None else layers
        h, t, T, e, X = self.h, self.t, self.T, self.e, self.X
        first, last = kind in ("first", "only"), kind in ("last", "only")
        whole = T * h * e  # a whole-token tensor
        ln_in = {"backward": whole} if self.sp else {"activations": X}
        attention = _add(ln_in, {"activations": T * h // t * e},
                         {"backward": T * 3 * h // t * e + (whole if self.sp else X)})
        mlp = _add(ln_in, {"activations": T * 4 * h // t * e}, {"backward": T * 4 * h // t * e + X})
        out = _add(_scale(attention, layers), _scale(mlp, layers - moe_layers))
        out["backward"] -= X  # the top block's incoming gradient is the head's or a received one
        out = _add(out, {"LM head and loss": X} if last else {"receive buffers": X})
        if not first:
            out = _add(out, {"receive buffers": X, "backward": X})
        if last:
            out = _add(out, {"LM head and loss": (whole if self.sp else X) + self.T * self.V // t * e})
        return out

    def came_in(self, kind):
        """What a chunk's blocks' backward starts from: on the last stage the loss and the final LayerNorm are done
        (their tensors and the LayerNorm's input freed, its input's gradient there, and on one stage the tied
        embedding's gradient waiting), elsewhere the gradient received."""
        if kind not in ("last", "only"):
            return {"receive buffers": self.X}
        one = self.p * self.v == 1 or self.knobs.pp_schedule in V_SCHEDULES  # both ends on one rank
        tied = self.V // self.t * self.h * self.e if one and self.model.tied_embeddings else 0
        return {"LM head and loss": self.X - self.head() + tied, "activations": -self.X}

    def action_parts(self, action, kind, moe, layers=None):
        """What the running action adds at its largest moments beyond the chunks and buffers held: F at its end
        (the loss on the last virtual stage), B at the cross-entropy's backward, the LM head's and the top block's
        (`moe`: a MoE block); a list of parts, one per moment."""
        layers = self.layers if layers is None else layers
        if action == "F":
            head = kind in ("last", "only")
            return [{"LM head and loss": self.head_forward()} if head else {"activations": 2 * self.X}]
        if action != "B":
            return [{}]
        out = []
        if kind in ("last", "only"):
            out += [{"LM head and loss": self.ce_backward()}, {"LM head and loss": self.head_backward()}]
        done = {"activations": -self.moe_combined()} if moe and not self.offload else {}
        block = _add(self.came_in(kind), done, {"backward": self.block_backward(moe)})
        out.append(block)
        if self.offload and layers > 1:  # the blocks below: the gradient received is still held, one more comes
            out.append(_add(block, {"backward": self.X}))
        if not self.flash:  # the unfused attention's backward: the scores' and probabilities' gradients (selective:
            # beside the probabilities and dropout masks recomputed), the top block's MLP done
            scores = self.a // self.t * self.T * self.s
            again = scores * (self.e + (1 if self.dropout else 0)) if self.policy == "selective" else 0
            out.append(_add(self.came_in(kind), done, {"backward": 2 * scores * self.e + again}))
        return out


def _add(*parts):
    out = {}
    for part in parts:
        for key, value in part.items():
            out[key] = out.get(key, 0) + value
    return out


def _scale(part, n):
    return {key: value * n for key, value in part.items()}


def _rank_layers(model, p, v, r, v_shape=False):
    """The global indices of rank r's blocks, chunk after chunk (chunk c holds virtual stage `_virtual_stage`)."""
    per = model.layers // (p * v)
    return [(_virtual_stage(p, r, c, v_shape)) * per + i for c in range(v) for i in range(per)]


def _is_moe(model, layer):
    return bool(model.moe_every) and (layer + 1) % model.moe_every == 0


class _Param(NamedTuple):
    """One parameter tensor of a rank: its elements, whether it is 2-D (the decayed group), its block (None: the
    embedding, the final LayerNorm, the LM head) and its gradient's group (dense, tied or expert)."""
    elements: int
    matrix: bool
    block: object
    group: str


def _block_parameters(model, layout, moe, i=0):
    """One block's parameter tensors on a rank (`_Param`s, block index i), in train_gpt.py's order: LayerNorms,
    QKV, projection (weights split over TP), LayerNorms, then the MLP (split over TP) or the router and the rank's
    E / ep experts, whole."""
    h, kv, t, f = model.hidden, _kv_width(model), layout.tp, expert_hidden(model)
    vector = lambda n: _Param(n, False, i, "dense")  # noqa: E731
    matrix = lambda n, group="dense": _Param(n, True, i, group)  # noqa: E731
    params = [vector(h), vector(h), matrix((h + 2 * kv) * h // t), vector((h + 2 * kv) // t), matrix(h * h // t),
              vector(h), vector(h), vector(h)]
    if moe:
        local = model.experts // layout.ep
        params += [matrix(model.experts * h), matrix(local * h * f * (2 if model.swiglu else 1), "expert"),
                   matrix(local * f * h, "expert")]
        if model.shared_expert_hidden:
            params += [matrix((3 if model.swiglu else 2) * h * model.shared_expert_hidden // t)]
    else:
        params += [matrix(4 * h * h // t), vector(4 * h // t), matrix(4 * h * h // t), vector(h)]
    return params


def _outer_parameters(model, layout, r, v_shape=False):
    """The rank's parameters outside the blocks: the token embedding and positions (first stage), the final
    LayerNorm and the LM head (last stage; the tied embedding's copy, or its own weight when untied). In a V
    (`v_shape`) rank 0 holds both ends, the tied embedding once."""
    h, t = model.hidden, layout.tp
    one = layout.pp == 1 or v_shape  # both ends on one rank
    tied = "tied" if not one and model.tied_embeddings else "dense"
    params = []
    if r == 0:
        params += [_Param(model.vocab // t * h, True, None, tied), _Param(model.seq * h, True, None, "dense")]
    if r == (0 if v_shape else layout.pp - 1):
        params += [_Param(h, False, None, "dense"), _Param(h, False, None, "dense")]
        if not one or not model.tied_embeddings:
            params += [_Param(model.vocab // t * h, True, None, tied)]
    return params


def _rank_parameters(model, layout, r, v, v_shape=False):
    """Every parameter tensor on one rank of stage r, in train_gpt.py's order (`_Param`): its blocks' (QKV, the
    projection's and the MLP's weights split over TP; the LayerNorms, the row-parallel biases, the router and the
    experts, E / ep of them whole, replicated), then the positions and the token embedding and the LM head, split
    over the vocabulary."""
    params = []
    for i, layer in enumerate(_rank_layers(model, layout.pp, v, r, v_shape)):
        params += _block_parameters(model, layout, _is_moe(model, layer), i)
    return params + _outer_parameters(model, layout, r, v_shape)


def _rank_parameter_summary(model, layout, r, v, v_shape=False):
    """(`_parameter_sums` of the rank's parameters, each block's elements), from one block of each kind (kept in
    the plan's layout.memo under the TP and EP sizes)."""
    layers = _rank_layers(model, layout.pp, v, r, v_shape)
    moe = [_is_moe(model, i) for i in layers]
    kinds = {}
    for kind in set(moe):
        key = ("block sums", layout.tp, layout.ep, kind)
        if key not in layout.memo:
            params = _block_parameters(model, layout, kind)
            layout.memo[key] = sum(p.elements for p in params), _parameter_sums(params)
        kinds[kind] = layout.memo[key]
    per_block = {kind: elements for kind, (elements, _) in kinds.items()}
    sums, count = _parameter_sums(_outer_parameters(model, layout, r, v_shape))
    for kind, (_, (block_sums, block_count)) in kinds.items():
        n = moe.count(kind)
        for key, elements in block_sums.items():
            sums[key] = sums.get(key, 0) + n * elements
        count += n * block_count
    return (sums, count), [per_block[kind] for kind in moe]


def _optimizer_pieces(params, zero, shard, edp):
    """What the inner optimizer steps on one rank, per parameter, for each position in the shard group: the whole
    parameter (ZeRO-0), or its part of this rank's 1/k of its bucket (mixed_precision.py's flat buffers: one per
    gradient group, and at ZeRO-2/3 one per block and group, each padded to a multiple of its k ranks)."""
    if not zero:
        return [[p.elements for p in params]]
    buckets = {}
    for i, p in enumerate(params):
        unit = p.block if zero >= 2 else None
        buckets.setdefault((unit, p.group), []).append(i)
    positions = max(shard, edp)
    out = [[0] * len(params) for _ in range(positions)]
    for (_, group), members in buckets.items():
        k = edp if group == "expert" else shard
        total = sum(params[i].elements for i in members)
        size = -(-total // k)
        start = 0
        for i in members:
            n = params[i].elements
            for s in range(positions):
                lo, hi = (s % k) * size, (s % k + 1) * size
                out[s][i] = max(0, min(start + n, hi) - max(start, lo))
            start += n
    return out


def _parameter_sums(params):
    """Elements of `params` by (in a block, expert, 2-D), and their count: what the states need of them."""
    sums = {}
    for p in params:
        key = (p.block is not None, p.group == "expert", p.matrix)
        sums[key] = sums.get(key, 0) + p.elements
    return sums, len(params)


def _rank_states(cluster, z, sums, zero, shard):
    """The parts of a rank holding parameters of `_parameter_sums` that live through the step: weights, main
    grads, optimizer states (ZeRO level `zero` over `shard` ranks of DP x CP; the experts over their EDP ranks), the
    batch's token ids and positions."""
    model, layout, program = z.model, z.layout, z.program
    (elements, count) = sums
    edp = expert_shard(cluster, layout.tp, layout.cp, layout.dp, layout.ep)
    k = (shard or layout.dp * layout.cp) if zero else 1

    def held(level, blocks_only):  # elements held when ZeRO `level` and up shard them (the blocks' only, or all)
        return sum(n / (edp if expert else k) if zero >= level and (block or not blocks_only) else n
                   for (block, expert, _), n in elements.items())
    e = z.e
    if cluster.grad_bytes == 2:  # 16-bit gradients; the optimizer keeps an FP32 copy besides its master
        grad, opt = 2, 4 + 4 + (8 if program.optimizer == "adamw" else 0)
    else:
        grad, opt = max(e, 4), (4 if e < 4 else 0) + (8 if program.optimizer == "adamw" else 0)
    out = {"weights": e * held(3, True), "main grads": grad * held(2, True),
           "optimizer states": opt * held(1, False)
           + (4 * count if program.device == "cpu" and program.optimizer == "adamw" else 0)}
    other = 8 * model.global_batch * (model.seq + 1) + 16 + 8 * (z.T // z.knobs.micro_batch if z.zigzag else model.seq)
    if z.zigzag:  # CP's shards of every micro-batch's ids and targets
        other += 16 * z.m * z.T
    out["other"] = other
    return out


def _optimizer_temporaries(program, params, zero, shard, edp, sums=None):
    """Adam's temporaries at the step. torch's foreach form (CUDA): a square root per element of its larger group
    (the 2-D weights, or the rest). The single-tensor form (CPU): per parameter a square root and a quotient, beside
    the previous parameter's quotient, at most 2 n_i + n_(i-1) elements of one group."""
    if program.optimizer != "adamw":
        return 0
    acc = 8 if program.dtype == "float64" else 4
    if program.device == "cuda":  # each group's pieces: its share of the shard group's (its experts': of EDP's)
        elements, _ = sums or _parameter_sums(params)
        share = lambda matrix: sum(n / ((edp if expert else shard) if zero else 1)  # noqa: E731
                                   for (_, expert, two_d), n in elements.items() if two_d == matrix)
        return acc * max(share(True), share(False))
    most = 0
    for pieces in _optimizer_pieces(params, zero, shard or 1, edp if zero else 1):
        for matrix in (True, False):
            group = [n for p, n in zip(params, pieces) if p.matrix == matrix]
            if program.device == "cuda":
                most = max(most, sum(group))
            else:
                most = max([most] + [2 * n + (group[i - 1] if i else 0) for i, n in enumerate(group)])
    return acc * most


class _RankStatic:
    """What rank r holds whatever the knobs but v: its parameters, blocks and layers, its chunks' kinds (with
    their MoE blocks: the most of any chunk of that kind), its top blocks, its states and optimizer step at each
    ZeRO choice; its parameters and chunks kept in `memo` (a plan's layout.memo) under tp, pp, ep, v and r."""

    def __init__(self, cluster, z, r, v, memo=None, v_shape=None):
        model, layout = z.model, z.layout
        self.cluster, self.z, self.r = cluster, z, r
        self.memo = {} if memo is None else memo
        if v_shape is None:  # the chunks of a V: stages r and 2p - 1 - r
            v_shape = z.knobs.pp_schedule in V_SCHEDULES
        self.key = ("rank", layout.tp, layout.pp, layout.ep, v, r, v_shape)  # nor the CP and DP sizes
        if self.key not in self.memo:
            params = _rank_parameters(model, layout, r, v, v_shape) if z.program.device == "cpu" else None  # CPU's
            layers = _rank_layers(model, layout.pp, v, r, v_shape)
            sums, blocks = _rank_parameter_summary(model, layout, r, v, v_shape)
            per, stages, kinds, tops = len(layers) // v, layout.pp * v, {}, []
            for c in range(v):
                kind = _chunk_kind(stages, _virtual_stage(layout.pp, r, c, v_shape))
                kinds[kind] = max(kinds.get(kind, 0), sum(_is_moe(model, i) for i in layers[c * per:(c + 1) * per]))
                tops.append((_is_moe(model, layers[(c + 1) * per - 1]), blocks[(c + 1) * per - 1]))
            self.memo[self.key] = (params, layers, blocks, kinds, tops, sums, max(blocks, default=0),
                                   max(tops, default=(False, 0)))
        (self.params, self.layers, self.blocks, self.kinds, self.tops, self.sums, self.unit,
         self.top) = self.memo[self.key]
        self.by_zero = {}  # (states by part, their sum, the step's temporaries) by ZeRO choice, for this layout

    def states(self, zero, shard):
        return self.fixed(zero, shard)[0]

    def states_total(self, zero, shard):
        return self.fixed(zero, shard)[1]

    def step(self, zero, shard):
        return self.fixed(zero, shard)[2]

    def fixed(self, zero, shard):
        """(states by part, their sum, the optimizer step's temporaries) at a ZeRO choice (the batch's ids and
        positions do not depend on b; the program is one per plan)."""
        if (zero, shard) not in self.by_zero:
            states = _rank_states(self.cluster, self.z, self.sums, zero, shard)
            layout = self.z.layout
            edp = expert_shard(self.cluster, layout.tp, layout.cp, layout.dp, layout.ep)
            k = (shard or layout.dp * layout.cp) if zero else 1
            step = _optimizer_temporaries(self.z.program, self.params, zero, k, edp, self.sums)
            self.by_zero[(zero, shard)] = states, sum(states.values()), step
        return self.by_zero[(zero, shard)]

    def zero_extras(self, zero, shard, gathered, z, in_flight=True):
        """The ZeRO level's bytes at an instant: one block's FP32 gradient and its reduce-scatter output in flight
        (ZeRO-2/3, once a block was reduced), the block gathered in a backward (ZeRO-3: `gathered` its elements)."""
        out = {}
        if zero >= 2 and in_flight:
            k = shard or z.layout.dp * z.layout.cp
            out["ZeRO grad buffers"] = self.unit * self.cluster.grad_bytes * (1 + 1 / k)
        if zero >= 3 and gathered:
            out["ZeRO gathered"] = z.e * gathered
        return out


def _rank_instants(z, rank):
    """Rank r's instants in one step (rank_peaks'): (label, parts beyond the states, gathered block elements of a
    backward, whether a ZeRO-2/3 reduce-scatter is in flight) for each state its executor passes through
    (`pipeline_holdings`) and each moment of its action."""
    per, model = z.layers, z.model
    chunks = {kind: z.chunk(kind, n) for kind, n in rank.kinds.items()}
    nvfp4 = []  # NVFP4: each chunk's (kind, its NVFP4 blocks' kept copies, its highest dense NVFP4 block or None)
    for c in range(z.v if z.nvfp4_below else 0):
        layers = [i for i in rank.layers[c * per:(c + 1) * per] if i < z.nvfp4_below]
        dense = [i for i in layers if not _is_moe(model, i)]
        kind = _chunk_kind(z.p * z.v, _virtual_stage(z.p, rank.r, c))
        nvfp4.append((kind, sum(z.nvfp4_kept(_is_moe(model, i)) for i in layers), max(dense, default=None)))
    for kind in chunks:  # the most of any chunk of that kind
        extra = max((kept for k, kept, _ in nvfp4 if k == kind), default=0)
        chunks[kind] = _add(chunks[kind], {"activations": extra}) if extra else chunks[kind]
    waits = {kind: z.waiting_w(kind, n) for kind, n in rank.kinds.items()} if z.knobs.pp_schedule == "zb-h1" else {}
    for held, (action, micro, chunk) in pipeline_holdings(z.knobs.pp_schedule, z.p, z.m, z.v, rank.r):
        if action == "W":
            continue
        base = {"receive buffers": held.posted * z.X, "activations": held.sent_outputs * z.X,
                "backward": held.sent_grads * z.X}
        for kind, n in zip(CHUNK_KINDS, held.kept):
            base = _add(base, _scale(chunks[kind], n)) if n else base
        for kind, n in zip(CHUNK_KINDS, held.waiting):
            base = _add(base, _scale(waits[kind], n)) if n else base
        in_flight = held.reduced  # ZeRO-2/3: a block's reduce-scatter is in flight
        where = f" of micro-batch {micro}" + (f", chunk {chunk}" if z.v > 1 else "")
        top = rank.layers[(chunk + 1) * per - 1]
        moe, gathered = rank.tops[chunk]
        if action == "F":
            names = ["the loss" + where if held.kind in ("last", "only") else f"forward{where}, its output"]
        else:
            names = [f"backward{where}{name}" for name in
                     ([", cross-entropy", ", LM head"] if held.kind in ("last", "only") else [])
                     + [f", block {top}"] + ([f", block {top - 1}"] if z.offload and per > 1 else [])
                     + ([f", block {top}'s attention"] if not z.flash else [])]
        moments = z.action_parts(action, held.kind, moe)
        if action == "B" and nvfp4 and nvfp4[chunk][2] is not None:  # the highest NVFP4 block's emulated backward
            below = nvfp4[chunk][2]
            above = sum(z.block(_is_moe(model, i)) for i in range(below + 1, top + 1))
            names.append(f"backward{where}, block {below}")
            # a BF16 block above has taken the gradient that came in and made the NVFP4 block's (nvfp4_instant)
            freed = {"LM head and loss": -z.X} if above and held.kind in ("last", "only") else {}
            moments.append(_add(z.came_in(held.kind), z.nvfp4_instant(above), freed))
        for name, parts in zip(names, moments):
            block = action == "B" and "block" in name  # ZeRO-3: the block is gathered for its backward
            yield name, _add(base, parts), (gathered if block else 0), in_flight


def rank_peaks(cluster, model, layout, knobs, program=Program(), stages=None):
    """Each pipeline stage's peak in a step after the first (every TP, CP and DP rank of a stage holds as much),
    as the most over the instants where it can peak (the comment above): a list of {"stage": r, "peak_bytes": n,
    "parts": {part: bytes}, "instant": "..."}, for every stage or those in `stages`."""
    z = _StepBytes(cluster, model, layout, knobs, program)
    zero, shard = knobs.zero, knobs.zero_shard_size
    results = []
    for r in range(layout.pp) if stages is None else stages:
        rank = _RankStatic(cluster, z, r, z.v)
        states = rank.states(zero, shard)
        candidates = []
        for label, parts, gathered, in_flight in _rank_instants(z, rank):
            extras = rank.zero_extras(zero, shard, gathered, z, in_flight)
            candidates.append((label, _add(states, parts, extras)))
        candidates.append(("the optimizer step", _add(states, {"step temporaries": rank.step(zero, shard)})))
        label, parts = max(candidates, key=lambda c: sum(c[1].values()))
        parts = {p: round(parts[p]) for p in MEMORY_PARTS if round(parts.get(p, 0))}
        results.append({"stage": r, "peak_bytes": sum(parts.values()), "parts": parts,
                        "instant": f"{label}, stage {r}"})
    return results



PLANNER_PROGRAM = Program()  # what the planner assumes of the program: train_gpt.py's BF16 AdamW on CUDA


def _memory_ranks(model, pp, m, v, schedule):
    """The stages where the fullest rank can be, for the search: the first (the embedding, the most chunks in
    flight: a later stage holds fewer of the same blocks) and the last (the LM head and the loss), under zb-h1 the
    ranks where its deferred W's can peak, and the stage with the most MoE layers."""
    ranks = {0, pp - 1}
    if schedule == "zb-h1":
        ranks |= set(_zb_candidate_ranks(pp, m, v))
    if model.moe_every:
        ranks.add(_busiest_moe_stage(model.layers, pp, model.moe_every, schedule in V_SCHEDULES)[0])
    return sorted(ranks)


class _ScalarPrices:
    """The sums of _StepBytes' parts, for the search, kept per (b, sp, recompute, zb-h1) of a layout (v only sets
    the blocks per chunk): a chunk's and a waiting W's, linear in its blocks (each block's sum, and what the chunk's
    kind adds: the chunk's with no block), an action's largest moment. Linear prices do not depend on pp beyond
    whether it is 1 (a tied embedding's gradient on one stage): the layouts of one plan share them."""

    def __init__(self, z):
        self.z, self.memo, self.wait_base = z, {}, {}
        self.linear = z.policy != "sqrt" and not z.offload
        self.dense = z.block(False)
        self.moe = z.block(True) if z.model.moe_every else 0.0
        self.base = {kind: sum(z.chunk(kind, 0, 0).values()) for kind in CHUNK_KINDS} if self.linear else {}
        if z.knobs.pp_schedule in SPLIT_SCHEDULES:  # a deferred W's attention and MLP parts per block
            one = sum(z.waiting_w("middle", 1, 1).values())
            self.w_attention = one - sum(z.waiting_w("middle", 0, 0).values())
            self.w_mlp = sum(z.waiting_w("middle", 0, 1).values()) - one

    def chunk(self, kind, layers, moe):
        if not self.linear:
            key = ("chunk", kind, layers, moe)
            if key not in self.memo:
                self.memo[key] = sum(self.z.chunk(kind, moe, layers).values())
            return self.memo[key]
        return (layers - moe) * self.dense + (moe and moe * self.moe) + self.base[kind]

    def waiting(self, kind, layers, moe):
        base = self.wait_base.get(kind)
        if base is None:
            base = self.wait_base[kind] = sum(self.z.waiting_w(kind, 0, 0).values())
        return layers * self.w_attention + (layers - moe) * self.w_mlp + base

    def extra(self, action, kind, moe, layers):
        key = (action, kind, moe, layers > 1)
        out = self.memo.get(key)
        if out is None:
            out = self.memo[key] = max(sum(p.values()) for p in self.z.action_parts(action, kind, moe, layers))
        return out


class _PlanMemory:
    """The planner's peak for one layout and (b, sp, recompute, v, schedule), at each ZeRO choice (`gb(zero)`, GB):
    rank_peaks' prices (the same chunks, deferred W's, LM head, cross-entropy and working sets, the same states),
    summed, at each candidate stage's (`_memory_ranks`) instants where the most chunks are in flight, counted by the
    schedule's formula (`in_flight_chunks`: k chunks before their B, d waiting for W) instead of a replay of the
    lists (which planning thousands of layouts cannot afford): the B that finds k chunks in flight (on a stage that
    holds the last virtual stage: its chunk, with the cross-entropy), the loss beside them, the optimizer step. The
    buffers held are bounded: under 1F1B exactly what the replay finds at the first B (each chunk's output sent
    and not yet freed, a receive posted on every stage but the first), otherwise k + 1 sent tensors and a posted
    receive. So the planner's figure is rank_peaks' under 1F1B and at most a few X above it otherwise
    (tests/test_memory.py). The sums are kept per (b, sp, recompute, zb-h1), whatever v."""

    def __init__(self, cluster, model, layout, knobs, program=PLANNER_PROGRAM):
        b, v, recompute, sp, _, schedule = knobs[:6]
        zb = schedule in SPLIT_SCHEDULES
        cache = layout.__dict__.setdefault("memory_prices", {})  # one layout's, one program's (the plan's)
        key = self.key = (b, sp, recompute, zb)
        prices = cache.get(key)
        if prices is None:
            linear = recomputation(recompute) != "sqrt" and recompute not in OFFLOAD_POLICIES
            shared = layout.memo.setdefault("memory prices", {}) if linear else {}  # the plan's layouts'
            outer = (layout.tp, layout.cp, layout.ep, layout.pp == 1) + key
            prices = cache[key] = shared.get(outer)
            if prices is None:
                prices = cache[key] = shared[outer] = _ScalarPrices(_StepBytes(cluster, model, layout, knobs._replace(
                    virtual_stages=1, zero=0, zero_shard_size=None), program))
        self.layout, self.cache, self.ranks, self.v, self.prices = layout, {}, [], v, prices
        self.v_shape = schedule in V_SCHEDULES
        self.shard = layout.dp * layout.cp
        p, m = layout.pp, model.global_batch // (layout.dp * b)
        counts = layout.memo.get(("memory counts", p, m, v, schedule))
        if counts is None:  # each candidate stage's (r, k, d, buffers in X's), as this docstring says
            flight, one_f_one_b = in_flight_chunks(schedule, p, m, v), schedule == "1f1b"
            if schedule in V_SCHEDULES:  # on every candidate rank, each point where a rank of the V can peak
                counts = tuple((r, max(k, 1), d, max(k, 1) + 2) for r in _memory_ranks(model, p, m, v, schedule)
                               for k, d in v_activation_points(schedule, p))
            else:
                counts = tuple((r, *flight[r], (0 if p == 1 else 1 if r == p - 1 else flight[r][0] + (r > 0))
                                if one_f_one_b else flight[r][0] + 2) for r in _memory_ranks(model, p, m, v, schedule))
            layout.memo[("memory counts", p, m, v, schedule)] = counts
        self.counts, self.model, self.cluster = counts, model, cluster

    def _rank(self, i):
        """The i-th candidate stage's (_RankStatic, its largest moment's bytes beyond the states: at ZeRO 0-2 and at
        ZeRO 3 (a block gathered in a backward), k, d, its buffers, its last-stage chunk's kind, the kind of its
        other chunks with the largest B, its ZeRO unit's FP32 bytes, its states by ZeRO choice)."""
        while len(self.ranks) <= i:
            self.ranks.append(self._price(self.counts[len(self.ranks)]))
        return self.ranks[i]

    def _price(self, counts):
        r, k, d, buffers = counts
        (rank, head, head_chunk, head_b, head_f, rest, rest_kind, other, other_extra, wait,
         gathered) = self._chunks(r)
        X, e = self.prices.z.X, self.prices.z.e
        waits = d * wait if d else 0
        buffers *= X
        peak = most = 0.0
        if head:  # the B of the last virtual stage, beside k - 1 other chunks; the loss beside them
            kept = head_chunk + (k - 1) * rest + waits
            backward = kept + buffers + head_b
            loss = kept + max(0, buffers - X) + head_f
            peak = backward if backward > loss else loss
            most = max(backward + e * gathered, peak)
        if other:
            total = k * rest + waits + buffers + other_extra
            peak, most = max(peak, total), max(most, total + e * gathered)
        return (rank, peak, most, k, d, buffers, head, (rest_kind, other), rank.unit * self.cluster.grad_bytes,
                rank.by_zero)

    def _chunks(self, r):
        """Stage r's prices whatever the counts: (its _RankStatic, its last-stage chunk's kind, bytes and largest B
        and F moments, its other chunks' largest bytes and kind, the kind with the largest B and that B, a deferred
        W's largest bytes, its top block's elements), kept in the layout per (b, sp, recompute, split, v, r)."""
        prices, layout, v = self.prices, self.layout, self.v
        key = (self.key, v, r, self.v_shape)
        cache = layout.__dict__.setdefault("memory_chunks", {})
        out = cache.get(key)
        if out is not None:
            return out
        layers = self.model.layers // (layout.pp * v)
        static = layout.__dict__.setdefault("memory_ranks", {}).get((v, r, self.v_shape)) or self._static(
            self.cluster, self.model, layout, prices, r, v, self.v_shape)
        rank, head, others, moe_top, gathered, kinds = static
        signature = ("chunks", head, tuple(others), moe_top, kinds, layers)  # what the prices below read of the rank
        priced = prices.memo.get(signature)
        if priced is not None:
            out = cache[key] = (rank,) + priced + (gathered,)
            return out
        linear, dense, moe_block = prices.linear, prices.dense, prices.moe
        # the chunks (linear in their blocks: each block's bytes and the kind's), the actions' largest moments
        rest, rest_kind, other_extra, other = 0.0, None, 0.0, None
        for kind, n in others:
            chunk = ((layers - n) * dense + (n and n * moe_block) + prices.base[kind] if linear
                     else prices.chunk(kind, layers, n))
            if rest_kind is None or chunk > rest:
                rest, rest_kind = chunk, kind
            extra = prices.extra("B", kind, moe_top, layers)
            if other is None or extra > other_extra:
                other, other_extra = kind, extra
        wait = max(prices.waiting(kind, layers, n) for kind, n in kinds) if hasattr(prices, "w_mlp") else 0.0
        head_kind = head_chunk = head_b = head_f = None
        if head:
            head_kind, n = head
            head_chunk = ((layers - n) * dense + (n and n * moe_block) + prices.base[head_kind] if linear
                          else prices.chunk(head_kind, layers, n))
            head_b = prices.extra("B", head_kind, moe_top, layers)
            head_f = prices.extra("F", head_kind, moe_top, layers)
        priced = prices.memo[signature] = (head_kind, head_chunk, head_b, head_f, rest, rest_kind, other, other_extra,
                                           wait)
        out = cache[key] = (rank,) + priced + (gathered,)
        return out

    def _bytes(self, i, zero):
        """The i-th candidate stage's peak at zero = (level, shard size), bytes."""
        rank, peak, gathered, _, _, _, _, _, unit, by_zero = self._rank(i)
        fixed = by_zero.get(zero) or rank.fixed(*zero)
        if zero[0] >= 2:  # a block's gradient in flight; ZeRO-3: and the block gathered in a backward
            peak = (gathered if zero[0] >= 3 else peak) + unit * (1 + 1 / (zero[1] or self.shard))
        return fixed[1] + max(peak, fixed[2])

    def first_fit(self, zeros, limit):
        """The first of `zeros` whose gb(zero) <= limit (GB), or None: the candidate stages priced one by one until
        one does not fit."""
        n, shard = len(self.counts), self.shard
        for zero in zeros:
            level, size = zero
            buffers = 1 + 1 / (size or shard) if level >= 2 else 0
            for i in range(n):
                rank, peak, gathered, _, _, _, _, _, unit, by_zero = (self.ranks[i] if i < len(self.ranks)
                                                                      else self._rank(i))
                fixed = by_zero.get(zero) or rank.fixed(level, size)
                if level >= 2:  # a block's gradient in flight; ZeRO-3: and the block gathered in a backward
                    peak = (gathered if level >= 3 else peak) + unit * buffers
                if (fixed[1] + (peak if peak > fixed[2] else fixed[2])) / GB > limit:
                    break
            else:
                return zero
        return None

    @staticmethod
    def _static(cluster, model, layout, prices, r, v, v_shape):
        """Rank r's (_RankStatic, its last-stage chunk's (kind, MoE blocks) or None, its other chunks', its top
        block's MoE and elements, its chunks' kinds), with a step's sizes of this layout's."""
        z = layout.__dict__.get("memory_z")
        if z is None:
            z = layout.memory_z = _StepBytes(cluster, model, layout, prices.z.knobs, prices.z.program)
        rank = _RankStatic(cluster, z, r, v, layout.memo, v_shape)
        if rank.params is None:  # states and step from the parameter sums alone: shared by ranks holding as much
            signature = (tuple(sorted(rank.sums[0].items())), rank.sums[1])
            rank.by_zero = layout.__dict__.setdefault("memory_states", {}).setdefault(signature, rank.by_zero)
        heads = [(kind, n) for kind, n in rank.kinds.items() if kind in ("last", "only")]
        others = [(kind, n) for kind, n in rank.kinds.items() if kind not in ("last", "only")]
        static = layout.memory_ranks[(v, r, rank.key[-1])] = (rank, heads[0] if heads else None, others, *rank.top,
                                                tuple(rank.kinds.items()))
        return static

    def gb(self, zero):
        """The fullest candidate stage's peak, GB, at zero = (level, shard size)."""
        out = self.cache.get(zero)
        if out is None:
            out = self.cache[zero] = max(self._bytes(i, zero) for i in range(len(self.counts))) / GB
        return out

    def fullest(self, zero):
        """The fullest candidate stage at zero, as rank_peaks gives one: {"stage", "peak_bytes", "parts",
        "instant"}, its parts from the same functions, at the instants `gb` prices."""
        level, shard = zero
        z, best = self.prices.z, None
        layers = z.model.layers // (self.layout.pp * self.v)
        for i in range(len(self.counts)):
            rank, _, _, k, d, buffers, head_kind, (rest, other), _, _ = self._rank(i)
            states = rank.states(level, shard)
            chunks = {kind: z.chunk(kind, n, layers) for kind, n in rank.kinds.items()}
            waits = max((z.waiting_w(kind, n, layers) for kind, n in rank.kinds.items()),
                        key=lambda w: sum(w.values())) if d else {}
            moe, gathered = rank.top
            instants = ([("B", head_kind, buffers), ("F", head_kind, max(0, buffers - z.X))] if head_kind else []) + (
                [("B", other, buffers)] if other else [])
            for action, kind, held in instants:
                head = kind in ("last", "only")
                kept = _add(chunks[kind] if head else {}, _scale(chunks[rest], k - head) if rest else {})
                action_parts = max(z.action_parts(action, kind, moe, layers), key=lambda x: sum(x.values()))
                parts = _add(states, kept, _scale(waits, d), {"receive buffers": held}, action_parts,
                             rank.zero_extras(level, shard, gathered if action == "B" else 0, rank.z))
                label = "the loss" if action == "F" else f"a backward with {k} chunks in flight"
                if best is None or sum(parts.values()) > best[0]:
                    best = (sum(parts.values()), rank.r, parts, label)
            step = _add(states, {"step temporaries": rank.step(level, shard)})
            if sum(step.values()) > best[0]:
                best = (sum(step.values()), rank.r, step, "the optimizer step")
        _, stage, parts, label = best
        parts = {p: round(parts[p]) for p in MEMORY_PARTS if round(parts.get(p, 0))}
        return {"stage": stage, "peak_bytes": sum(parts.values()), "parts": parts, "instant": f"{label}, stage {stage}"}


# ---- one configuration, then the search ------------------------------------------------------------

def _ep_pool(cluster, tp, cp, dp):
    """The ranks of one stage an EP group is drawn from (`Cluster.expert_folding`)."""
    return cp * dp if cluster.expert_folding == "dp_cp" else tp * cp * dp


def _kv_heads(model):
    return model.heads if model.kv_heads is None else model.kv_heads


def _check_layout(cluster, model, tp, pp, cp, ep=1):
    dp = validate_layout(cluster.gpus, tp, pp, cp)
    if model.layers % pp:
        raise ValueError(f"layers={model.layers} is not divisible by pp={pp}; choose pp among "
                         f"{_divisors(model.layers)}")
    if model.heads % tp:
        raise ValueError(f"heads={model.heads} is not divisible by tp={tp}; choose tp among {_divisors(model.heads)}")
    if cp > 1 and model.seq % (2 * cp):
        raise ValueError(f"seq={model.seq} is not divisible by 2*cp={2 * cp} (causal load balancing); choose "
                         "another cp")
    if model.global_batch % dp:
        raise ValueError(f"global_batch={model.global_batch} is not divisible by dp={dp}; change global_batch or the "
                         "layout")
    _check_count("ep", ep, "the ranks that share one MoE layer's experts")
    if ep > 1 and not model.moe_every:
        raise ValueError(f"ep={ep} needs MoE layers: set moe_every > 0 (--moe-every), or ep=1")
    pool, name = _ep_pool(cluster, tp, cp, dp), "cp*dp" if cluster.expert_folding == "dp_cp" else "tp*cp*dp"
    if model.moe_every and (model.experts % ep or pool % ep):
        valid = [e for e in _divisors(pool) if model.experts % e == 0]
        raise ValueError(f"ep={ep} must divide experts={model.experts} and {name}={pool} (experts fold over those "
                         f"ranks, Cluster.expert_folding={cluster.expert_folding!r}); choose ep among {valid}")
    if model.cp_ulysses is not None and model.cp_ulysses not in _ulysses_sizes(model, tp, cp):
        raise ValueError(f"cp_ulysses={model.cp_ulysses} must divide cp={cp} and the heads and KV heads per TP rank "
                         f"({model.heads}/{tp}, {_kv_heads(model)}/{tp}) (--cp-ulysses); choose among "
                         f"{_ulysses_sizes(model, tp, cp)}")
    if model.zero_shard_size is not None and (cp * dp) % model.zero_shard_size:
        raise ValueError(f"zero_shard_size={model.zero_shard_size} must divide dp*cp={dp}*{cp}={dp * cp} (HSDP "
                         f"shards over sub-groups of the DP x CP ranks; --zero-shard-size); choose among "
                         f"{_divisors(dp * cp)}")
    return dp


def _ulysses_sizes(model, tp, cp):
    """The Ulysses sizes u of hybrid CP on (tp, cp): u divides cp and the heads and KV heads of each TP rank."""
    return [u for u in _divisors(cp) if model.heads % (tp * u) == 0 and (u == 1 or _kv_heads(model) % (tp * u) == 0)]


def _check_knobs(model, dp, pp, b, v, interleave_min_pp=2, schedule=None):
    if (model.global_batch // dp) % b:
        raise ValueError(f"global_batch={model.global_batch} is not divisible by micro_batch*dp={b}*{dp}; "
                         "change global_batch, micro_batch or the layout")
    if (model.layers // pp) % v:
        raise ValueError(f"virtual_stages={v} must divide layers/pp={model.layers // pp}; choose among "
                         f"{_divisors(model.layers // pp)}")
    if schedule in V_SCHEDULES:
        _check_v_knobs(model, dp, pp, b, v, schedule)
        return
    if v > 1 and pp < interleave_min_pp:
        raise ValueError(f"virtual_stages={v} needs pp >= {interleave_min_pp} with this implementation "
                         f"(Cluster.interleave_min_pp); use virtual_stages=1 or a deeper pipeline")
    if v > 1 and (model.global_batch // (dp * b)) % pp:
        raise ValueError(f"the interleaved schedule (virtual_stages={v}) needs the micro-batches per pipeline "
                         f"({model.global_batch // (dp * b)}) to be a multiple of pp={pp}")
    if (schedule == "interleaved") != (v > 1) and schedule != "zb-h1" and schedule is not None:
        raise ValueError(f"pp_schedule={schedule!r} with virtual_stages={v}: 1f1b runs one chunk per GPU, "
                         "interleaved two or more (--pp-schedule, --virtual-stages)")


def _check_v_knobs(model, dp, pp, b, v, schedule):
    """A V schedule: two chunks per GPU (v = 2), a pipeline, and enough micro-batches for its formulas (ZB-V 2p - 1,
    DualPipeV 2p: the two directions meet in the middle)."""
    if v != 2:
        raise ValueError(f"pp_schedule={schedule!r} places two chunks per GPU in a V: virtual_stages must be 2, not "
                         f"{v} (--virtual-stages)")
    if pp < 2:
        raise ValueError(f"pp_schedule={schedule!r} needs a pipeline (pp >= 2); use 1f1b at pp=1")
    need, micro_batches = 2 * pp - (schedule == "zbv"), model.global_batch // (dp * b)
    if micro_batches < need:
        raise ValueError(f"pp_schedule={schedule!r} needs at least {need} micro-batches per pipeline at pp={pp} "
                         f"(global_batch / (dp micro_batch) = {micro_batches}); raise global_batch or lower "
                         "micro_batch")


class Knobs(NamedTuple):
    """Everything a plan fixes besides the layout (tp, pp, cp, ep)."""
    micro_batch: int
    virtual_stages: int
    recompute: str
    sequence_parallel: bool
    zero: int                       # ZeRO level 0..3
    pp_schedule: str = "1f1b"
    zero_shard_size: int = None     # HSDP shard size; None: every DP x CP rank
    cp_ulysses: int = 1             # hybrid CP's Ulysses size (1: the ring alone)


class _Layout:
    """What one (tp, pp, cp, ep) fixes, computed once for all the knob combinations tried on it."""

    def __init__(self, cluster, model, tp, pp, cp, ep=1, memo=None):
        self.tp, self.pp, self.cp, self.ep = tp, pp, cp, ep
        # what does not depend on pp (the layers' forwards, CP's terms), shared by the layouts of one plan
        self.memo = {} if memo is None else memo
        self.dp = _check_layout(cluster, model, tp, pp, cp, ep)
        self.per_node, self.local = layout_locality(cluster, tp, pp, cp, self.dp, ep)
        self.interleave_min_pp = cluster.interleave_min_pp


def _layer_forwards(cluster, model, layout, b, sp, ulysses=1, ring=None):
    """layer_forward of each kind of layer the model has: {"dense": ..., "moe": ...} (None where it has none).
    `ring`: this answer at ulysses=1, whose terms other than CP's are the same at every Ulysses size."""
    if ring is not None:
        return {kind: f and {**f, **dict(zip(("cp_fwd", "cp_bwd"), _cp_seconds(
            cluster, model, layout.tp, layout.cp, b, layout, f["attention"], ulysses)))} for kind, f in ring.items()}
    dense, moe = model.layers - moe_layers_between(model, 0, model.layers), moe_layers_between(model, 0, model.layers)
    tp, cp = layout.tp, layout.cp
    return {"dense": layer_forward(cluster, model, tp, cp, b, sp, layout, ulysses=ulysses) if dense else None,
            "moe": layer_forward(cluster, model, tp, cp, b, sp, layout, moe=True, ulysses=ulysses) if moe else None}


@functools.lru_cache(maxsize=4096)
def _busiest_moe_stage(layers, pp, moe_every, v_shape=False):
    """The stage (the rank of a V) with the most MoE layers (the first of them) and its (dense, MoE) counts."""
    shape = ModelShape(layers=layers, hidden=1, heads=1, seq=1, vocab=1, global_batch=1, moe_every=moe_every)
    return max(((j,) + rank_layer_counts(shape, pp, j, v_shape) for j in range(pp)), key=lambda x: (x[2], -x[0]))


def _stage_counts(model, pp, forwards, recompute, output, offload_seconds=None, v_shape=False):
    """(dense layers, MoE layers, holds the output layer) of the slowest stage: the last one, which carries the
    output layer, or one with more MoE layers when that is slower. `offload_seconds`: `_offload_terms` (None:
    nothing). Under a V schedule (`v_shape`) the last stage is on rank 0, with the first."""
    last = (rank_layer_counts(model, pp, 0, True) if v_shape else stage_layer_counts(model, pp, pp - 1)) + (True,)
    if not model.moe_every:
        return last
    j, dense, moe = _busiest_moe_stage(model.layers, pp, model.moe_every, v_shape)
    if moe == last[1]:
        return last

    def seconds(counts, extra):
        return extra + sum(n * (sum(layer_step(forwards[kind], recompute)) + ep_step(forwards[kind], recompute)
                                + (offload_seconds[kind][1] if offload_seconds else 0.0))
                           for n, kind in zip(counts, ("dense", "moe")) if n)
    return (dense, moe, False) if seconds((dense, moe), 0.0) > seconds(last[:2], output) else last


def _stage_parts(cluster, model, layout, b, sp, recompute, forwards, counts=None, schedule="1f1b"):
    """What one (b, sp, recompute) fixes of the step's terms, whatever v and ZeRO (and the schedule, but for an
    offload policy's window): the output layer's seconds (0 when the slowest stage is not the last), the slowest
    stage's `_stage_counts`, each kind's layer_step, ep_step and `offload_layer_seconds` on it, one pipeline
    exchange, the weight-gradient GEMMs of one micro-batch on it (ZB-H1's W: one per forward GEMM, of its shape;
    the output layer's one of its three), and its forward: each layer's forward work and communication, a third of
    the output layer (what a V schedule's bubble needs apart from the backward; the exchanges come with the tail)."""
    output = output_layer_seconds(cluster, model, layout.tp, layout.cp, b)  # on the last stage, the slowest one
    offload_seconds = _offload_terms(cluster, model, layout, b, sp, recompute, forwards, schedule)
    counts = counts or _stage_counts(model, layout.pp, forwards, recompute, output, offload_seconds,
                                     schedule in V_SCHEDULES)
    per_kind = [(n, layer_step(forwards[kind], recompute), ep_step(forwards[kind], recompute), offload_seconds[kind])
                for n, kind in zip(counts, ("dense", "moe")) if n]
    exchange = (p2p_exchange_seconds(cluster, model, layout.tp, layout.cp, b, sp, layout.local["pp"]) if layout.pp > 1
                else 0.0)
    weight = sum(n * forwards[kind]["gemm"] for n, kind in zip(counts, ("dense", "moe")) if n)
    forward = 0.0
    for n, kind in zip(counts, ("dense", "moe")):
        if n:
            f = forwards[kind]
            forward += n * (f["gemm"] + f["attention"] + f["elementwise"] + f["tp"] + f["cp_fwd"] + f["ep_fwd"])
    if counts[2]:
        weight += gemm_seconds(cluster, b * model.seq // layout.cp, model.hidden, model.vocab // layout.tp)
        forward += output / 3
    return output if counts[2] else 0.0, counts, per_kind, exchange, weight, forward


def pipeline_bubble(schedule, pp, v, micro_batches, stage, weight=0.0, forward=0.0):
    """Seconds the slowest stage idles per step, `stage` its time for one micro-batch through all its v chunks
    (F + B + W of each chunk, communication included), `weight` the W part and `forward` the F part. 1F1B and
    interleaved: (p-1)/v x stage (per chunk: (p-1)(F + B) with B holding W). ZB-H1 (Qi et al. 2023), per chunk
    (p-1)(F + B) - (min(m, p) - 1) W, i.e. (p-1)(F + B - W) for m >= p: each rank's deferred W's fill the drain's
    idle slots. Exact for W <= min(F, B) (the planner's split always: F holds W's GEMMs' forward twins, B their
    input-gradient twins), checked against train_gpt.py's replay of its lists. The V schedules, per chunk (v = 2),
    exact for W <= F <= B (the planner's split always: B holds twice F's work less W, and the backward's
    communication): ZB-V (p-1) max(B, 2 (B - W)) for m >= 2p - 1, (p-1) F when F = B = W (the first micro-batch's
    way down the V); DualPipeV max((p-1)(2F + B - W), (p-1)(F + 2B - W) - F) for m >= 2p, 2 (p-1) F when F = B = W:
    DualPipe's (PP/2 - 1)(F&B + B - 3W), PP = 2p stages, F&B = F + B + W, its B whole (B + W)."""
    if schedule in V_SCHEDULES:
        f, w = forward / v, weight / v
        b = stage / v - f - w
        if schedule == "zbv":
            return (pp - 1) * max(b, 2 * (b - w))
        return max((pp - 1) * (2 * f + b - w), (pp - 1) * (f + 2 * b - w) - f)
    if schedule != "zb-h1":
        return (pp - 1) / v * stage
    return ((pp - 1) * (stage - weight) - (min(micro_batches, pp) - 1) * weight) / v


# ZeRO's gradient and parameter collectives, counted in (n-1)/n of the gradient bytes each (a ring's share): (once
# per step, once per micro-batch). ZeRO-0: the all-reduce (2); ZeRO-1: reduce-scatter + all-gather of the parameters
# after the step (2); ZeRO-2: each micro-batch's gradients reduce-scattered into the owners' shards as its backward
# produces them (the full gradient is freed), the all-gather once; ZeRO-3: per micro-batch an all-gather for the
# forward, another for the backward (and recomputation) and the reduce-scatter; nothing after the step. The parameter
# all-gathers are counted at the gradient's bytes, as ZeRO-1's always were here (exact for 16-bit gradients; with
# fp32 main grads the 16-bit parameters move half of that: conservative)
ZERO_COLLECTIVES = {0: (2, 0), 1: (2, 0), 2: (1, 1), 3: (0, 3)}


def _dp_seconds(cluster, model, layout, zero, shard, micro_batches, params, backward, v_shape=False):
    """The gradient reduction's seconds per step (the docstring; ZERO_COLLECTIVES): dense weights over the n = DP x CP
    ranks, or with HSDP (`shard` k < n) reduce-scatter and gather over k consecutive ones and all-reduce the 1/k
    shard over the n/k replicas once per step; experts over the GPUs holding the same ones (no HSDP); the tied
    embedding's all-reduce between first and last stage. `backward`: one micro-batch's backward on the slowest
    stage where the implementation overlaps (the once-per-step part hides behind the last one, each micro-batch's
    part behind its own backward, ZeRO-3's behind its forward and backward), None where it does not. A V schedule
    (`v_shape`) holds both ends of the tied embedding on rank 0: one parameter, nothing to all-reduce."""
    pp, dp, cp, tp = layout.pp, layout.dp, layout.cp, layout.tp
    shared, experts = params
    g, n = cluster.grad_bytes, dp * cp
    once, each = ZERO_COLLECTIVES[zero]
    if backward is None:  # nothing hides: every collective in one sum (ZeRO-2 at m = 1 then costs ZeRO-1's)
        once, each = once + each * micro_batches, 0
    k = n if shard is None else shard
    step_s = mb_s = 0.0
    if n > 1 and k == n:
        bus = _bus_gbps(cluster, layout.per_node["dp_cp"], n)
        step_s = once * (n - 1) / n * g * shared / (bus * GB)
        mb_s = each * (n - 1) / n * g * shared / (bus * GB)
    elif n > 1:
        nodes = cluster.gpus, cluster.gpus_per_node
        bus = _bus_gbps(cluster, _members_per_node(tp, k, *nodes), k)
        step_s = once * (k - 1) / k * g * shared / (bus * GB)
        mb_s = each * (k - 1) / k * g * shared / (bus * GB)
        r = n // k
        step_s += 2 * (r - 1) / r * g * shared / k / (_bus_gbps(cluster, _members_per_node(tp * k, r, *nodes), r) * GB)
    n_experts = tp * cp * dp // layout.ep
    if experts and n_experts > 1:
        bus = _bus_gbps(cluster, layout.per_node["edp"], n_experts)
        step_s += once * (n_experts - 1) / n_experts * g * experts / (bus * GB)
        mb_s += each * (n_experts - 1) / n_experts * g * experts / (bus * GB)
    if backward is not None:  # hidden behind the last backward
        step_s = max(0.0, step_s - backward)
        if each:
            step_s += micro_batches * max(0.0, mb_s - backward * (1.5 if zero == 3 else 1.0))
    if pp > 1 and model.tied_embeddings and not v_shape:  # first and last stage all-reduce the embedding gradient
        link = cluster.nvlink_gbps if layout.local["pp"] else cluster.ib_gbps
        step_s += cluster.grad_bytes * model.vocab * model.hidden / tp / (link * GB)  # 2 (n-1)/n = 1 for n = 2
    return step_s


def _tied_embedding_seconds(cluster, model, layout):
    """What _dp_seconds counts for the tied embedding's all-reduce (none without a pipeline, or untied)."""
    if layout.pp == 1 or not model.tied_embeddings:
        return 0.0
    link = cluster.nvlink_gbps if layout.local["pp"] else cluster.ib_gbps
    return cluster.grad_bytes * model.vocab * model.hidden / layout.tp / (link * GB)


def _overlap_backward(cluster, layout, forwards, counts):
    """One micro-batch's backward on the slowest stage where the gradient reduction overlaps it, else None."""
    overlap = cluster.overlap_grad_reduce
    if not (overlap is True or (overlap == "without_pp" and layout.pp == 1)):
        return None
    return sum(n * 2 * (forwards[kind]["gemm"] + forwards[kind]["attention"] + forwards[kind]["elementwise"])
               for n, kind in zip(counts, ("dense", "moe")) if n)


def _optimizer_seconds(cluster, layout, zero, shard, params):
    """The optimizer step: OPTIMIZER_STEP_BYTES of HBM traffic per parameter updated, the shard's with ZeRO."""
    shared, experts = params
    n = (shard or layout.dp * layout.cp) if zero else 1
    return (OPTIMIZER_STEP_BYTES * shared / n + OPTIMIZER_STEP_BYTES * experts
            / (expert_shard(cluster, layout.tp, layout.cp, layout.dp, layout.ep) if zero else 1)
            ) / (cluster.hbm_gbps * GB)


def step_time_terms(cluster, model, layout, knobs, forwards, params, counts=None, parts=None):
    """Seconds of one step on one GPU of the slowest stage, by term; the terms add up to the step time.
    `forwards` is _layer_forwards' answer for (b, sp, u), `params` the (dense, expert) parameters this GPU holds,
    `counts` the slowest stage's `_stage_counts`, `parts` `_stage_parts` when the caller has it (the search)."""
    b, sp, recompute = knobs.micro_batch, knobs.sequence_parallel, knobs.recompute
    parts = parts or _stage_parts(cluster, model, layout, b, sp, recompute, forwards, counts, knobs.pp_schedule)
    t = _pipeline_terms(model, layout, knobs, parts)
    micro_batches = model.global_batch // (layout.dp * b)
    t["dp_s"] = _dp_seconds(cluster, model, layout, knobs.zero, knobs.zero_shard_size, micro_batches, params,
                            _overlap_backward(cluster, layout, forwards, parts[1]), knobs.pp_schedule in V_SCHEDULES)
    t["optimizer_s"] = _optimizer_seconds(cluster, layout, knobs.zero, knobs.zero_shard_size, params)
    return t


def _layer_terms(micro_batches, parts, v=1):
    """What the slowest stage's layers cost, whatever the schedule: ({compute_s, tp_s, cp_s, ep_s, offload_s} per
    step, offload_s the copies' exposed wait, each of the v chunks' top layer's included; one micro-batch through
    its layers and output layer); `parts`: `_stage_parts`."""
    output, _, per_kind = parts[:3]
    top = v * max(top_layer for _, _, _, (_, _, top_layer) in per_kind)  # 0 unless offloaded
    busy = sum(n * (compute + tp_layer + cp_layer + ep_layer + exposed) for n, (compute, tp_layer, cp_layer),
               ep_layer, (_, exposed, _) in per_kind) + output + top
    return {"compute_s": micro_batches * (sum(n * step[0] for n, step, _, _ in per_kind) + output),
            "tp_s": sum(micro_batches * n * step[1] for n, step, _, _ in per_kind),
            "cp_s": sum(micro_batches * n * step[2] for n, step, _, _ in per_kind),
            "ep_s": sum(micro_batches * n * ep_layer for n, _, ep_layer, _ in per_kind),
            "offload_s": micro_batches * (sum(n * exposed for n, _, _, (_, exposed, _) in per_kind) + top)}, busy


def _pipeline_terms(model, layout, knobs, parts, layers=None):
    """The terms of step_time_terms before the gradient reduction and the optimizer: what the layers, their
    communication and the pipeline cost on the slowest stage (`parts`: `_stage_parts`; `layers`: its
    `_layer_terms` when the caller has them)."""
    v, pp = knobs.virtual_stages, layout.pp
    micro_batches = model.global_batch // (layout.dp * knobs.micro_batch)  # per pipeline per step
    terms, busy = layers or _layer_terms(micro_batches, parts, v)
    t = dict(terms)
    t["pp_p2p_s"], t["bubble_s"] = _pipeline_tail(knobs.pp_schedule, pp, v, micro_batches, busy, *parts[3:])
    return t


def _pipeline_tail(schedule, pp, v, micro_batches, busy, exchange, weight, forward=0.0):
    """(pp_p2p_s, bubble_s): 2v exchanges per micro-batch, and the bubble of a stage whose micro-batch takes `busy`
    plus its exchanges (`forward` of it its forward, with half the exchanges). 1F1B: the first micro-batch reaches
    the last stage after (p-1) stage times, interleaving cuts it v-fold, zero bubble fills it with deferred W's
    (`pipeline_bubble`)."""
    p2p = 2 * v * exchange if pp > 1 else 0.0
    return micro_batches * p2p, pipeline_bubble(schedule, pp, v, micro_batches, busy + p2p, weight, forward + p2p / 2)


def compute_by_kind(cluster, model, layout, b, recompute, forwards, counts):
    """`compute_s` split by kind (the parts add up to it) on the slowest stage (`counts`, `_stage_counts`): the
    layers' GEMMs, attention cores and memory-bound kernels (LayerNorms, bias-dropout-adds, GeLU, launches; a MoE
    layer's permutations and expert activation), each 3 x its forward (a flash attention core 3.5 x) plus what the
    recomputation redoes, and the output layer when that stage is the last."""
    micro_batches = model.global_batch // (layout.dp * b)
    redone = {"none": (), "selective": ("attention",),
              "full": ("gemm", "attention", "elementwise")}[recomputation(recompute)]
    parts = {}
    for kind in ("gemm", "attention", "elementwise"):
        flash = 0.5 if kind == "attention" and cluster.flash_attention else 0
        parts[f"{kind}_s"] = sum(micro_batches * n * (3 + (kind in redone) + flash) * forwards[layer][kind]
                                 for n, layer in zip(counts, ("dense", "moe")) if n)
    parts["output_layer_s"] = (micro_batches * output_layer_seconds(cluster, model, layout.tp, layout.cp, b)
                               if counts[2] else 0.0)
    return parts


def evaluate(cluster, model, layout, knobs):
    """Memory and step time of one layout with every knob fixed (a Knobs), term by term (the prose under the banner)."""
    b, v, recompute, sp, zero = knobs[:5]
    _check_knobs(model, layout.dp, layout.pp, b, v, layout.interleave_min_pp, knobs.pp_schedule)
    micro_batches = model.global_batch // (layout.dp * b)
    v_shape = knobs.pp_schedule in V_SCHEDULES
    split = _first_stage_parameters(model, layout.tp, layout.pp, layout.ep, v_shape)
    params, in_flight = split[0] + split[1], in_flight_microbatches(layout.pp, v, micro_batches, knobs.pp_schedule)
    fullest = _PlanMemory(cluster, model, layout, knobs._replace(zero=0)).fullest((zero, knobs.zero_shard_size))
    memory_gb, parts = fullest["peak_bytes"] / GB, fullest["parts"]
    held = {"weights_gb": "weights", "grads_gb": "main grads", "optimizer_gb": "optimizer states"}
    mem = {key: parts.get(part, 0) / GB for key, part in held.items()}
    mem["activations_gb"] = memory_gb - sum(mem.values())  # everything else of the fullest rank's peak
    forwards = _layer_forwards(cluster, model, layout, b, sp, knobs.cp_ulysses)
    offload_seconds = _offload_terms(cluster, model, layout, b, sp, recompute, forwards, knobs.pp_schedule)
    counts = _stage_counts(model, layout.pp, forwards, recompute,
                           output_layer_seconds(cluster, model, layout.tp, layout.cp, b), offload_seconds, v_shape)
    t = step_time_terms(cluster, model, layout, knobs, forwards, split, counts)
    step_time_s = sum(t.values())
    busy = t["compute_s"] + t["tp_s"] + t["cp_s"] + t["ep_s"] + t["offload_s"] + t["pp_p2p_s"]
    row = {
        "tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "cp": layout.cp, "ep": layout.ep, "micro_batch": b,
        "virtual_stages": v,
        "recompute": recompute, "sequence_parallel": sp, "zero": zero, "pp_schedule": knobs.pp_schedule,
        "zero_shard_size": knobs.zero_shard_size, "cp_ulysses": knobs.cp_ulysses, "micro_batches": micro_batches,
        "in_flight": in_flight, "params_per_gpu": params, "memory_gb": memory_gb, **mem,
        "memory_stage": fullest["stage"], "memory_instant": fullest["instant"], "memory_parts": parts,
        "fits": memory_gb <= cluster.gpu_mem_gb * MEMORY_HEADROOM,
        "step_time_s": step_time_s, **t, **compute_by_kind(cluster, model, layout, b, recompute, forwards, counts),
        **_offload_row(cluster, model, layout, knobs, offload_seconds, counts, micro_batches),
        "bubble_fraction": ((layout.pp - 1) / v / (micro_batches + (layout.pp - 1) / v)
                            if knobs.pp_schedule not in SPLIT_SCHEDULES else t["bubble_s"] / (busy + t["bubble_s"])),
        "tflops_per_gpu": paper_flops(model) / step_time_s / cluster.gpus / 1e12,
        "mfu": model_flops(model) / step_time_s / cluster.gpus / (cluster.peak_tflops * 1e12),
        "hfu": training_flops(model, recompute) / step_time_s / cluster.gpus / (cluster.peak_tflops * 1e12),
        "tokens_per_s": model.global_batch * model.seq / step_time_s,
        "intra_node": dict(layout.local),
        "moe_layers": counts[1],
    }
    if model.moe_every:  # what one all-to-all of one MoE layer and micro-batch sends from the busiest GPU, and its time
        tokens = b * model.seq // layout.cp / layout.tp
        sent = moe_a2a_bytes(tokens, model.hidden, model.top_k, layout.ep, ACT_BYTES, moe_load_factor(model, layout.ep))
        row["a2a_bytes"] = sent["dispatch_fwd"]
        row["a2a_s"] = a2a_seconds(cluster, sent["dispatch_fwd"], layout.ep, layout.per_node["ep"])
        row["ep_members_per_node"] = layout.per_node["ep"]
    return row


def _offload_row(cluster, model, layout, knobs, offload_seconds, counts, micro_batches):
    """What a row shows of offloading (0 where nothing is): the PCIe seconds of one step on the slowest stage (both
    ways, hidden or not; offload_s is their exposed part), and on stage 0 per micro-batch the most a layer copies each
    way and what a chunk keeps on the GPU (its input)."""
    pcie_s = sum(micro_batches * n * offload_seconds[kind][0] for n, kind in zip(counts, ("dense", "moe")) if n)
    if knobs.recompute not in OFFLOAD_POLICIES:
        return {"pcie_s": pcie_s, "offload_copied_bytes": 0.0, "offload_kept_bytes": 0.0}
    kept, copied = _stage_offload_bytes(cluster, model, layout.tp, layout.pp, layout.cp, layout.ep, knobs.micro_batch,
                                        knobs.recompute, knobs.sequence_parallel, knobs.pp_schedule in V_SCHEDULES)
    return {"pcie_s": pcie_s, "offload_copied_bytes": copied, "offload_kept_bytes": kept}


def _schedule_choices(cluster, model, layout, vs):
    """(v, schedule) pairs to try: a fixed pp_schedule; a fixed v alone keeps its first meaning (1F1B at 1, the
    interleaved schedule above); else each v with every schedule the implementation offers (zero bubble from
    pp = 2)."""
    if model.pp_schedule is not None:
        return [(v, model.pp_schedule) for v in vs]
    if model.virtual_stages is not None:
        return [(v, "1f1b" if v == 1 else "interleaved") for v in vs]
    zb = ["zb-h1"] if "zb-h1" in cluster.schedules and layout.pp > 1 else []
    v_shaped = [(2, s) for s in V_SCHEDULES if s in cluster.schedules and layout.pp > 1
                and model.layers % (2 * layout.pp) == 0]  # two chunks per GPU, whatever the interleaving tried
    return [(v, s) for v in vs for s in (["1f1b"] if v == 1 else
                                          [x for x in ("interleaved",) if x in cluster.schedules]) + zb] + v_shaped


def _zero_choices(cluster, model, layout):
    """(ZeRO level, shard size) pairs to try: the given ones, else every level the implementation offers over every DP
    x CP rank and, where that group crosses nodes, over one node's of them (HSDP)."""
    n = layout.dp * layout.cp
    if n == 1:
        return [(0 if model.zero is None else model.zero, None)]
    levels = ([model.zero] if model.zero is not None
              else [z for z in cluster.zero_levels if z or not model.zero_shard_size])
    if model.zero is None and 1 in levels:  # ZeRO-0 sends ZeRO-1's bytes, holds more and steps slower: never better
        levels.remove(0)
    if model.zero_shard_size is not None:
        return [(z, None if model.zero_shard_size == n else model.zero_shard_size) for z in levels]
    if layout.local["dp_cp"]:  # the whole group inside a node already: nothing to keep off the network
        return [(z, None) for z in levels]
    node = [k for k in _divisors(n) if k < n and _members_per_node(layout.tp, k, cluster.gpus, cluster.gpus_per_node)
            == k and k * layout.tp <= cluster.gpus_per_node]
    return [(z, None) for z in levels] + [(z, node[-1]) for z in levels if z and node and node[-1] > 1]


def _knob_choices(cluster, model, layout):
    """The knob values the search tries on one layout: the given ones, or every sensible value."""
    per_pipeline = model.global_batch // layout.dp
    bs = ([model.micro_batch] if model.micro_batch is not None
          else [b for b in range(1, min(per_pipeline, MAX_MICRO_BATCH) + 1) if per_pipeline % b == 0])
    sps = ([model.sequence_parallel] if model.sequence_parallel is not None
           else ([False, True] if layout.tp > 1 else [False]))
    if model.moe_every and layout.tp > 1:  # Megatron-Core requires SP with MoE and TP (train_gpt.py splits the tokens)
        if model.sequence_parallel is False:
            raise ValueError(f"sequence_parallel=False with MoE layers and tp={layout.tp}: the MoE tokens are split "
                             "over TP; use sequence_parallel=True (--sequence-parallel on) or tp=1")
        sps = [True]
    zeros = _zero_choices(cluster, model, layout)
    recomputes = ([model.recompute] if model.recompute is not None  # else the cheapest first
                  else list(SEARCH_ORDER_WITH_OFFLOAD if cluster.offload else RECOMPUTE_POLICIES))
    ulysses = [model.cp_ulysses] if model.cp_ulysses is not None else _ulysses_sizes(model, layout.tp, layout.cp)
    can_interleave = [x for x in ("interleaved", "zb-h1") if x in cluster.schedules]  # (V schedules: their own v)
    for b in bs:
        if model.virtual_stages is not None:
            vs = [model.virtual_stages]
        elif model.pp_schedule in V_SCHEDULES:
            vs = [2]
        elif (layout.pp < max(2, layout.interleave_min_pp) or (per_pipeline // b) % layout.pp or not can_interleave
              or model.pp_schedule == "1f1b"):  # and m a multiple of p
            vs = [2] if model.pp_schedule == "interleaved" else [1]  # interleaving that cannot run: its own error
        else:
            vs = [v for v in _divisors(model.layers // layout.pp) if v <= MAX_VIRTUAL_STAGES]
            if model.pp_schedule == "interleaved":
                vs = vs[1:] or [2]
        yield b, _schedule_choices(cluster, model, layout, vs), sps, zeros, recomputes, ulysses


def _ep_choices(cluster, model, tp, pp, cp):
    """Every EP size the search tries on (tp, pp, cp): 1 for a dense model, else those dividing the experts and
    the folding's ranks."""
    if not model.moe_every or cluster.gpus % (tp * pp * cp):
        return [1]
    pool = _ep_pool(cluster, tp, cp, cluster.gpus // (tp * pp * cp))
    return _divisors(math.gcd(pool, model.experts))


def _better(a, b):
    """The better of two rows: one that fits, then the faster; of two that do not fit, the smaller."""
    if b is None:
        return a
    key = (lambda r: (not r["fits"], r["step_time_s"] if r["fits"] else r["memory_gb"], r["step_time_s"]))
    return a if key(a) < key(b) else b


def estimate(cluster, model, tp, pp, cp, micro_batch=None, recompute=None, sequence_parallel=None, zero=None,
             virtual_stages=None, ep=None, pp_schedule=None, zero_shard_size=None, cp_ulysses=None, memo=None):
    """The planner's choice for one layout: over the knobs not fixed (here or in `model`), the fastest combination that
    fits, each ZeRO level with the cheapest recomputation that fits it (when none fits, the fastest of those with the
    least memory); for a MoE model likewise over EP when `ep` is None. Raises ValueError for a layout or knob that
    does not divide. `memo`: a dict the calls of one plan share (for the same cluster and model: what does not depend
    on pp)."""
    fixed = {"micro_batch": micro_batch, "recompute": recompute, "sequence_parallel": sequence_parallel,
             "zero": zero, "virtual_stages": virtual_stages, "pp_schedule": pp_schedule,
             "zero_shard_size": zero_shard_size, "cp_ulysses": cp_ulysses}
    fixed = {k: v for k, v in fixed.items() if v is not None}
    if fixed:
        model = replace(model, **fixed)
    if model.recompute is not None and model.recompute not in RECOMPUTE_KNOBS:
        raise ValueError(f"recompute={model.recompute!r}; choose one of {', '.join(RECOMPUTE_KNOBS)}")
    if ep is not None:
        return _best_for_layout(cluster, model, _Layout(cluster, model, tp, pp, cp, ep, memo))
    best, refused = None, None
    for e in _ep_choices(cluster, model, tp, pp, cp):
        try:
            best = _better(_best_for_layout(cluster, model, _Layout(cluster, model, tp, pp, cp, e, memo)), best)
        except ValueError as error:
            refused = refused or error
    if best is None:
        raise refused
    return best


def _best_for_layout(cluster, model, layout):
    """The search on one layout. For each (b, sp, v, schedule) and recomputation, cheapest first: the fastest
    (ZeRO level, shard) that fits, with the hybrid CP's Ulysses size that makes the stage fastest (it changes nothing
    else); a costlier recomputation is tried only while a faster ZeRO choice does not fit (`NEVER_FASTER_THAN`: an
    offload policy against selective or full depends on the bus, so both are tried). Memory is checked first and the
    step time computed only for what fits or holds no more than the least memory so far, from cached parts added in
    step_time_terms' order; the full row (evaluate) is built once, for the winner. A V schedule's rank 0 holds the
    first and the last stage: where its layers and parameters are those of the loop's stage 0 and last stage (a dense
    model, tied embeddings) it shares their cached time parts, less the tied embedding's all-reduce; else (`v_own`)
    it has its own. Memory: every candidate stage's instants (_PlanMemory: rank_peaks' prices)."""
    limit = cluster.gpu_mem_gb * MEMORY_HEADROOM
    best, best_time, least, least_key, refused = None, math.inf, None, (math.inf, math.inf), None
    split = _first_stage_parameters(model, layout.tp, layout.pp, layout.ep)
    v_split = _first_stage_parameters(model, layout.tp, layout.pp, layout.ep, True) if layout.pp > 1 else split
    v_own = not _v_rank_0_is_the_loops(model, layout.pp, split, v_split)
    tied_s = _tied_embedding_seconds(cluster, model, layout)  # what a V schedule does not all-reduce
    memories, stage_parts, zero_s, optimizer_s, own_optimizer, floors = {}, {}, {}, {}, {}, {}
    for b, pairs, sps, zeros, recomputes, ulysses in _knob_choices(cluster, model, layout):
        micro_batches = model.global_batch // (layout.dp * b)
        for z in zeros:
            if z not in optimizer_s:
                optimizer_s[z] = _optimizer_seconds(cluster, layout, *z, split)
            if v_own and z not in own_optimizer and pairs and pairs[-1][1] in V_SCHEDULES:  # the V pairs come last
                own_optimizer[z] = _optimizer_seconds(cluster, layout, *z, v_split)
        for sp in sps:
            forwards, cp_pairs, too_big = {}, {}, set()  # by Ulysses size, computed once something needs a step time

            def stage(recompute, schedule, v, own):
                """(_stage_parts with the fastest Ulysses size, that size, the ZeRO choices fastest first with
                their gradient-reduction seconds). An offload policy's wait depends on a split backward (its window)
                and v; a V schedule's own rank 0 (`own`) on its layers and parameters."""
                key = (b, sp, recompute) + ((schedule in SPLIT_SCHEDULES, v) if recompute in OFFLOAD_POLICIES
                                            else ()) + ((True,) if own else ())
                if key not in stage_parts:
                    if not forwards:
                        base = ("fs", layout.tp, layout.cp, layout.ep, b, sp)
                        if base + (1,) not in layout.memo:
                            layout.memo[base + (1,)] = _layer_forwards(cluster, model, layout, b, sp)
                        forwards[1] = layout.memo[base + (1,)]
                        if len(ulysses) > 1:
                            f = next(f for f in forwards[1].values() if f)
                            for x in ulysses:
                                key_cp = ("cp", layout.tp, layout.cp, b, x)
                                if key_cp not in layout.memo:
                                    layout.memo[key_cp] = (f["cp_fwd"], f["cp_bwd"]) if x == 1 else _cp_seconds(
                                        cluster, model, layout.tp, layout.cp, b, layout, f["attention"], x)
                                cp_pairs[x] = layout.memo[key_cp]
                    # every layer, dense or MoE, has the same CP terms, and every stage L/p layers: the Ulysses size
                    # with the least CP seconds per layer (layer_step's) makes every stage fastest
                    again = 1 if recomputation(recompute) == "none" else 2
                    u = ulysses[0] if len(ulysses) == 1 else min(
                        ulysses, key=lambda x: again * cp_pairs[x][0] + cp_pairs[x][1])
                    if u not in forwards:
                        key_u = ("fs", layout.tp, layout.cp, layout.ep, b, sp, u)
                        if key_u not in layout.memo:
                            layout.memo[key_u] = _layer_forwards(cluster, model, layout, b, sp, u, ring=forwards[1])
                        forwards[u] = layout.memo[key_u]
                    sp_parts = _stage_parts(cluster, model, layout, b, sp, recompute, forwards[u], schedule=schedule)
                    backward = _overlap_backward(cluster, layout, forwards[u], sp_parts[1])
                    zero_key = (micro_batches, backward) + ((True,) if own else ())
                    if zero_key not in zero_s:
                        zero_s[zero_key] = {z: _dp_seconds(cluster, model, layout, *z, micro_batches,
                                                           v_split if own else split, backward) for z in zeros}
                    dp_s, opt_s = zero_s[zero_key], own_optimizer if own else optimizer_s
                    terms, busy = _layer_terms(micro_batches, sp_parts, v)
                    stage_parts[key] = (sp_parts, u, sorted(zeros, key=lambda z: dp_s[z] + opt_s[z]), dp_s,
                                        sum(terms.values()), busy)
                return stage_parts[key]

            for v, schedule in pairs:
                try:
                    _check_knobs(model, layout.dp, layout.pp, b, v, layout.interleave_min_pp, schedule)
                except ValueError as e:  # this (b, v) cannot run on this layout; another micro-batch may
                    refused = refused or e
                    continue
                own = schedule in V_SCHEDULES and v_own
                pair_optimizer = own_optimizer if own else optimizer_s
                ruled_out = set()  # policies never faster than one that fitted with the fastest ZeRO choice
                for recompute in recomputes:
                    if recompute in ruled_out:
                        continue
                    if schedule == "zb-h1" and best is not None and (v, recompute) in too_big:
                        continue  # zero bubble holds at least what its base order holds, which fitted nowhere
                    pipeline = None
                    if best is not None:  # what cannot be faster than the best so far need not be priced in memory
                        sp_parts, u, fastest, dp_s, layers_s, busy = stage(recompute, schedule, v, own)
                        # step_time_terms' sum, in its order, from the cached parts
                        p2p_s, bubble_s = _pipeline_tail(schedule, layout.pp, v, micro_batches, busy, *sp_parts[3:])
                        pipeline = layers_s + p2p_s + bubble_s - (tied_s if schedule in V_SCHEDULES else 0.0)
                        if pipeline + dp_s[fastest[0]] + pair_optimizer[fastest[0]] >= best_time:
                            ruled_out.update(NEVER_FASTER_THAN.get(recompute, ()))  # costlier: slower still
                            continue
                    grown = floors.get((sp, recompute, v, schedule))
                    if grown is not None and (best is not None or grown > least_key[0]):
                        # a smaller micro-batch fitted with no ZeRO choice, and this one holds no less (k b and the
                        # working sets grow with b; not under zb-h1, whose deferred W's shrink as m does)
                        too_big.add((v, recompute))
                        continue
                    key = (b, sp, recompute, v, schedule)
                    if key not in memories:  # every candidate rank's instants (rank_peaks'), priced once
                        memories[key] = _PlanMemory(cluster, model, layout, Knobs(b, v, recompute, sp, 0, schedule))
                    memory = memories[key]
                    if best is not None:  # the fastest ZeRO choice that fits (those after it are not priced)
                        fitting = [z for z in (memory.first_fit(fastest, limit),) if z is not None]
                    else:
                        fitting = [z for z in zeros if memory.first_fit((z,), limit)]
                    if not fitting:
                        too_big.add((v, recompute))
                        floor = math.inf if best is not None else min(map(memory.gb, zeros))
                        if schedule != "zb-h1":
                            floors[(sp, recompute, v, schedule)] = floor
                    if not fitting and (best is not None or floor > least_key[0]):
                        continue  # the least memory matters only while nothing fits
                    if pipeline is None:
                        sp_parts, u, fastest, dp_s, layers_s, busy = stage(recompute, schedule, v, own)
                        p2p_s, bubble_s = _pipeline_tail(schedule, layout.pp, v, micro_batches, busy, *sp_parts[3:])
                        pipeline = layers_s + p2p_s + bubble_s - (tied_s if schedule in V_SCHEDULES else 0.0)
                    if not fitting:
                        for z in zeros:
                            memory_gb = memory.gb(z)
                            # knob sets can tie on memory (another b or v with as many sequences in flight): of
                            # those, the fastest, not the first tried
                            if memory_gb <= least_key[0] and (memory_gb, pipeline + dp_s[z] + pair_optimizer[z]) \
                                    < least_key:
                                least = Knobs(b, v, recompute, sp, *z[:1], schedule, z[1], u)
                                least_key = (memory_gb, pipeline + dp_s[z] + pair_optimizer[z])
                        continue
                    z = next(z for z in fastest if z in fitting)
                    step = pipeline + dp_s[z] + pair_optimizer[z]
                    if step < best_time:
                        best, best_time = Knobs(b, v, recompute, sp, z[0], schedule, z[1], u), step
                    if z == fastest[0] or pipeline + dp_s[fastest[0]] + pair_optimizer[fastest[0]] >= best_time:
                        # a costlier recomputation only adds time: it cannot win even with the fastest ZeRO
                        ruled_out.update(NEVER_FASTER_THAN.get(recompute, ()))
    if best is None and least is None:
        raise refused
    return evaluate(cluster, model, layout, best or least)


def _v_rank_0_is_the_loops(model, pp, split, v_split):
    """Whether a V schedule's rank 0 holds what the loop's stage 0 holds (parameters) and is its slowest rank as the
    loop's last stage is (layers of each kind): then the search shares their parts."""
    if pp == 1 or split != v_split:
        return pp == 1
    if rank_layer_counts(model, pp, 0, True) != stage_layer_counts(model, pp, 0) or \
            rank_layer_counts(model, pp, 0, True) != stage_layer_counts(model, pp, pp - 1):
        return False
    return not model.moe_every or (_busiest_moe_stage(model.layers, pp, model.moe_every, True)[1:]
                                   == _busiest_moe_stage(model.layers, pp, model.moe_every)[1:])


def candidate_layouts(cluster, model, tp=None, pp=None, cp=None, ep=None):
    """The planner's choice for every (tp, pp, cp, ep) that divides the cluster and the model; TP inside a node
    unless given, CP up to 16, EP over the sizes that divide the experts and the folding's ranks."""
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):  # None: every size that divides is tried
        if value is not None:
            _check_count(name, value, "omit it to let the planner choose")
    out, memo = [], {}
    all_fixed = None not in (tp, pp, cp, ep) or (None not in (tp, pp, cp) and not model.moe_every)
    tps = [tp] if tp is not None else [t for t in _divisors(cluster.gpus_per_node) if model.heads % t == 0]
    pps = [pp] if pp is not None else _divisors(model.layers)
    cps = [cp] if cp is not None else [c for c in range(1, 17)
                                       if cluster.gpus % c == 0 and (c == 1 or model.seq % (2 * c) == 0)]
    layouts = [(t, p, c, e) for t, p, c in itertools.product(tps, pps, cps)
               for e in ([ep] if ep is not None else _ep_choices(cluster, model, t, p, c))]
    divide = [(t, p, c, e) for t, p, c, e in layouts  # checked early: building the error text costs more than planning
              if cluster.gpus % (t * p * c) == 0 and model.layers % p == 0 and model.heads % t == 0
              and model.global_batch % (cluster.gpus // (t * p * c)) == 0]
    for t, p, c, e in layouts if all_fixed else divide:
        try:
            out.append(estimate(cluster, model, t, p, c, ep=e, memo=memo))
        except ValueError:
            if all_fixed:
                raise
    if not out:  # the given sizes or knobs rule out every layout: the distinct reasons, of those that divide first
        reasons = {}
        for t, p, c, e in divide or layouts:
            try:
                estimate(cluster, model, t, p, c, ep=e)
            except ValueError as err:
                reasons.setdefault(str(err), f"TP={t} PP={p} CP={c}" + (f" EP={e}" if model.moe_every else ""))
        if reasons:
            raise ValueError("no layout takes these sizes and knobs: " + "; ".join(
                f"{where}: {why}" for why, where in list(reasons.items())[:3]))
    return out


def plan(cluster, model, tp=None, pp=None, cp=None, ep=None):
    """The planner's choice for every candidate layout, the ones that fit first, fastest first."""
    if model.recompute is not None and model.recompute not in RECOMPUTE_KNOBS:
        raise ValueError(f"recompute={model.recompute!r}; choose one of {', '.join(RECOMPUTE_KNOBS)}")
    plans = candidate_layouts(cluster, model, tp, pp, cp, ep)
    if not plans:
        raise ValueError("no layout divides this cluster and model: check gpus, layers (pp), heads (tp), "
                         "seq (cp), experts (ep) and global_batch (dp * micro_batch)")
    return sorted(plans, key=lambda r: (not r["fits"], r["step_time_s"]))


def _layout_name(r):
    return f"TP={r['tp']} PP={r['pp']} DP={r['dp']} CP={r['cp']}" + (f" EP={r['ep']}" if "a2a_bytes" in r else "")


def _knobs_name(r):
    shard = f" sharded over {r['zero_shard_size']} (HSDP)" if r.get("zero_shard_size") else ""
    ulysses = (f", CP as Ulysses {r['cp_ulysses']} x ring {r['cp'] // r['cp_ulysses']}"
               if r.get("cp_ulysses", 1) > 1 else "")
    return (f"micro-batch {r['micro_batch']}, {r['virtual_stages']} chunk(s) per stage ({r['pp_schedule']}), "
            f"recompute {r['recompute']}, SP {'on' if r['sequence_parallel'] else 'off'}, "
            f"ZeRO-{r['zero']}{shard}{ulysses}")


OVERHEADS = ("tp_s", "cp_s", "pp_p2p_s", "bubble_s", "dp_s", "optimizer_s", "ep_s", "offload_s")


def explain_ep(best, plans, cluster):
    """What the EP all-to-alls of a MoE plan cost and why its EP group sits where it does, in numbers: the bytes
    and time of one all-to-all, per step, and the fastest plan that puts EP on the other side of a node boundary."""
    where = {True: "NVLink (inside a node)", False: "InfiniBand (across nodes)"}
    if best["ep"] == 1:
        line = ("  MoE: EP=1, every expert on every GPU: no all-to-all" +
                ("" if len(plans) == 1 else f" (memory {best['memory_gb']:.1f} GB fits)") + ".")
    else:
        local = best["intra_node"]["ep"]
        line = (f"  MoE: EP={best['ep']} all-to-alls on {where[local]}, {best['ep_members_per_node']} of {best['ep']} "
                f"members per node: each sends {best['a2a_bytes'] / 1e6:.1f} MB per GPU (T k h e (P-1)/P x f) in "
                f"{best['a2a_s'] * 1e3:.3f} ms; 4 per MoE layer and micro-batch: {best['ep_s']:.3f} s per step "
                f"({best['ep_s'] / best['step_time_s']:.1%}).")
    lines = [line]
    other = [r for r in plans if r["fits"] and r["ep"] > 1 and r["intra_node"]["ep"] != best["intra_node"]["ep"]]
    if best["ep"] > 1 and other:
        o = other[0]
        lines.append(f"  The fastest plan with EP on {where[o['intra_node']['ep']]}, {_layout_name(o)}, is "
                     f"{o['step_time_s'] / best['step_time_s'] - 1:+.1%} slower: {o['a2a_bytes'] / 1e6:.1f} MB per "
                     f"all-to-all in {o['a2a_s'] * 1e3:.3f} ms ({o['ep_members_per_node']} of {o['ep']} members per "
                     f"node), {o['ep_s']:.3f} s per step; memory {o['memory_gb']:.1f} GB against "
                     f"{best['memory_gb']:.1f} GB.")
    return lines


def explain_offload(best, cluster):
    """What offloading moves, keeps and costs in the plan `best`, in numbers."""
    return (f"  Offload ({best['recompute']}): a layer copies up to {best['offload_copied_bytes'] / 1e6:.1f} MB per "
            f"micro-batch to the host in its forward and back in its backward, {best['pcie_s']:.3f} s of PCIe per "
            f"step at {cluster.pcie_gbps:g} GB/s, {best['offload_s']:.3f} s of it exposed (not hidden behind the "
            f"layers' compute); kept on the GPU: {best['offload_kept_bytes'] / 1e6:.1f} MB per chunk and micro-batch "
            f"in flight (its input) and two layers' copies (one computing its backward, one prefetched): activations "
            f"{best['activations_gb']:.1f} GB.")


def explain(plans, cluster, recompute=None):
    """Say in words why the first plan wins. `recompute`: the policy the user fixed (None: the planner tried
    them all, full recomputation included), so that a layout that does not fit is said to fail with what was
    tried."""
    best = plans[0]
    lines = []
    tried = "even with full recomputation" if recompute is None else f"with recompute fixed to {recompute}"
    if not best["fits"]:  # plans are ranked by step time: the least bad is the smallest, not the first
        least = min(plans, key=lambda r: r["memory_gb"])
        untried = ["full recomputation"] if recompute not in (None, "full") else []
        if least["zero"] < 3 and least["dp"] * least["cp"] > 1:  # ZeRO shards over DP x CP: only there it helps
            untried.append(f"ZeRO-{least['zero'] + 1}" + ("" if least["zero"] == 2 else "..3"))
        lines.append(f"No layout fits in {cluster.gpu_mem_gb} GB (x{MEMORY_HEADROOM} headroom) {tried}; the least "
                     f"bad is {_layout_name(least)} at {least['memory_gb']:.1f} GB: use "
                     f"{', '.join(untried + ['more pipeline stages or more GPUs'])}.")
        return "\n".join(lines)
    where = {True: "NVLink (inside a node)", False: "InfiniBand (across nodes)"}
    lines.append(f"Best: {_layout_name(best)} with {_knobs_name(best)}: {best['micro_batches']} micro-batches per "
                 f"pipeline, {best['memory_gb']:.1f} GB per GPU, {best['step_time_s']:.3f} s per step, "
                 f"{best['tflops_per_gpu']:.0f} TFLOP/s per GPU (Narayanan et al.'s count), MFU {best['mfu']:.1%}, "
                 f"HFU {best['hfu']:.1%}.")
    pp_sends = f"; PP sends on {where[best['intra_node']['pp']]}" if best["pp"] > 1 else ""
    lines.append(f"  TP collectives run on {where[best['intra_node']['tp']]}; DP gradient reduction on "
                 f"{where[best['intra_node']['dp_cp']]}{pp_sends}.")
    if "a2a_bytes" in best:
        lines.extend(explain_ep(best, plans, cluster))
    if best["recompute"] in OFFLOAD_POLICIES:
        lines.append(explain_offload(best, cluster))
    overheads = {k: best[k] for k in OVERHEADS}
    worst = max(overheads, key=overheads.get)
    lines.append(f"  Compute is {best['compute_s'] / best['step_time_s']:.0%} of the step; the largest overhead "
                 f"is {worst[:-2]} ({overheads[worst]:.3f} s); pipeline bubble {best['bubble_fraction']:.1%}.")
    fitting = [r for r in plans if r["fits"]]
    if len(fitting) > 1:
        second = fitting[1]
        diffs = {k: second[k] - best[k] for k in ("compute_s",) + OVERHEADS}
        why = max(diffs, key=diffs.get)
        lines.append(f"  Runner-up {_layout_name(second)} ({_knobs_name(second)}) is "
                     f"{second['step_time_s'] / best['step_time_s'] - 1:.1%} slower, mostly in {why[:-2]} "
                     f"(+{diffs[why]:.3f} s).")
    too_big = [r for r in plans if not r["fits"]]
    if too_big:
        lines.append(f"  {len(too_big)} of {len(plans)} layouts do not fit in memory {tried} "
                     f"(e.g. {_layout_name(too_big[0])}: {too_big[0]['memory_gb']:.1f} GB).")
    return "\n".join(lines)


def format_table(plans, limit=12):
    cols = [("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("cp", "cp"), ("u", "cp_ulysses"), ("b", "micro_batch"),
            ("v", "virtual_stages"), ("sched", "pp_schedule"), ("m", "micro_batches"), ("recomp", "recompute"),
            ("sp", "sequence_parallel"), ("zero", "zero"),
            ("mem GB", "memory_gb"), ("fits", "fits"), ("step s", "step_time_s"), ("TFLOP/s", "tflops_per_gpu"),
            ("compute", "compute_s"), ("TP", "tp_s"), ("PP p2p", "pp_p2p_s"), ("bubble", "bubble_s"),
            ("DP", "dp_s"), ("CP", "cp_s"), ("optim", "optimizer_s")]
    if any("a2a_bytes" in r for r in plans[:limit]):  # MoE: the EP size and its all-to-alls
        cols[5:5] = [("ep", "ep")]
        cols.append(("EP a2a", "ep_s"))
    if any(r["recompute"] in OFFLOAD_POLICIES for r in plans[:limit]):  # the copies' bus time and its exposed part
        cols += [("PCIe", "pcie_s"), ("exposed", "offload_s")]
    rows = [" ".join(f"{h:>8s}" for h, _ in cols)]
    for r in plans[:limit]:
        cells = []
        for _, c in cols:
            v = r[c]
            if c == "zero":  # the level, /k with HSDP
                v = f"{v}" + (f"/{r['zero_shard_size']}" if r["zero_shard_size"] else "")
            elif c == "pp_schedule":
                v = {"interleaved": "interlvd", "dualpipev": "dualpv"}.get(v, v)
            elif c == "recompute":
                v = {"selective+offload": "sel+offl"}.get(v, v)
            cells.append(f"{v:>8.3f}" if isinstance(v, float) else f"{str(v):>8s}")
        rows.append(" ".join(cells))
    if len(plans) > limit:
        rows.append(f"... {len(plans) - limit} more")
    return "\n".join(rows)


# ---- from plan to run --------------------------------------------------------------------------------

TRAIN_GPT_DTYPES = ("bfloat16", "float16")  # train_gpt.py's 16-bit --dtype values: what the cost model assumes


def torchrun_command(row, model, cluster, dtype="bfloat16", steps=1000, data="embedded", out_dir="out",
                     save_every=None):
    """The torchrun line that runs `row`, a plan of `model` on `cluster`, with train_gpt.py: nodes, processes per node,
    every train_gpt.py flag of the layout, schedule, ZeRO level, recomputation, dtype, batch and model (DP is the
    world over TP x CP x PP there too), and the job's: its steps, data, checkpoint folder (saved every `save_every`,
    a tenth of the run by default) and --resume, so that a restarted job continues. CP runs as ring (u = 1),
    Ulysses (u = cp) or hybrid with --cp-ulysses u.
    Raises ValueError naming the flag where the model is one train_gpt.py cannot build: its GPT has multi-head
    attention, GeLU MLPs of 4h and tied embeddings, its MoE block moe_ep.MoE(h, 4h, E, k) routes dropless and
    folds EP over DP x CP."""
    refused = [(model.kv_heads not in (None, model.heads), "--kv-heads", "multi-head attention"),
               (model.swiglu, "--swiglu", "GeLU MLPs"),
               (not model.tied_embeddings, "--untie-embeddings", "tied embeddings"),
               (model.moe_every and model.expert_hidden not in (None, 4 * model.hidden), "--expert-hidden",
                "experts of 4 x hidden"),
               (model.moe_every and model.shared_expert_hidden, "--shared-expert-hidden", "no shared expert"),
               (model.moe_every and model.capacity_factor is not None, "--capacity-factor", "dropless routing"),
               (cluster.expert_folding != "dp_cp", "--expert-folding", "EP folded over DP x CP (dp_cp)")]
    for bad, flag, what in refused:
        if bad:
            raise ValueError(f"--command: train_gpt.py runs {what}; plan without {flag} to get a command")
    if dtype not in TRAIN_GPT_DTYPES:
        raise ValueError(f"dtype={dtype!r} (--dtype); choose one of {', '.join(TRAIN_GPT_DTYPES)}")
    gpus, per_node = cluster.gpus, cluster.gpus_per_node
    if gpus > per_node and gpus % per_node:
        raise ValueError(f"--command: gpus={gpus} is not a whole number of nodes of gpus_per_node={per_node}")
    nodes, per_node = (1, gpus) if gpus <= per_node else (gpus // per_node, per_node)
    launch = f"torchrun --nnodes={nodes} --nproc_per_node={per_node}"
    if nodes > 1:
        launch += " --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500"
    u, cp = row["cp_ulysses"], row["cp"]
    impl = "ring" if u == 1 else "ulysses" if u == cp else "hybrid"
    flags = [("--tp", row["tp"]), ("--pp", row["pp"]), ("--cp", cp), ("--ep", row["ep"])]
    flags += [("--sequence-parallel", None)] if row["sequence_parallel"] else []
    flags += [("--cp-impl", impl)] + ([("--cp-ulysses", u)] if impl == "hybrid" else [])
    flags += [("--pp-schedule", row["pp_schedule"]), ("--virtual-stages", row["virtual_stages"]),
              ("--zero", row["zero"])] + ([("--zero-shard-size", row["zero_shard_size"])]
                                          if row["zero_shard_size"] else [])
    flags += [("--recompute", row["recompute"]), ("--dtype", dtype), ("--micro-batch", row["micro_batch"]),
              ("--batch", model.global_batch), ("--layers", model.layers), ("--hidden", model.hidden),
              ("--heads", model.heads),
              ("--seq", model.seq), ("--vocab", model.vocab)]
    if model.moe_every:
        flags += [("--moe-every", model.moe_every), ("--experts", model.experts), ("--top-k", model.top_k)]
    flags += [("--steps", steps), ("--data", shlex.quote(data)), ("--out-dir", shlex.quote(out_dir)),
              ("--save-every", save_every or max(1, steps // 10)), ("--resume", None)]
    return f"{launch} train_gpt.py " + " ".join(flag if value is None else f"{flag} {value}" for flag, value in flags)


# ----------------------------------------------------------------------------------------------------
# Calibration: Narayanan et al. 2021 (SC'21), Table 1, against the planner
# ----------------------------------------------------------------------------------------------------

# Sequence 2048, vocabulary 51200, A100 80 GB, 8 GPUs per node. Micro-batch, interleaving and the DDP
# implementation are those of the paper's artifact (Megatron-LM examples/sc21/run_table_1.sh); every run used
# full recomputation ("--activations-checkpoint-method uniform"), fp16, no sequence parallelism and no
# distributed optimizer (neither existed yet). Torch DDP (PP = 1 rows) overlaps the gradient all-reduce with
# the backward; Megatron-LM's "local" DDP (PP > 1 rows) runs it after the backward.
TABLE_1 = [
    # params (B), heads, hidden, layers, TP, PP, GPUs, batch, measured TFLOP/s per GPU, micro-batch, chunks, ddp
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 16, 1, "torch"),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 16, 1, "torch"),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 16, 1, "torch"),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 1, "torch"),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 1, "local"),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 3, "local"),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 2, "local"),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 2, "local"),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 3, "local"),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 1, "local"),
]
TABLE_1_SEQ, TABLE_1_VOCAB = 2048, 51200


def table_1_model(row, published_knobs):
    _, heads, hidden, layers, _, _, _, batch, _, mb, chunks, _ = row
    model = ModelShape(layers=layers, hidden=hidden, heads=heads, seq=TABLE_1_SEQ, vocab=TABLE_1_VOCAB,
                   global_batch=batch)
    if published_knobs:
        model = replace(model, micro_batch=mb, recompute="full", sequence_parallel=False, zero=False,
                        virtual_stages=chunks)
    return model


# What the authors' software offered: full recomputation (the only kind, used in every run), no sequence
# parallelism, no distributed optimizer, no context parallelism (SOFTWARE_2021, knobs of the model); torch DDP
# (overlapped) only without a pipeline, the interleaved schedule only from PP = 3 and no zero-bubble schedule
# (CLUSTER_2021, properties of the implementation). The planner still chooses the micro-batch size and the
# interleaving, as the authors did.
SOFTWARE_2021 = dict(recompute="full", sequence_parallel=False, zero=False)
# fp16 gradient buffers, the unfused attention, GPT-3's dropout
PROGRAM_2021 = dict(grad_bytes=2, flash_attention=False, dropout=True)
CLUSTER_2021 = dict(overlap_grad_reduce="without_pp", interleave_min_pp=3, schedules=("1f1b", "interleaved"),
                    **PROGRAM_2021)


def published_estimate(row, **cluster_overrides):
    """The planner's estimate of one Table 1 run as published: its layout, micro-batch and interleaving, full
    recomputation, fp16, its DDP (CLUSTER_2021)."""
    _, _, _, _, tp, pp, gpus, *_ = row
    return estimate(Cluster(gpus=gpus, **{**CLUSTER_2021, **cluster_overrides}), table_1_model(row, True), tp, pp, 1)


EFFICIENCY_GRID = [round(0.60 + 0.01 * i, 2) for i in range(31)]  # e_max candidates, 0.60 .. 0.90


def fit_efficiency(**cluster_overrides):
    """How the A100 preset's e_max was chosen, once: with every other constant fixed, the e_max of the grid that
    minimises the largest |predicted / measured - 1| over the ten rows of Table 1. Returns (e_max, errors)."""
    def errors(e):
        return {row[0]: published_estimate(row, **{**cluster_overrides, "efficiency": e})["tflops_per_gpu"] / row[8]
                - 1 for row in TABLE_1}
    best = min(EFFICIENCY_GRID, key=lambda e: max(map(abs, errors(e).values())))
    return best, errors(best)


def calibrate(every_knob=True, **cluster_overrides):
    """For each row of Table 1: the prediction for the published run (its layout and knobs); the planner with
    the 2021 software (SOFTWARE_2021) on the published (TP, PP) and over every layout; with `every_knob`, the planner
    with every knob it knows (today's Megatron-LM options) likewise, on the same program (PROGRAM_2021: the
    published runs' fp16 gradient buffers, unfused attention and dropout)."""
    out = []
    for row in TABLE_1:
        params_b, _, _, _, tp, pp, gpus, _, measured, _, _, ddp = row
        assert (ddp == "torch") == (pp == 1)  # so CLUSTER_2021's "without_pp" is each row's own DDP
        published = published_estimate(row, **cluster_overrides)
        result = {"params_b": params_b, "tp": tp, "pp": pp, "gpus": gpus, "measured_tflops": measured,
                  "published": published, "error": published["tflops_per_gpu"] / measured - 1}
        for name, cluster, model, cp in (
                ("2021", Cluster(gpus=gpus, **{**CLUSTER_2021, **cluster_overrides}),
                 replace(table_1_model(row, False), **SOFTWARE_2021), 1),
                ("today", Cluster(gpus=gpus, **{**PROGRAM_2021, **cluster_overrides}), table_1_model(row, False),
                 None))[:1 + every_knob]:
            on_published = estimate(cluster, model, tp, pp, 1)
            top = plan(cluster, model, cp=cp)[0]
            result[name] = {"on_published": on_published, "top": top,
                            "top_is_published": (top["tp"], top["pp"], top["cp"]) == (tp, pp, 1),
                            "published_slower": on_published["step_time_s"] / top["step_time_s"] - 1}
        out.append(result)
    return out


# Costs of the 2021 implementation the model could be missing, each as constants of the Cluster: does any of them
# bring the 18.4B and 39.1B runs' published (TP, PP) within 5% of the planner's top choice while Table 1 stays
# within 6%? (`python topology.py calibrate --scan`; e_max is refitted for each)
COST_VARIANTS = {
    "as modelled": {},
    "pipeline exchanges at 15 GB/s (NCCL send/recv below its collectives)": dict(p2p_gbps=15),
    "pipeline exchanges at 4 GB/s": dict(p2p_gbps=4),
    "1 ms per pipeline exchange": dict(p2p_latency_us=1000),
    "4 ms per exchange (a host stall: 2021 synchronises after each)": dict(p2p_latency_us=4000),
    "4 GB/s and 4 ms per exchange": dict(p2p_gbps=4, p2p_latency_us=4000),
    "TP all-reduces at 600 GB/s (twice NVLink's wire speed)": dict(nvlink_gbps=600),
}


def scan_cost_variants(variants=COST_VARIANTS):
    """For each variant: the refitted e_max, the worst Table 1 error, and how much slower each published (TP, PP)
    is than the 2021 planner's top choice."""
    out = {}
    for name, overrides in variants.items():
        e_max, errors = fit_efficiency(**overrides)
        rows = calibrate(every_knob=False, **{**overrides, "efficiency": e_max})
        out[name] = {"e_max": e_max, "worst_error": max(errors.values(), key=abs),
                     "published_slower": {r["params_b"]: r["2021"]["published_slower"] for r in rows}}
    return out


def print_cost_scan(scan):
    print("Costs the model could be missing, each with e_max refitted: the worst Table 1 error, the rows whose\n"
          "published (TP, PP) is within 5% of the 2021 planner's top choice, and the two rows that are not as "
          "modelled:")
    print(f"{'variant':<70s} {'e_max':>5s} {'worst':>7s} {'within 5%':>9s} {'18.4B':>7s} {'39.1B':>7s}")
    for name, r in scan.items():
        slower = r["published_slower"]
        within = sum(v <= 0.05 for v in slower.values())
        print(f"{name:<70s} {r['e_max']:>5.2f} {r['worst_error']:>+7.1%} {within:>6d}/10 {slower[18.4]:>+7.1%} "
              f"{slower[39.1]:>+7.1%}")


def _zero_short(x):
    """ZeRO-0 and 1 as off and on (the Table 1 columns of before the levels), higher levels by number; /k: HSDP."""
    level = {0: "off", 1: "on"}.get(x["zero"], str(x["zero"]))
    return level + (f"/{x['zero_shard_size']}" if x.get("zero_shard_size") else "")


def _extra_knobs_short(x):
    """The knobs that only show where they differ from 1F1B or interleaved and a plain ring: " zb" and " u=2"."""
    schedule = {"zb-h1": " zb", "zbv": " zbv", "dualpipev": " dpv"}.get(x.get("pp_schedule"), "")
    return schedule + (f" u={x['cp_ulysses']}" if x.get("cp_ulysses", 1) > 1 else "")


def _knobs_short(x):
    on_off = {True: "on", False: "off"}
    return (f"b={x['micro_batch']} v={x['virtual_stages']} {x['recompute']} SP={on_off[x['sequence_parallel']]} "
            f"ZeRO={_zero_short(x)}{_extra_knobs_short(x)}")


def print_calibration(rows):
    print("Narayanan et al. 2021, Table 1 (A100 80 GB, s=2048, V=51200) against the planner. TFLOP/s per GPU are "
          "counted as the paper counts them:\n96 B s L h^2 (1 + s/6h + V/16Lh) per step / step time / GPUs. "
          "'predicted': the published run (layout, micro-batch, interleaving,\nfull recomputation, fp16, DDP).")
    print(f"\n{'params':>8s} {'TP':>3s} {'PP':>3s} {'GPUs':>5s} {'b':>3s} {'v':>3s} {'measured':>9s} {'predicted':>9s} "
          f"{'error':>7s} {'memory GB':>10s}")
    for r in rows:
        p = r["published"]
        print(f"{r['params_b']:>7.1f}B {r['tp']:>3d} {r['pp']:>3d} {r['gpus']:>5d} {p['micro_batch']:>3d} "
              f"{p['virtual_stages']:>3d} {r['measured_tflops']:>9.0f} {p['tflops_per_gpu']:>9.1f} {r['error']:>+7.1%} "
              f"{p['memory_gb']:>10.1f}")
    worst = max(rows, key=lambda r: abs(r["error"]))
    print(f"worst error {worst['error']:+.1%} ({worst['params_b']}B); every published run fits in "
          f"{DEFAULT_GPU_MEM_GB} GB x {MEMORY_HEADROOM}: {all(r['published']['fits'] for r in rows)}")
    titles = {"2021": "The planner with the authors' software (full recomputation, no SP, no ZeRO, no CP; it "
                      "chooses b and v):",
              "today": "The planner with every knob (recomputation, SP, ZeRO 0-3 and HSDP, CP and its Ulysses size, b, "
                       "v, the schedule; DDP not overlapped; zb: ZB-H1, u: Ulysses size, ZeRO=3/8: level/HSDP shard):"}
    for name, title in titles.items():
        print(f"\n{title}\n{'params':>8s}   {'on the published (TP, PP)':<38s} {'step s':>7s}   "
              f"{'top choice':<50s} {'step s':>7s} {'published slower':>17s}")
        for r in rows:
            on, top = r[name]["on_published"], r[name]["top"]
            top_name = f"TP={top['tp']} PP={top['pp']} CP={top['cp']} {_knobs_short(top)}"
            print(f"{r['params_b']:>7.1f}B   {_knobs_short(on):<38s} {on['step_time_s']:>7.2f}   {top_name:<50s} "
                  f"{top['step_time_s']:>7.2f} {r[name]['published_slower']:>+17.1%}")
        agree = sum(r[name]["top_is_published"] for r in rows)
        within = [r for r in rows if r[name]["published_slower"] <= 0.05]
        print(f"top choice = published (TP, PP) in {agree} of {len(rows)} rows; published within 5% of the top in "
              f"{len(within)} of {len(rows)} (worst of those {max(r[name]['published_slower'] for r in within):+.1%})")
        if name == "2021":
            print_step_terms([r for r in rows if r[name]["published_slower"] > 0.05], name)


STEP_TERMS = (("GEMMs", "gemm_s"), ("attn", "attention_s"), ("LN/drop", "elementwise_s"), ("logits", "output_layer_s"),
              ("TP", "tp_s"), ("p2p", "pp_p2p_s"), ("bubble", "bubble_s"), ("DP+emb", "dp_s"),
              ("optim", "optimizer_s"), ("step", "step_time_s"))


def print_step_terms(rows, name):
    """Seconds per step by term, the published (TP, PP) beside the top choice, for the rows where they differ by
    more than 5%: the first four terms are compute_s, GEMMs to logits."""
    if not rows:
        return
    print("Where the time goes (seconds per step; LN/drop: LayerNorms, bias-dropout-adds, GeLU, replicated over TP "
          "without SP; DP+emb: gradient all-reduce and the tied embedding's):")
    print(f"{'':>8s} {'layout':<24s}" + "".join(f"{label:>8s}" for label, _ in STEP_TERMS))
    for r in rows:
        for label, x in (("published", r[name]["on_published"]), ("top", r[name]["top"])):
            layout = f"TP={x['tp']} PP={x['pp']} b={x['micro_batch']} v={x['virtual_stages']}"
            print(f"{r['params_b']:>7.1f}B {layout:<24s}" + "".join(f"{x[k]:>8.2f}" for _, k in STEP_TERMS)
                  + f"  ({label})")


# ----------------------------------------------------------------------------------------------------
# Calibration: published MoE runs (Megatron-Core on H100), against the planner
# ----------------------------------------------------------------------------------------------------

# The software of the published MoE runs, Megatron-Core 2025 (the model configurations of the runs, see
# MOE_RUNS): flash attention, fp32 main grads under bf16 with the distributed optimizer (ZeRO-1), the gradient
# reduction overlapped, MoE parallel folding with expert TP 1 (EP drawn from all tp x dp ranks of a stage), the
# 1F1B and interleaved schedules and ZeRO-0/1 for the search (no zero bubble, no ZeRO-2/3 in those runs; calibrate_moe's
# `top_all` adds them), and the run's knobs: micro-batch 1, no recomputation, sequence parallelism.
MEGATRON_CORE_2025 = dict(overlap_grad_reduce=True, flash_attention=True, grad_bytes=4, expert_folding="tp_dp_cp",
                          schedules=("1f1b", "interleaved"), zero_levels=(0, 1))
MOE_RUN_KNOBS = dict(micro_batch=1, recompute="none", sequence_parallel=True, zero=True)
# Measured MFU: Liu et al. 2025, "MoE Parallel Folding" (arXiv 2504.14960), abstract: 49.3% for Mixtral 8x22B and
# 39.0% for Qwen2-57B-A14B on H100 (128 and 64 GPUs). Layouts and shapes: the paper's authors' benchmark
# configurations of April 2025 (github.com/yanring/Megatron-MoE-ModelZoo, runtime.conf and
# model_configs/benchmarking/*.yaml): sequence 4096, global batch 256, micro-batch 1, GQA, SwiGLU experts, untied
# embeddings, RoPE (positions are counted here as learned: 25 M parameters on stage 0, conservative), no dropout
# (masks are counted: conservative), balanced load (benchmark mode: tokens dropped at capacity factor 1).
# Mixtral's layout was changed to v = 7 in July 2025: MIXTRAL_V7 below.
MOE_RUNS = (
    {"name": "Mixtral 8x22B", "gpus": 128, "measured_mfu": 0.493, "tp": 2, "pp": 8, "cp": 1, "ep": 8,
     "virtual_stages": 1,
     "model": ModelShape(layers=56, hidden=6144, heads=48, kv_heads=8, seq=4096, vocab=32000, global_batch=256,
                         moe_every=1, experts=8, top_k=2, expert_hidden=16384, swiglu=True, tied_embeddings=False,
                         capacity_factor=1.0)},
    {"name": "Qwen2-57B-A14B", "gpus": 64, "measured_mfu": 0.390, "tp": 2, "pp": 4, "cp": 1, "ep": 4,
     "virtual_stages": 7,
     "model": ModelShape(layers=28, hidden=3584, heads=28, kv_heads=4, seq=4096, vocab=151936, global_batch=256,
                         moe_every=1, experts=64, top_k=8, expert_hidden=2560, shared_expert_hidden=20480,
                         swiglu=True, tied_embeddings=False, capacity_factor=1.0)},
)


MIXTRAL_V7 = dict(MOE_RUNS[0], virtual_stages=7)


def megatron_flops_per_token(model):
    """FLOPs per token as Megatron-Core counts them for its MFU (training.py, num_floating_point_operations):
    12 h^2 ((1 + g/a + s/h) + f k (3/2 with SwiGLU) / h + f_s (3/2) / h) per layer + 6 V h, i.e.
    `flops_per_token` without the router (6 E h) and the weighted sum of the k outputs (6 k h)."""
    h, kv, mats = model.hidden, _kv_width(model), 3 if model.swiglu else 2
    moe = moe_layers_between(model, 0, model.layers)
    mlp = ((model.layers - moe) * 8 * h * h
           + moe * mats * h * (model.top_k * expert_hidden(model) + model.shared_expert_hidden))
    return 6 * (model.layers * (2 * h * h + 2 * h * kv) + mlp + model.vocab * h) + 12 * model.layers * h * model.seq


def moe_run_cluster(run, **cluster_overrides):
    return Cluster.for_gpu("h100", run["gpus"], **{**MEGATRON_CORE_2025, **cluster_overrides})


def calibrate_moe(runs=MOE_RUNS, **cluster_overrides):
    """For each published MoE run: the prediction for its layout and knobs (`MOE_RUN_KNOBS`), its MFU in
    Megatron-Core's count against the measured one, and the planner's top choice with the same software and
    every knob free (TP, PP, CP and its Ulysses size, EP, micro-batch, v, recomputation, ZeRO); `top_all` with every
    schedule and ZeRO level the planner knows (zero bubble, ZeRO-2/3, HSDP)."""
    out = []
    for run in runs:
        cluster, model = moe_run_cluster(run, **cluster_overrides), run["model"]
        published = estimate(cluster, model, run["tp"], run["pp"], run["cp"], ep=run["ep"],
                             virtual_stages=run["virtual_stages"], **MOE_RUN_KNOBS)
        per_token = megatron_flops_per_token(model)
        peak = cluster.peak_tflops * 1e12

        def mfu(row):
            return per_token * row["tokens_per_s"] / cluster.gpus / peak
        top = plan(cluster, model)[0]
        top_all = plan(replace(cluster, schedules=SCHEDULES, zero_levels=ZERO_LEVELS), model)[0]
        out.append({"name": run["name"], "gpus": run["gpus"], "measured_mfu": run["measured_mfu"],
                    "measured_tokens_per_s_per_gpu": run["measured_mfu"] * peak / per_token,
                    "params_b": parameter_count(model) / 1e9, "active_params_b": active_parameter_count(model) / 1e9,
                    "published": published, "predicted_mfu": mfu(published),
                    "error": mfu(published) / run["measured_mfu"] - 1, "top": top, "top_mfu": mfu(top),
                    "published_slower": published["step_time_s"] / top["step_time_s"] - 1,
                    "top_all": top_all, "top_all_mfu": mfu(top_all)})
    return out


def _layout_short(x):
    return f"TP{x['tp']} PP{x['pp']} CP{x['cp']} EP{x['ep']} DP{x['dp']} b{x['micro_batch']} v{x['virtual_stages']}"


def print_moe_calibration(rows):
    print("\nPublished MoE runs (Megatron-Core, H100 80 GB, bf16; Liu et al. 2025, MoE Parallel Folding, layouts of "
          "the authors'\nMegatron-MoE-ModelZoo) against the planner (H100 preset, MEGATRON_CORE_2025: flash attention, "
          "fp32 main grads, ZeRO-1,\noverlapped gradient reduction, EP folded over TP x DP). MFU in Megatron-Core's "
          "count, peak 989 TFLOP/s.")
    print(f"\n{'model':<16s} {'params':>7s} {'active':>7s} {'GPUs':>5s} {'published layout':<32s} {'measured':>9s} "
          f"{'predicted':>9s} {'error':>7s} {'memory GB':>10s} {'EP a2a s':>9s}")
    for r in rows:
        p = r["published"]
        print(f"{r['name']:<16s} {r['params_b']:>6.1f}B {r['active_params_b']:>6.1f}B {r['gpus']:>5d} "
              f"{_layout_short(p):<32s} {r['measured_mfu']:>9.1%} {r['predicted_mfu']:>9.1%} {r['error']:>+7.1%} "
              f"{p['memory_gb']:>10.1f} {p['ep_s']:>9.3f}")
    worst = max(rows, key=lambda r: abs(r["error"]))
    limit = DEFAULT_GPU_MEM_GB * MEMORY_HEADROOM
    print(f"worst error {worst['error']:+.1%} ({worst['name']}); every published run fits in {DEFAULT_GPU_MEM_GB} GB "
          f"x {MEMORY_HEADROOM}: {all(r['published']['fits'] for r in rows)} (limit {limit:.0f} GB)")
    print(f"\nThe planner's top choice (same software, every knob free):\n{'model':<16s} {'top choice':<56s} "
          f"{'MFU':>6s} {'step s':>7s} {'published':>10s} {'published slower':>17s}")
    for r in rows:
        t = r["top"]
        choice = f"{_layout_short(t)} {t['recompute']} ZeRO={_zero_short(t)}{_extra_knobs_short(t)}"
        print(f"{r['name']:<16s} {choice:<56s} {r['top_mfu']:>6.1%} {t['step_time_s']:>7.3f} "
              f"{r['published']['step_time_s']:>10.3f} {r['published_slower']:>+17.1%}")
    print("With every schedule and ZeRO level the planner knows (zero bubble, ZeRO-2/3, HSDP), not in those runs:")
    for r in rows:
        t = r["top_all"]
        choice = f"{_layout_short(t)} {t['recompute']} ZeRO={_zero_short(t)}{_extra_knobs_short(t)}"
        slower = r["published"]["step_time_s"] / t["step_time_s"] - 1
        print(f"{r['name']:<16s} {choice:<56s} {r['top_all_mfu']:>6.1%} {t['step_time_s']:>7.3f} "
              f"{r['published']['step_time_s']:>10.3f} {slower:>+17.1%}")


# ----------------------------------------------------------------------------------------------------
# The chapter's example: 64 GPUs, plan A (TP=8 PP=4 DP=2) against plan B (TP=4 PP=8 DP=2)
# ----------------------------------------------------------------------------------------------------

# The knobs are fixed so that the two plans differ only in their layout: micro-batch 1, plain 1F1B,
# selective recomputation with sequence parallelism, no ZeRO.
_EXAMPLE_KNOBS = dict(micro_batch=1, recompute="selective", sequence_parallel=True, zero=False, virtual_stages=1)
EXAMPLE_SHAPES = {
    # 48 wide layers, a small batch: only 16 micro-batches, so B's bubble (7/16 of its busy time against
    # A's 3/16) outweighs B's smaller TP traffic; B also holds twice A's activations
    "wide_layers_small_batch": ModelShape(layers=48, hidden=12288, heads=96, seq=2048, vocab=51200,
                                          global_batch=32, **_EXAMPLE_KNOBS),
    # narrower layers and a big batch: 256 micro-batches amortise either bubble, and what remains is TP
    # traffic, (L/p)(t-1)/t per GPU: L/8 * 3/4 for B against L/4 * 7/8 for A
    "narrow_layers_big_batch": ModelShape(**EXAMPLE_MODEL, **_EXAMPLE_KNOBS),  # the core's plan A / B model
}
def chapter_example():
    cluster = Cluster(gpus=64, gpus_per_node=8, grad_bytes=4)  # the core's 18 bytes a parameter
    out = []
    for name, model in EXAMPLE_SHAPES.items():
        a, b = (estimate(cluster, model, tp=plan["tp"], pp=plan["pp"], cp=1) for plan in CHAPTER_PLANS.values())
        winner = min((x for x in (a, b) if x["fits"]), key=lambda x: x["step_time_s"], default=None)
        out.append({"shape": name, "model": model.__dict__, "plan_a": a, "plan_b": b,
                    "preferred": None if winner is None else ("A" if winner is a else "B"),
                    "compute_b_over_a": b["compute_s"] / a["compute_s"] - 1})
    return out


def print_chapter_example():
    examples = chapter_example()
    for ex in examples:
        model = ex["model"]
        print(f"\n== {ex['shape']}: L={model['layers']} h={model['hidden']} a={model['heads']} s={model['seq']} "
              f"B={model['global_batch']} recompute={model['recompute']} on 64 GPUs (8 nodes x 8)")
        rows = [("memory GB", "memory_gb"), ("  activations GB", "activations_gb"), ("fits", "fits"),
                ("micro-batches m", "micro_batches"), ("step s", "step_time_s"), ("  compute", "compute_s"),
                ("  TP", "tp_s"), ("  PP p2p", "pp_p2p_s"), ("  bubble", "bubble_s"), ("  DP", "dp_s"),
                ("DP on NVLink", None)]
        print(f"{'':18s} {'A: TP8 PP4 DP2':>16s} {'B: TP4 PP8 DP2':>16s}")
        for label, key in rows:
            va = ex["plan_a"]["intra_node"]["dp_cp"] if key is None else ex["plan_a"][key]
            vb = ex["plan_b"]["intra_node"]["dp_cp"] if key is None else ex["plan_b"][key]
            fmt = (lambda v: f"{v:>16.3f}") if isinstance(va, float) else (lambda v: f"{str(v):>16s}")
            print(f"{label:18s} {fmt(va)} {fmt(vb)}")
        a, b = ex["plan_a"], ex["plan_b"]
        gains = {k[:-2]: (b[k] - a[k]) for k in ("tp_s", "pp_p2p_s", "bubble_s", "dp_s")}
        print(f"preferred: plan {ex['preferred']}; B - A per term (s): "
              + ", ".join(f"{k} {v:+.3f}" for k, v in gains.items()))
    print("\nWhy: per GPU, B sends (L/8)(3/4) of a layer's TP traffic against A's (L/4)(7/8), less than half, "
          "and its TP=4 groups leave each DP pair on one node, so the gradient all-reduce runs on NVLink. B pays "
          "with twice the pipeline depth: a bubble of 7/m of the busy time instead of 3/m, and 8 micro-batches "
          "of activations in flight on stage 0 instead of 4 (twice A's activation memory). Few micro-batches "
          "(small global batch, many large layers) favour A; many micro-batches and narrower layers favour B. "
          "(B's compute against A's: "
          + ", ".join(f"{ex['compute_b_over_a']:+.1%} ({ex['shape']})" for ex in examples)
          + ". B's last stage carries the logits, V/4 wide, beside L/8 layers; A's V/8 beside L/4; B's wider GEMMs "
          "do not make up for it.)")


# The chapter's MoE question: on the same 64 GPUs, where should the EP group live? A 15B-parameter MoE (3.4B
# active per token): 24 layers of h=4096, each MLP 32 experts of hidden 2048, top-4 (fine-grained experts: the
# all-to-all bytes T k h grow with k, the expert FLOPs per copy shrink with f, so the all-to-all matters). With
# TP=1 PP=1 DP=64, EP=8 is one node (8 consecutive ranks, NVLink) and EP=16 two (half of each rank's peers
# across InfiniBand); EP=16 holds half the experts per GPU. The other knobs are the planner's.
MOE_EXAMPLE = ModelShape(layers=24, hidden=4096, heads=32, seq=2048, vocab=51200, global_batch=256, moe_every=1,
                         experts=32, top_k=4, expert_hidden=2048)


def moe_example():
    """EP inside a node (TP1 PP1 EP8) against EP across nodes (EP16) for MOE_EXAMPLE on 8 x 8 A100, and the
    planner's own choice with every size and knob free."""
    cluster = Cluster(gpus=64, gpus_per_node=8)
    plans = plan(cluster, MOE_EXAMPLE)
    return {"model": MOE_EXAMPLE.__dict__, "cluster": cluster, "inside": estimate(cluster, MOE_EXAMPLE, 1, 1, 1, ep=8),
            "across": estimate(cluster, MOE_EXAMPLE, 1, 1, 1, ep=16), "top": plans[0],
            "explain": explain(plans, cluster)}


def print_moe_example():
    ex = moe_example()
    model, a, b = ex["model"], ex["inside"], ex["across"]
    print(f"\n== MoE: L={model['layers']} h={model['hidden']} a={model['heads']} s={model['seq']} "
          f"B={model['global_batch']}, "
          f"{model['experts']} experts of hidden {model['expert_hidden']}, top-{model['top_k']} "
          f"({parameter_count(MOE_EXAMPLE) / 1e9:.1f}B parameters, {active_parameter_count(MOE_EXAMPLE) / 1e9:.1f}B "
          "active) on 64 GPUs (8 nodes x 8)")
    rows = [("memory GB", lambda x: x["memory_gb"]), ("fits", lambda x: x["fits"]),
            ("micro-batch, m", lambda x: f"{x['micro_batch']}, {x['micro_batches']}"),
            ("step s", lambda x: x["step_time_s"]), ("  EP all-to-alls", lambda x: x["ep_s"]),
            ("EP on NVLink", lambda x: x["intra_node"]["ep"]),
            ("members per node", lambda x: f"{x['ep_members_per_node']} of {x['ep']}"),
            ("MB per all-to-all", lambda x: x["a2a_bytes"] / 1e6), ("ms per all-to-all", lambda x: x["a2a_s"] * 1e3)]
    print(f"{'':18s} {'A: TP1 EP8 DP64':>18s} {'B: TP1 EP16 DP64':>18s}")
    for label, get in rows:
        va, vb = get(a), get(b)
        fmt = (lambda v: f"{v:>18.3f}") if isinstance(va, float) else (lambda v: f"{str(v):>18s}")
        print(f"{label:18s} {fmt(va)} {fmt(vb)}")
    per_step = 4 * model["layers"] * a["micro_batches"]
    remote, peers, cluster = b["ep"] - b["ep_members_per_node"], b["ep"] - 1, ex["cluster"]
    rest = (a["step_time_s"] - a["ep_s"]) - (b["step_time_s"] - b["ep_s"])
    print(f"Why: each GPU holds T = b s = {a['micro_batch'] * model['seq']} tokens, so an all-to-all sends "
          "T k h e (P-1)/P "
          f"= {a['a2a_bytes'] / 1e6:.1f} MB (P={a['ep']}) or {b['a2a_bytes'] / 1e6:.1f} MB (P={b['ep']}). Inside a "
          f"node it all crosses NVLink at {cluster.nvlink_gbps:.0f} GB/s: {a['a2a_s'] * 1e3:.3f} ms. Across "
          f"{b['ep'] // b['ep_members_per_node']} nodes {remote} of the {peers} peers are remote: "
          f"{b['a2a_bytes'] * remote / peers / 1e6:.1f} MB over one NIC at {cluster.ib_gbps:.0f} GB/s: "
          f"{b['a2a_s'] * 1e3:.3f} ms, {b['a2a_s'] / a['a2a_s']:.1f}x. "
          f"{per_step} all-to-alls per step (4 per MoE layer and micro-batch) make {a['ep_s']:.3f} s against "
          f"{b['ep_s']:.3f} s. B's other terms are {rest:.3f} s faster (half the experts per GPU: larger grouped "
          f"GEMMs, half the expert gradients to reduce), and its half-size expert shard saves "
          f"{a['memory_gb'] - b['memory_gb']:.1f} GB that A, at {a['memory_gb']:.1f} GB, does not need.")
    print("The planner, every size and knob free:\n" + ex["explain"])


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------

def _map_main(argv):
    ap = _OneLineParser(
        prog="topology.py",
        description="Draw the Megatron-LM rank map (with no argument at all: the chapter, its groups, the rank "
                    "maps of plan A and plan B and the two compared in closed form). Subcommands: 'plan' (the "
                    "layout planner, see "
                    "'topology.py plan --help'), 'calibrate' (the planner against Narayanan et al. 2021, Table 1) "
                    "and 'example' (the chapter's 64-GPU plan A against plan B).")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--gpus-per-node", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 8)))
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    a = ap.parse_args(argv)
    print(rank_map(a.nodes, a.gpus_per_node, a.tp, a.pp, a.cp, a.ep))


class _OneLineParser(argparse.ArgumentParser):
    """A flag that does not parse (`--gpus nan`) is one line, as every other bad input is: main prints it."""

    def error(self, message):
        raise ValueError(f"{message} (see {self.prog} --help)")


MAX_GPUS = 1 << 20  # the planner enumerates every layout of the cluster: a bound past any cluster built


def _flag(name):
    """The command-line flag of a Cluster or ModelShape field: its name with dashes, but for e_max's."""
    return next((flag for flag, (f, _) in _CONSTANT_FLAGS.items() if f == name), "--" + name.replace("_", "-"))


_CONSTANT_FLAGS = {  # flag -> (Cluster field, help)
    "--gpu-mem-gb": ("gpu_mem_gb", "GPU memory, GB"),
    "--peak-tflops": ("peak_tflops", "dense 16-bit peak, TFLOP/s"),
    "--gemm-efficiency": ("efficiency", "fraction of peak reached by large GEMMs (e_max)"),
    "--gemm-half-dim": ("gemm_half_dim", "smallest GEMM dimension at which a GEMM reaches half of e_max (x0)"),
    "--hbm-gbps": ("hbm_gbps", "achieved HBM bandwidth, GB/s"),
    "--nvlink-gbps": ("nvlink_gbps", "achieved all-reduce bus bandwidth inside a node, GB/s"),
    "--ib-gbps": ("ib_gbps", "achieved bandwidth per GPU across nodes, GB/s"),
    "--launch-us": ("launch_us", "fixed cost per kernel, microseconds"),
    "--collective-latency-us": ("collective_latency_us", "latency of one TP collective, microseconds"),
    "--p2p-latency-us": ("p2p_latency_us", "latency of one pipeline exchange, microseconds"),
    "--p2p-gbps": ("p2p_gbps", "bandwidth of one pipeline exchange per GPU, GB/s; the presets leave it to the "
                   "link, NVLink or InfiniBand"),
    "--pcie-gbps": ("pcie_gbps", "host-device copy bandwidth per GPU and direction, GB/s (activation offloading)"),
}


def _cluster_from_args(a):
    overrides = {field: getattr(a, flag[2:].replace("-", "_")) for flag, (field, _) in _CONSTANT_FLAGS.items()}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return Cluster.for_gpu(a.gpu, a.gpus, gpus_per_node=a.gpus_per_node, overlap_grad_reduce=a.overlap_grad_reduce,
                           interleave_min_pp=a.interleave_min_pp, flash_attention=a.flash_attention,
                           grad_bytes=a.grad_bytes, dropout=a.dropout, expert_folding=a.expert_folding,
                           offload=a.offload, **overrides)


def _add_cluster_flags(ap):
    ap.add_argument("--gpu", choices=sorted(GPU_PRESETS), default="a100",
                    help="preset of the constants below (see GPU_PRESETS in topology.py)")
    for flag, (_, help_text) in _CONSTANT_FLAGS.items():
        ap.add_argument(flag, type=float, help=f"{help_text} (default: the --gpu preset)")
    ap.add_argument("--overlap-grad-reduce", action="store_true",
                    help="the gradient reduction overlaps the last micro-batch's backward (torch DDP, Megatron-Core)")
    ap.add_argument("--interleave-min-pp", type=int, default=2,
                    help="smallest pipeline the interleaved schedule accepts (2 today; 3 for Megatron-LM 2021)")
    ap.add_argument("--flash-attention", action=argparse.BooleanOptionalAction, default=True,
                    help="the attention core is a flash kernel (train_gpt.py, Megatron-Core), or "
                         "(--no-flash-attention) Megatron-LM 2021's unfused one, its scores through HBM and kept")
    ap.add_argument("--grad-bytes", type=int, choices=[2, 4], default=GRAD_BYTES,
                    help="bytes per gradient element: 4 (fp32 main grads: train_gpt.py, Megatron-Core) or 2 (fp16 "
                         "buffers, 2021)")
    ap.add_argument("--dropout", action="store_true",
                    help="the program keeps dropout masks (Megatron-LM 2021, GPT-3); train_gpt.py has no dropout")
    ap.add_argument("--offload", action="store_true",
                    help="the search also tries activation offloading to host memory (--recompute offload, "
                         "selective+offload) over PCIe at --pcie-gbps")
    ap.add_argument("--expert-folding", choices=EXPERT_FOLDINGS, default="dp_cp",
                    help="EP drawn from the dp x cp ranks of one TP rank (topology.rank_groups, train_gpt.py) or from "
                         "all tp x dp x cp ranks of a stage (Megatron-Core's MoE parallel folding, expert TP 1)")


def _plan_main(argv):
    ap = _OneLineParser(prog="topology.py plan",
                                 description="Rank the layouts of a cluster for a model; each row with the knobs the "
                                             "planner chose (fix any knob or layout size with its flag).")
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    _add_cluster_flags(ap)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    ap.add_argument("--tp", type=int)
    ap.add_argument("--pp", type=int)
    ap.add_argument("--cp", type=int)
    ap.add_argument("--micro-batch", type=int, help="default: chosen by the planner")
    ap.add_argument("--recompute", choices=RECOMPUTE_KNOBS,
                    help="default: the cheapest that fits (of none, selective and full; with --offload also of "
                         "offload and selective+offload)")
    ap.add_argument("--sequence-parallel", choices=["on", "off"], help="default: chosen by the planner")
    ap.add_argument("--zero", type=int, choices=list(ZERO_LEVELS), help="ZeRO level: 0 replicated, 1 optimizer "
                    "states, 2 + gradients, 3 + parameters sharded; default: chosen by the planner")
    ap.add_argument("--zero-shard-size", type=int, help="HSDP: shard over this many DP x CP ranks, replicate across "
                    "(default: chosen, every rank or one node's)")
    ap.add_argument("--virtual-stages", type=int, help="model chunks per GPU (interleaved, zb-h1); default: chosen")
    ap.add_argument("--pp-schedule", choices=SCHEDULES, help="pipeline schedule; default: chosen (with a fixed "
                    "--virtual-stages: 1f1b for 1, interleaved above)")
    ap.add_argument("--cp-ulysses", type=int, help="hybrid CP: Ulysses over this many of the CP ranks, a ring over "
                    "the rest (1: ring, --cp: Ulysses); default: chosen")
    moe = ap.add_argument_group("MoE (train_gpt.py's names)")
    moe.add_argument("--moe-every", type=int, default=0, help="every n-th layer's MLP is a mixture of experts "
                     "(0: a dense model)")
    moe.add_argument("--experts", type=int, default=8, help="experts per MoE layer")
    moe.add_argument("--top-k", type=int, default=2, help="experts per token")
    moe.add_argument("--ep", type=int, help="expert-parallel size; default: chosen by the planner")
    moe.add_argument("--expert-hidden", type=int, help="hidden size of one expert (default 4 x hidden)")
    moe.add_argument("--shared-expert-hidden", type=int, default=0, help="hidden size of the shared expert (0: none)")
    moe.add_argument("--capacity-factor", type=float, help="tokens per expert capped at ceil(T k / E x this) "
                     "(default: dropless)")
    moe.add_argument("--imbalance", type=float, default=1.0, help="load of the busiest EP rank over the uniform "
                     "share (1: balanced routing)")
    moe.add_argument("--swiglu", action="store_true", help="gated expert MLPs (3 matrices each)")
    moe.add_argument("--kv-heads", type=int, help="key/value heads (grouped-query attention; default: --heads)")
    moe.add_argument("--untie-embeddings", action="store_true", help="the output layer is a weight of its own")
    ap.add_argument("--limit", type=int, default=12, help="rows of the table")
    ap.add_argument("--json", action="store_true", help="every layout as JSON, best first")
    ap.add_argument("--command", action="store_true", help="print only the torchrun line that runs the top row with "
                    "train_gpt.py (train_gpt.py keeps fp32 main grads: plan with --grad-bytes 4 to model it)")
    ap.add_argument("--dtype", choices=TRAIN_GPT_DTYPES, default="bfloat16", help="with --command: train_gpt.py's "
                    "--dtype (the cost model is 16-bit for either)")
    job = ap.add_argument_group("with --command: the job train_gpt.py runs")
    job.add_argument("--steps", type=int, default=1000, help="optimizer steps (default 1000)")
    job.add_argument("--data", default="embedded", help="train_gpt.py's --data (default: its built-in corpus)")
    job.add_argument("--out-dir", default="out", help="the checkpoint folder, shared by every node (default out)")
    job.add_argument("--save-every", type=int, help="steps between checkpoints (default: a tenth of --steps)")
    a = ap.parse_args(argv)
    if a.limit < 0:
        raise ValueError(f"limit={a.limit} must be >= 0 (--limit): the number of rows to print")
    if not 1 <= a.gpus <= MAX_GPUS:
        raise ValueError(f"--gpus {a.gpus} must be between 1 and {MAX_GPUS:,}")

    cluster = _cluster_from_args(a)
    model = ModelShape(a.layers, a.hidden, a.heads, a.seq, a.vocab, a.global_batch, a.micro_batch, a.recompute,
                   None if a.sequence_parallel is None else a.sequence_parallel == "on", a.zero, a.virtual_stages,
                   moe_every=a.moe_every, experts=a.experts, top_k=a.top_k, expert_hidden=a.expert_hidden,
                   shared_expert_hidden=a.shared_expert_hidden, capacity_factor=a.capacity_factor,
                   imbalance=a.imbalance, swiglu=a.swiglu, kv_heads=a.kv_heads, tied_embeddings=not a.untie_embeddings,
                   pp_schedule=a.pp_schedule, zero_shard_size=a.zero_shard_size, cp_ulysses=a.cp_ulysses)
    plans = plan(cluster, model, a.tp, a.pp, a.cp, a.ep)
    if a.command:
        if a.steps < 1 or (a.save_every is not None and a.save_every < 1):
            raise ValueError("--steps and --save-every must be positive integers")
        print(torchrun_command(plans[0], model, cluster, a.dtype, a.steps, a.data, a.out_dir, a.save_every))
        return
    if a.json:
        print(json.dumps(plans, indent=1))
        return
    if model.moe_every:
        print(f"model: {parameter_count(model) / 1e9:.2f} B parameters, "
              f"{active_parameter_count(model) / 1e9:.2f} B active "
              f"per token; {flops_per_token(model) / 1e9:.2f} GFLOP per token (6 N_active + 12 L h s), "
              f"{model_flops(model) / 1e15:.1f} PFLOP per step")
    else:
        print(f"model: {parameter_count(model) / 1e9:.2f} B parameters; {paper_flops(model) / 1e15:.1f} PFLOP per step "
              "(96 B s L h^2 (1 + s/6h + V/16Lh))")
    print(format_table(plans, a.limit))
    print()
    print(explain(plans, cluster, model.recompute))


TRAIN_GPT_RECOMPUTE = ("none", "full", "sqrt", "selective", "offload", "selective+offload")
CP_IMPLS = ("allgather", "hybrid", "ring", "ulysses")


def train_gpt_run(a):
    """(cluster, model, layout, knobs, program) of the train_gpt.py run that these flags describe (`_memory_main`'s
    parsed flags, train_gpt.py's names and defaults): its own program (flash attention, FP32 main grads, no dropout,
    MoE folded over DP x CP)."""
    cluster = Cluster(gpus=a.world, flash_attention=True, grad_bytes=4, dropout=False, gpu_mem_gb=a.gpu_mem_gb)
    model = ModelShape(layers=a.layers, hidden=a.hidden, heads=a.heads, seq=a.seq, vocab=a.vocab, global_batch=a.batch,
                       moe_every=a.moe_every, experts=a.experts, top_k=a.top_k, imbalance=a.imbalance)
    layout = _Layout(cluster, model, a.tp, a.pp, a.cp, a.ep)
    u = {"ring": 1, "allgather": 1, "ulysses": a.cp, "hybrid": a.cp_ulysses}[a.cp_impl]
    knobs = Knobs(a.micro_batch, a.virtual_stages, a.recompute, a.sequence_parallel and a.tp > 1, a.zero,
                  a.pp_schedule, a.zero_shard_size, u)
    _check_knobs(model, layout.dp, a.pp, a.micro_batch, a.virtual_stages, 2, a.pp_schedule)
    program = Program(dtype=a.dtype, device=a.device, optimizer=a.optimizer, cp_impl=a.cp_impl if a.cp > 1 else None,
                      nvfp4_bf16_last=a.nvfp4_bf16_last)
    return cluster, model, layout, knobs, program


def every_rank_peak(cluster, model, layout, knobs, program):
    """rank_peaks for every rank of the world, in rank order (Megatron's: a rank's stage is rank // (t c d))."""
    stages = rank_peaks(cluster, model, layout, knobs, program)
    per_stage = layout.tp * layout.cp * layout.dp
    return [{"rank": rank, **{k: v for k, v in stages[rank // per_stage].items() if k != "stage"}}
            for rank in range(cluster.gpus)]


def _memory_main(argv):
    ap = _OneLineParser(prog="topology.py memory", description="Every rank's peak bytes of live tensors in a training "
                        "step of train_gpt.py (a step after the first), with its parts and the instant of the peak, "
                        "from the flags train_gpt.py takes (their names and defaults).")
    ap.add_argument("--world", type=int, required=True, help="ranks (torchrun's --nproc_per_node x --nnodes)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="the kernels whose buffers are "
                    "counted: CUDA (FP32 LayerNorm statistics, foreach AdamW) or CPU (gloo runs, the tests)")
    ap.add_argument("--gpu-mem-gb", type=float, default=DEFAULT_GPU_MEM_GB, help="GPU memory, GB: a rank fits when "
                    f"its peak is at most {MEMORY_HEADROOM} of it")
    ap.add_argument("--imbalance", type=float, default=1.0, help="MoE: the busiest EP rank's routed copies over the "
                    "uniform share (1: balanced)")
    ap.add_argument("--json", action="store_true", help="a list of {rank, peak_bytes, parts, instant}")
    group = ap.add_argument_group("train_gpt.py's flags").add_argument
    for flag, default in (("--layers", 4), ("--heads", 4), ("--hidden", 64), ("--seq", 64), ("--vocab", 256),
                          ("--moe-every", 0), ("--experts", 8), ("--top-k", 2), ("--tp", 1), ("--pp", 1), ("--cp", 1),
                          ("--ep", 1), ("--cp-ulysses", 1), ("--virtual-stages", 1), ("--batch", 16),
                          ("--micro-batch", 2)):
        group(flag, type=int, default=default)
    group("--sequence-parallel", action="store_true")
    group("--cp-impl", choices=CP_IMPLS, default="ring")
    group("--pp-schedule", choices=SCHEDULES, default="1f1b")
    group("--dtype", choices=list(PROGRAM_DTYPES), default="float32")
    group("--zero", type=int, choices=list(ZERO_LEVELS), default=0)
    group("--zero-shard-size", type=int, default=None)
    group("--nvfp4-bf16-last", type=int, default=None)
    group("--recompute", choices=TRAIN_GPT_RECOMPUTE, default="none")
    group("--optimizer", choices=["adamw", "sgd"], default="adamw")
    a = ap.parse_args(argv)
    if not 1 <= a.world <= MAX_GPUS:
        raise ValueError(f"--world {a.world} must be between 1 and {MAX_GPUS:,}")
    ranks = every_rank_peak(*train_gpt_run(a))
    if a.json:
        print(json.dumps(ranks, indent=1))
        return
    limit = a.gpu_mem_gb * MEMORY_HEADROOM * GB
    print(f"{'rank':>5s} {'peak MB':>10s}  " + " ".join(f"{p[:10]:>10s}" for p in MEMORY_PARTS) + "  instant")
    for r in ranks:
        print(f"{r['rank']:>5d} {r['peak_bytes'] / 1e6:>10.3f}  "
              + " ".join(f"{r['parts'].get(p, 0) / 1e6:>10.3f}" for p in MEMORY_PARTS) + f"  {r['instant']}")
    fullest = max(ranks, key=lambda r: r["peak_bytes"])
    print(f"fullest: rank {fullest['rank']}, {fullest['peak_bytes'] / GB:.3f} GB at {fullest['instant']}; "
          f"{'fits' if fullest['peak_bytes'] <= limit else 'does NOT fit'} in {a.gpu_mem_gb:g} GB x {MEMORY_HEADROOM}")


def _calibrate_main(argv):
    ap = _OneLineParser(prog="topology.py calibrate",
                                 description="Narayanan et al. 2021 Table 1, then published MoE runs "
                                             "(Megatron-Core, H100), beside the planner's predictions.")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--scan", action="store_true", help="costs the model could be missing (COST_VARIANTS), each "
                    "with e_max refitted: do they change which layout the planner picks?")
    a = ap.parse_args(argv)
    if a.scan:
        scan = scan_cost_variants()
        if a.json:
            print(json.dumps(scan, indent=1))
        else:
            print_cost_scan(scan)
        return
    rows, moe_rows = calibrate(), calibrate_moe()
    if a.json:
        print(json.dumps({"table_1": rows, "moe": moe_rows}, indent=1))
        return
    print_calibration(rows)
    print_moe_calibration(moe_rows)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["plan"]:
            _plan_main(argv[1:])
        elif argv[:1] == ["calibrate"]:
            _calibrate_main(argv[1:])
        elif argv[:1] == ["memory"]:
            _memory_main(argv[1:])
        elif argv[:1] == ["example"]:
            print_chapter_plans()
            print_chapter_example()
            print_moe_example()
        elif not argv:  # the chapter: groups, rank map, plan A against plan B
            chapter_demo()
        else:
            _map_main(argv)
    except ValueError as e:  # a layout or constant that cannot work: one line and the usage-error code
        print(f"topology.py: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
