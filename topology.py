"""Rank layout for 3D/4D/5D parallel training: which GPU does what, which groups talk, and a planner.

A training job on N GPUs splits the work five ways. Tensor parallelism (TP) splits every weight matrix
and needs 4 collectives per layer per micro-batch (2 forward, 2 backward), each of the full activation
size `b s h`: it only pays off on NVLink, inside one node. Context parallelism (CP) splits the sequence
and talks only inside attention. Pipeline parallelism (PP) splits the layers; a stage sends one
activation `b s h` per micro-batch to the next stage, little enough for InfiniBand, but it idles for a
bubble of `(p - 1) / (m + p - 1)` of the step (m micro-batches). Data parallelism (DP) replicates the
model and all-reduces the gradients once per step. Expert parallelism (EP) places MoE experts on
different ranks of the data-parallel dimension.

Megatron-LM numbers the ranks so that the chatty dimensions are the close ones (order `tp-cp-dp-pp`,
TP varying fastest):

    rank = tp_rank + TP * (cp_rank + CP * (dp_rank + DP * pp_rank)),   world = TP x CP x DP x PP

so a TP group is TP consecutive ranks (on one node when TP divides the GPUs per node) and a PP group
strides by TP*CP*DP ranks, i.e. across nodes. Experts are "folded" over the same ranks: the expert grid is
`tp-ep-edp-pp` with `EP x EDP = CP x DP`, so EP groups are drawn from the data/context-parallel ranks of
one (tp, pp) position, and EDP (expert data parallel) groups hold the replicas of one expert shard.

Per-GPU memory for mixed-precision Adam without a sharded optimizer is 16 bytes per parameter held
(2 bf16 weights + 2 bf16 gradients + 4 fp32 master + 4 + 4 Adam moments, ZeRO paper) plus activations;
Korthikanti et al. 2022 give the activations of one transformer layer in 16-bit, with TP size t and
sequence parallelism:

    no recomputation            s b h / t * (34 + 5 a s / h)   bytes
    selective (attention core)  s b h / t *  34
    full (keep the layer input) s b h / t *   2

and under 1F1B the first stage holds min(p, m) micro-batches of them. Communication per GPU per layer
per micro-batch (forward; backward the same again, e = 2 bytes): TP+SP `4 (t-1)/t b s h e` on NVLink,
PP `b s h e / t` point to point, CP ring `2 (c-1)/c b s h e / t`, DP `2 (d-1)/d` of the gradient bytes
once per step. The planner below adds these up for every layout that divides the cluster, ranks the ones
that fit in memory by estimated step time, and says why the winner wins.

Run `python topology.py --help`; `python topology.py --nodes 8 --gpus-per-node 8 --tp 8 --pp 4` draws
the rank map; `python topology.py plan ...` plans; `python topology.py example` compares the chapter's
two 64-GPU plans on two model shapes.
"""
import argparse
import itertools
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

GROUP_KINDS = ("tp", "cp", "dp", "pp", "dp_cp", "tp_cp", "tp_pp", "embedding", "ep", "edp")


# ----------------------------------------------------------------------------------------------------
# The layout: pure arithmetic on rank numbers, no process group needed
# ----------------------------------------------------------------------------------------------------

def _check_positive(**sizes):
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}; use {name}=1 to disable it")


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_layout(world_size, tp=1, pp=1, cp=1, ep=1):
    """Check that the sizes tile the world; return dp. Raises ValueError naming the parameter and a fix."""
    _check_positive(world_size=world_size, tp=tp, pp=pp, cp=cp, ep=ep)
    model_parallel = tp * pp * cp
    if world_size % model_parallel != 0:
        fits = [(t, p) for t in _divisors(world_size) for p in _divisors(world_size // t)
                if world_size % (t * p * cp) == 0]
        hint = ", ".join(f"tp={t} pp={p}" for t, p in fits[:6])
        raise ValueError(f"world_size={world_size} is not divisible by tp*pp*cp={tp}*{pp}*{cp}={model_parallel}; "
                         f"choose tp, pp, cp whose product divides {world_size} (with cp={cp}: {hint})")
    dp = world_size // model_parallel
    if (cp * dp) % ep != 0:
        raise ValueError(f"ep={ep} must divide cp*dp={cp}*{dp}={cp * dp} (experts fold over the data- and "
                         f"context-parallel ranks); valid ep values: {_divisors(cp * dp)}")
    return dp


def _groups_varying(shape, names, vary):
    """All groups of the mixed-radix grid `shape` (first dim fastest) in which the dims `vary` change and the
    others stay fixed. Each group ascending, groups ordered by their first rank (as Megatron-LM orders them)."""
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
    """Every group of every kind for a Megatron-LM layout, as lists of ranks.

    Keys: tp cp dp pp dp_cp tp_cp tp_pp embedding ep edp. Dense grid order tp-cp-dp-pp (tp fastest); expert
    grid tp-ep-edp-pp with ep * edp = cp * dp. `embedding` pairs the first and last stage of each pipeline (they
    hold the tied input and output embeddings and all-reduce its gradient). `tp_cp` holds the ranks that share
    the tokens of one micro-batch (Megatron-LM's group for MoE router statistics).
    """
    dp = validate_layout(world_size, tp, pp, cp, ep)
    dense_shape, dense_names = (tp, cp, dp, pp), ("tp", "cp", "dp", "pp")
    expert_shape, expert_names = (tp, ep, cp * dp // ep, pp), ("tp", "ep", "edp", "pp")
    groups = {kind: _groups_varying(dense_shape, dense_names, [kind])
              for kind in ("tp", "cp", "dp", "pp")}
    groups["dp_cp"] = _groups_varying(dense_shape, dense_names, ["dp", "cp"])
    groups["tp_cp"] = _groups_varying(dense_shape, dense_names, ["tp", "cp"])
    groups["tp_pp"] = _groups_varying(dense_shape, dense_names, ["tp", "pp"])
    groups["embedding"] = [[g[0], g[-1]] if len(g) > 1 else list(g) for g in groups["pp"]]
    groups["ep"] = _groups_varying(expert_shape, expert_names, ["ep"])
    groups["edp"] = _groups_varying(expert_shape, expert_names, ["edp"])
    return groups


def rank_coordinates(rank, world_size, tp=1, pp=1, cp=1, ep=1):
    """(tp, cp, dp, pp, ep, edp) coordinates of one rank: the inverse of the rank formula."""
    dp = validate_layout(world_size, tp, pp, cp, ep)
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


# ----------------------------------------------------------------------------------------------------
# Process groups: one object per rank with its coordinates and its groups
# ----------------------------------------------------------------------------------------------------

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

    @property
    def tp_rank(self):
        return self.coords["tp"]

    @property
    def cp_rank(self):
        return self.coords["cp"]

    @property
    def dp_rank(self):
        return self.coords["dp"]

    @property
    def pp_rank(self):
        return self.coords["pp"]

    @property
    def ep_rank(self):
        return self.coords["ep"]

    @property
    def edp_rank(self):
        return self.coords["edp"]


def init_distributed():
    """Initialise the default process group from torchrun's environment: NCCL on CUDA, gloo on CPU."""
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def init_parallel(tp=1, pp=1, cp=1, ep=1, gpus_per_node=None, with_mesh=True):
    """Create every group of the layout on the default process group; return this rank's ParallelState.

    The layout is validated before any group is created, so a bad layout raises the same ValueError on every
    rank and none of them hangs in `new_group`.
    """
    rank, world_size = init_distributed()
    groups = rank_groups(world_size, tp, pp, cp, ep)  # raises before any communication
    gpus_per_node = gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    warn_if_tp_crosses_nodes(groups, gpus_per_node)

    # new_group is collective over the whole default group: every rank must call it for every group, in the
    # same order, even for the groups it is not in; otherwise group ids disagree across ranks and the next
    # collective deadlocks. Kinds that coincide (dp_cp == dp when cp == 1) reuse one handle.
    handles = {}
    # a middle pipeline stage is in no embedding group: None and [] there
    mine, my_ranks = dict.fromkeys(GROUP_KINDS), {kind: [] for kind in GROUP_KINDS}
    for kind in GROUP_KINDS:
        for ranks in groups[kind]:
            key = tuple(ranks)
            if key not in handles:
                handles[key] = dist.new_group(ranks)
            if rank in ranks:
                mine[kind], my_ranks[kind] = handles[key], list(ranks)

    coords = rank_coordinates(rank, world_size, tp, pp, cp, ep)
    dp = world_size // (tp * pp * cp)
    pp_ranks = my_ranks["pp"]
    stage = coords["pp"]
    mesh = None
    if with_mesh:
        from torch.distributed.device_mesh import init_device_mesh
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        # mesh dims outermost first: pp, dp, cp, tp (tp fastest) is exactly the rank formula above
        mesh = init_device_mesh(device, (pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
    return ParallelState(
        rank=rank, world_size=world_size,
        sizes={"tp": tp, "cp": cp, "dp": dp, "pp": pp, "ep": ep, "edp": cp * dp // ep, "dp_cp": dp * cp,
               "tp_cp": tp * cp},
        coords=coords, groups=mine, ranks=my_ranks,
        pp_prev=pp_ranks[stage - 1] if stage > 0 else None,
        pp_next=pp_ranks[stage + 1] if stage < pp - 1 else None,
        is_first_stage=stage == 0, is_last_stage=stage == pp - 1,
        intra_node=group_locality(groups, gpus_per_node), mesh=mesh)


# ----------------------------------------------------------------------------------------------------
# The rank map picture
# ----------------------------------------------------------------------------------------------------

def rank_map(nodes, gpus_per_node, tp=1, pp=1, cp=1, ep=1):
    """A node x GPU grid of (tp, cp, dp, pp) coordinates, then the group lists and where each kind lives."""
    world = nodes * gpus_per_node
    groups = rank_groups(world, tp, pp, cp, ep)
    dp = world // (tp * pp * cp)
    lines = [f"world={world} = tp {tp} x cp {cp} x dp {dp} x pp {pp}   (ep {ep}, edp {cp * dp // ep})",
             "each cell: rank tp.cp.dp.pp"]
    header = "        " + "".join(f"gpu{g:<11d}" for g in range(gpus_per_node))
    lines.append(header)
    for n in range(nodes):
        cells = []
        for g in range(gpus_per_node):
            r = n * gpus_per_node + g
            c = rank_coordinates(r, world, tp, pp, cp, ep)
            cells.append(f"{r:>3d} {c['tp']}.{c['cp']}.{c['dp']}.{c['pp']}".ljust(14))
        lines.append(f"node{n:<3d} " + "".join(cells))
    local = group_locality(groups, gpus_per_node)
    lines.append("")
    for kind in GROUP_KINDS:
        gs = groups[kind]
        shown = " ".join(str(g) for g in gs[:8]) + (f" ... ({len(gs)} groups)" if len(gs) > 8 else "")
        where = "inside a node" if local[kind] else "CROSSES nodes"
        lines.append(f"{kind:>9s} [{where}]: {shown}")
    if not local["tp"]:
        lines.append("WARNING: TP crosses nodes; TP wants NVLink, put the extra factor into pp or dp")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# The planner: memory and step time of every layout, from the published formulas
# ----------------------------------------------------------------------------------------------------

# Defaults describe an A100/H100-class node of 8 GPUs with 80 GB each.
DEFAULT_GPU_MEM_GB = 80
DEFAULT_NVLINK_GBPS = 300   # GB/s one direction per GPU: A100 NVLink 3 is 600 GB/s bidirectional
DEFAULT_IB_GBPS = 25        # GB/s per GPU: one 200 Gb/s HDR InfiniBand NIC per GPU (DGX A100)
DEFAULT_PEAK_TFLOPS = 312   # A100 dense BF16 tensor-core peak (NVIDIA A100 datasheet)
COMPUTE_EFFICIENCY = 0.5    # achieved/peak for large GEMM-bound training; Narayanan et al. 2021 reach 52%
MEMORY_HEADROOM = 0.9       # usable fraction of GPU memory: CUDA context, allocator fragmentation, buffers
BYTES_PER_PARAM_STATES = 16  # 2 bf16 weight + 2 bf16 grad + 4 fp32 master + 4 + 4 Adam moments (ZeRO paper)
ACT_BYTES = 2               # 16-bit activations and gradients on the wire
GB = 1e9


@dataclass
class Cluster:
    gpus: int
    gpus_per_node: int = 8
    gpu_mem_gb: float = DEFAULT_GPU_MEM_GB
    nvlink_gbps: float = DEFAULT_NVLINK_GBPS
    ib_gbps: float = DEFAULT_IB_GBPS
    peak_tflops: float = DEFAULT_PEAK_TFLOPS
    efficiency: float = COMPUTE_EFFICIENCY


@dataclass
class ModelShape:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    global_batch: int  # sequences per optimizer step
    micro_batch: int = 1
    recompute: str = "none"  # none | selective | full


def parameter_count(m):
    """Narayanan et al. 2021: P = 12 L h^2 (1 + 13/(12h) + (V + s)/(12 L h))."""
    return 12 * m.layers * m.hidden ** 2 + 13 * m.layers * m.hidden + (m.vocab + m.seq) * m.hidden


def params_on_first_stage(m, tp, pp):
    """Parameters held by one GPU of the first stage: L/p layers and the embeddings, all split t ways
    (the few replicated LayerNorm weights and biases, < 0.1%, are counted as split)."""
    return ((12 * m.hidden ** 2 + 13 * m.hidden) * (m.layers // pp) + (m.vocab + m.seq) * m.hidden) / tp


def activation_bytes_per_layer(m, tp, cp):
    """Korthikanti et al. 2022 (16-bit, sequence parallel inside TP), with the sequence split cp ways."""
    s, b, h, a = m.seq // cp, m.micro_batch, m.hidden, m.heads
    if m.recompute == "full":
        return 2 * s * b * h / tp
    if m.recompute == "selective":
        return 34 * s * b * h / tp
    return s * b * h / tp * (34 + 5 * a * s / h)


def training_flops(m):
    """FLOPs of one step over the global batch: 3 x forward (Narayanan et al.), plus the recomputed forward.
    Forward = 24 B s L h^2 (1 + s/(6h)) for the layers + 2 B s h V for the logits; so 72(...) without and
    96 B s L h^2 (1 + s/(6h) + V/(16 L h)) with full recomputation. Selective redoes only the attention
    core: QK^T and AV, 4 B s^2 h per layer."""
    B, s, L, h, V = m.global_batch, m.seq, m.layers, m.hidden, m.vocab
    layers_fwd = 24 * B * s * L * h * h * (1 + s / (6 * h))
    logits_fwd = 2 * B * s * h * V
    extra = {"none": 0, "selective": 4 * B * s * s * h * L, "full": layers_fwd}[m.recompute]
    return 3 * (layers_fwd + logits_fwd) + extra


def _link_gbps(intra_node, cluster):
    return cluster.nvlink_gbps if intra_node else cluster.ib_gbps


def estimate(cluster, m, tp, pp, cp):
    """Memory and step-time terms of one layout. Every term is one published formula; see module docstring."""
    world = cluster.gpus
    dp = validate_layout(world, tp, pp, cp)
    if m.layers % pp:
        raise ValueError(f"layers={m.layers} is not divisible by pp={pp}; choose pp among {_divisors(m.layers)}")
    if m.heads % tp:
        raise ValueError(f"heads={m.heads} is not divisible by tp={tp}; choose tp among {_divisors(m.heads)}")
    if m.seq % (2 * cp):
        raise ValueError(f"seq={m.seq} is not divisible by 2*cp={2 * cp} (causal load balancing); choose another cp")
    if m.global_batch % (m.micro_batch * dp):
        raise ValueError(f"global_batch={m.global_batch} is not divisible by micro_batch*dp={m.micro_batch}*{dp}; "
                         "change global_batch, micro_batch or the layout")
    micro_batches = m.global_batch // (m.micro_batch * dp)  # per pipeline per step
    local = group_locality(rank_groups(world, tp, pp, cp), cluster.gpus_per_node)
    s, b, h, L = m.seq // cp, m.micro_batch, m.hidden, m.layers
    layers_here = L // pp

    # memory of one first-stage GPU
    params = params_on_first_stage(m, tp, pp)
    in_flight = min(pp, micro_batches)  # 1F1B: stage 0 holds p micro-batches (GPipe would hold m)
    mem = {
        "weights_gb": 2 * params / GB,
        "grads_gb": 2 * params / GB,
        "optimizer_gb": 12 * params / GB,
        "activations_gb": layers_here * activation_bytes_per_layer(m, tp, cp) * in_flight / GB,
    }
    memory_gb = sum(mem.values())

    # time of one step, one GPU
    compute_s = training_flops(m) / world / (cluster.peak_tflops * 1e12 * cluster.efficiency)
    passes = 3 if m.recompute == "full" else 2  # forward, backward (and the recomputed forward)
    tp_bytes = passes * layers_here * micro_batches * 4 * (tp - 1) / tp * b * s * h * ACT_BYTES
    cp_bytes_fwd = 2 * (cp - 1) * b * s * h / tp * ACT_BYTES            # K and V, passed cp-1 times
    cp_bytes_bwd = (2 * (cp - 1) + 2 * cp) * b * s * h / tp * ACT_BYTES  # KV again, and dK dV cp times
    cp_bytes = layers_here * micro_batches * ((passes - 1) * cp_bytes_fwd + cp_bytes_bwd) if cp > 1 else 0
    pp_bytes = 2 * micro_batches * b * s * h / tp * ACT_BYTES if pp > 1 else 0  # activation out, grad back
    grad_bytes = 2 * params
    dp_group = dp * cp
    dp_bytes = 2 * (dp_group - 1) / dp_group * grad_bytes
    t = {
        "compute_s": compute_s,
        "tp_s": tp_bytes / (_link_gbps(local["tp"], cluster) * GB),
        "cp_s": cp_bytes / (_link_gbps(local["cp"], cluster) * GB),
        "pp_p2p_s": pp_bytes / (_link_gbps(local["pp"], cluster) * GB),
        "dp_s": dp_bytes / (_link_gbps(local["dp_cp"], cluster) * GB),
    }
    # the bubble: each stage idles (p-1)/m of its busy time (forward+backward of its micro-batches)
    t["bubble_s"] = (pp - 1) / micro_batches * (t["compute_s"] + t["tp_s"] + t["cp_s"])
    step_time_s = sum(t.values())
    return {
        "tp": tp, "pp": pp, "dp": dp, "cp": cp, "micro_batch": m.micro_batch, "micro_batches": micro_batches,
        "in_flight": in_flight, "params_per_gpu": params, "memory_gb": memory_gb, **mem,
        "step_time_s": step_time_s, **t, "fits": memory_gb <= cluster.gpu_mem_gb * MEMORY_HEADROOM,
        "bubble_fraction": (pp - 1) / (micro_batches + pp - 1),
        "intra_node": {k: local[k] for k in ("tp", "cp", "dp_cp", "pp")},
        "tokens_per_s": m.global_batch * m.seq / step_time_s,
    }


def candidate_layouts(cluster, m, tp=None, pp=None, cp=None):
    """Every (tp, pp, cp) that divides the cluster and the model; TP kept inside a node unless given."""
    out = []
    tps = [tp] if tp else [t for t in _divisors(cluster.gpus_per_node) if m.heads % t == 0]
    for t in tps:
        for p in ([pp] if pp else _divisors(m.layers)):
            for c in ([cp] if cp else [c for c in _divisors(cluster.gpus) if c <= 16]):
                try:
                    out.append(estimate(cluster, m, t, p, c))
                except ValueError:
                    if tp and pp and cp:
                        raise
    return out


def plan(cluster, m, tp=None, pp=None, cp=None):
    """All candidate layouts, the ones that fit first, fastest first."""
    if m.recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={m.recompute!r}; choose none, selective or full")
    plans = candidate_layouts(cluster, m, tp, pp, cp)
    if not plans:
        raise ValueError("no layout divides this cluster and model: check gpus, layers (pp), heads (tp), "
                         "seq (cp) and global_batch (dp * micro_batch)")
    return sorted(plans, key=lambda r: (not r["fits"], r["step_time_s"]))


def _layout_name(r):
    return f"TP={r['tp']} PP={r['pp']} DP={r['dp']} CP={r['cp']}"


def explain(plans, cluster):
    """Say in words why the first plan wins."""
    best = plans[0]
    lines = []
    if not best["fits"]:
        lines.append(f"No layout fits in {cluster.gpu_mem_gb} GB (x{MEMORY_HEADROOM} headroom); the least bad is "
                     f"{_layout_name(best)} at {best['memory_gb']:.1f} GB: use recompute=selective/full, a "
                     "smaller micro-batch or more GPUs.")
        return "\n".join(lines)
    where = {True: "NVLink (inside a node)", False: "InfiniBand (across nodes)"}
    lines.append(f"Best: {_layout_name(best)}, {best['micro_batches']} micro-batches per pipeline, "
                 f"{best['memory_gb']:.1f} GB per GPU, {best['step_time_s']:.3f} s per step.")
    lines.append(f"  TP collectives run on {where[best['intra_node']['tp']]}; DP gradient all-reduce on "
                 f"{where[best['intra_node']['dp_cp']]}; PP sends on {where[best['intra_node']['pp']]}.")
    overheads = {k: best[k] for k in ("tp_s", "cp_s", "pp_p2p_s", "dp_s", "bubble_s")}
    worst = max(overheads, key=overheads.get)
    lines.append(f"  Compute is {best['compute_s'] / best['step_time_s']:.0%} of the step; the largest overhead "
                 f"is {worst[:-2]} ({overheads[worst]:.3f} s); pipeline bubble {best['bubble_fraction']:.1%}.")
    fitting = [r for r in plans if r["fits"]]
    if len(fitting) > 1:
        second = fitting[1]
        diffs = {k: second[k] - best[k] for k in ("compute_s", "tp_s", "cp_s", "pp_p2p_s", "dp_s", "bubble_s")}
        why = max(diffs, key=diffs.get)
        lines.append(f"  Runner-up {_layout_name(second)} is {second['step_time_s'] / best['step_time_s'] - 1:.1%} "
                     f"slower, mostly in {why[:-2]} (+{diffs[why]:.3f} s).")
    too_big = [r for r in plans if not r["fits"]]
    if too_big:
        lines.append(f"  {len(too_big)} of {len(plans)} layouts do not fit in memory "
                     f"(e.g. {_layout_name(too_big[0])}: {too_big[0]['memory_gb']:.1f} GB).")
    return "\n".join(lines)


def format_table(plans, limit=12):
    cols = ["tp", "pp", "dp", "cp", "micro_batches", "memory_gb", "activations_gb", "fits", "step_time_s",
            "compute_s", "tp_s", "pp_p2p_s", "bubble_s", "dp_s", "cp_s"]
    heads = ["tp", "pp", "dp", "cp", "m", "mem GB", "act GB", "fits", "step s", "compute", "TP", "PP p2p",
             "bubble", "DP", "CP"]
    rows = [" ".join(f"{h:>8s}" for h in heads)]
    for r in plans[:limit]:
        cells = []
        for c in cols:
            v = r[c]
            cells.append(f"{v:>8.3f}" if isinstance(v, float) else f"{str(v):>8s}")
        rows.append(" ".join(cells))
    if len(plans) > limit:
        rows.append(f"... {len(plans) - limit} more")
    return "\n".join(rows)


# ----------------------------------------------------------------------------------------------------
# The chapter's example: 64 GPUs, plan A (TP=8 PP=4 DP=2) against plan B (TP=4 PP=8 DP=2)
# ----------------------------------------------------------------------------------------------------

EXAMPLE_SHAPES = {
    # 48 wide layers, a small batch: only 16 micro-batches, so B's bubble (7/16 of its busy time against
    # A's 3/16) outweighs B's smaller TP traffic; B also holds twice A's activations
    "wide_layers_small_batch": ModelShape(layers=48, hidden=12288, heads=96, seq=2048, vocab=51200,
                                          global_batch=32, recompute="selective"),
    # narrower layers and a big batch: 256 micro-batches amortise either bubble, and what remains is TP
    # traffic, (L/p)(t-1)/t per GPU: L/8 * 3/4 for B against L/4 * 7/8 for A
    "narrow_layers_big_batch": ModelShape(layers=40, hidden=5120, heads=40, seq=2048, vocab=51200,
                                          global_batch=512, recompute="selective"),
}


def chapter_example():
    cluster = Cluster(gpus=64, gpus_per_node=8)
    out = []
    for name, m in EXAMPLE_SHAPES.items():
        a = estimate(cluster, m, tp=8, pp=4, cp=1)
        b = estimate(cluster, m, tp=4, pp=8, cp=1)
        winner = min((x for x in (a, b) if x["fits"]), key=lambda x: x["step_time_s"], default=None)
        out.append({"shape": name, "model": m.__dict__, "plan_a": a, "plan_b": b,
                    "preferred": None if winner is None else ("A" if winner is a else "B")})
    return out


def print_chapter_example():
    for ex in chapter_example():
        m = ex["model"]
        print(f"\n== {ex['shape']}: L={m['layers']} h={m['hidden']} a={m['heads']} s={m['seq']} "
              f"B={m['global_batch']} recompute={m['recompute']} on 64 GPUs (8 nodes x 8)")
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
          "(small global batch, many large layers) favour A; many micro-batches and narrower layers favour B.")


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------

def _map_main(argv):
    ap = argparse.ArgumentParser(
        prog="topology.py",
        description="Draw the Megatron-LM rank map. Subcommands: 'plan' (the layout planner, see "
                    "'topology.py plan --help') and 'example' (the chapter's 64-GPU plan A against plan B).")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--gpus-per-node", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 8)))
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    a = ap.parse_args(argv)
    print(rank_map(a.nodes, a.gpus_per_node, a.tp, a.pp, a.cp, a.ep))


def _plan_main(argv):
    ap = argparse.ArgumentParser(prog="topology.py plan", description="Rank the layouts of a cluster for a model.")
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gpu-mem-gb", type=float, default=DEFAULT_GPU_MEM_GB)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--tp", type=int)
    ap.add_argument("--pp", type=int)
    ap.add_argument("--cp", type=int)
    ap.add_argument("--nvlink-gbps", type=float, default=DEFAULT_NVLINK_GBPS, help="GB/s per GPU, one direction")
    ap.add_argument("--ib-gbps", type=float, default=DEFAULT_IB_GBPS, help="GB/s per GPU across nodes")
    ap.add_argument("--peak-tflops", type=float, default=DEFAULT_PEAK_TFLOPS)
    ap.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    cluster = Cluster(a.gpus, a.gpus_per_node, a.gpu_mem_gb, a.nvlink_gbps, a.ib_gbps, a.peak_tflops)
    m = ModelShape(a.layers, a.hidden, a.heads, a.seq, a.vocab, a.global_batch, a.micro_batch, a.recompute)
    plans = plan(cluster, m, a.tp, a.pp, a.cp)
    if a.json:
        print(json.dumps(plans, indent=1))
        return
    print(f"model: {parameter_count(m) / 1e9:.2f} B parameters; {training_flops(m) / 1e15:.1f} PFLOP per step")
    print(format_table(plans))
    print()
    print(explain(plans, cluster))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:
        _plan_main(argv[1:])
    elif argv[:1] == ["example"]:
        print_chapter_example()
    else:
        _map_main(argv)


if __name__ == "__main__":
    main()
