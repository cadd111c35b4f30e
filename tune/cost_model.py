"""A cost model of one transformer block per rank: compute from the plan's GEMMs and
attention on a roofline, communication from the plan's collectives on a ring.

Inputs: a ``ModePlan`` (``dsl.plan``), a ``DeviceProfile`` (``tune.profiles``) and a
``Workload`` (tokens in one forward, the context each attends to). Per local GEMM of
``in × out`` over T rows, time = max(2·T·in·out / matmul rate, bytes moved / memory
bandwidth) with bytes = (in·out + T·(in + out))·dtype bytes; attention reads each
token's context of K and V (or of the latent z_k, z_v, rebuilding keys) for the heads
the rank computes — all of them in base mode, its share elsewhere; a fixed
``op_overhead_s`` per operator covers what the roofline does not (dispatch on a CPU).
A ring all-reduce of n elements sends 2(t−1)/t·n per rank in 2(t−1) steps, an
all-gather (t−1)/t·n in t−1 steps; each step costs ``link_latency_s``.

Nothing here imports torch: the model is arithmetic over the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsl.plan import ALL_GATHER, LayerPlan, ModePlan
from tune.profiles import DeviceProfile

# Operators of a block outside its GEMMs (two norms, RoPE, softmax-attention, the
# activation, two residual adds, the cache write and the collectives' copies): what the
# per-operator overhead is charged for, beside one per GEMM.
ELEMENTWISE_OPS = 10


@dataclass(frozen=True)
class Workload:
    tokens: int  # rows in one forward of the block (decode: the batch)
    context: int = 0  # positions each token attends to (its sequence's length)
    kv_cache: str = "dense"  # dense | latent


@dataclass(frozen=True)
class BlockPrediction:
    mode: str
    tp: int
    gemm_s: float
    attention_s: float
    overhead_s: float
    comm_s: float
    comm_bytes_per_rank: float
    collectives: int
    gather: str  # "ring-overlap" | "single" | "-": how deinfer's all-gathers should run

    @property
    def compute_s(self) -> float:
        return self.gemm_s + self.attention_s + self.overhead_s

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s


def gemm_seconds(rows: int, n_in: int, n_out: int, dtype_bytes: int, dev: DeviceProfile) -> float:
    flops = 2.0 * rows * n_in * n_out
    moved = (n_in * n_out + rows * (n_in + n_out)) * dtype_bytes
    return max(flops / dev.matmul_flops_per_s, moved / dev.memory_bytes_per_s)


def local_gemms(lp: LayerPlan, rank: int = 0) -> list[tuple[str, int, int]]:
    """(name, in, out) of every GEMM rank ``rank`` runs for this layer."""
    gemms = [(f"{c.name}.concat", c.in_features, c.width) for c in lp.concats]
    for f in lp.factors:
        if f.factor != "bias":
            n_in, n_out = f.local_shape(rank)
            gemms.append((f.tensor, n_in, n_out))
    return gemms


def attention_seconds(lp: LayerPlan, mp: ModePlan, work: Workload, dev: DeviceProfile) -> float:
    """Decode attention over ``work.context`` positions per token: QKᵀ and PV FLOPs for
    the rank's heads, and the cache bytes read; a latent cache also rebuilds keys
    (2·r_k·d FLOPs per KV head, position and token) while V stays absorbed."""
    if not work.context:
        return 0.0
    positions = work.tokens * work.context
    flops = 4.0 * mp.head_dim * lp.attention_heads_per_rank * positions
    cached = lp.kv_per_rank(work.kv_cache)
    if work.kv_cache == "latent" and cached != lp.kv_dense_per_rank:
        kv_heads_local = lp.kv_dense_per_rank // (2 * mp.head_dim)
        rank_k = lp.shape.rank("k")
        flops += 2.0 * rank_k * kv_heads_local * mp.head_dim * positions
    moved = positions * cached * mp.dtype_bytes
    return max(flops / dev.matmul_flops_per_s, moved / dev.memory_bytes_per_s)


def _collective_seconds(kind: str, elements_per_rank: float, tp: int, dev: DeviceProfile, b: int):
    steps = (tp - 1) * (1 if kind == ALL_GATHER else 2)
    return elements_per_rank * b / dev.link_bytes_per_s + steps * dev.link_latency_s


def comm_seconds(lp: LayerPlan, tp: int, tokens: int, dev: DeviceProfile, b: int) -> float:
    if tp == 1:
        return 0.0
    return sum(
        _collective_seconds(c.kind, c.ring_elements_per_rank(tp) * tokens, tp, dev, b)
        for c in lp.collectives
    )


def _gather_choice(lp: LayerPlan, tp: int, work: Workload, dev: DeviceProfile, b: int) -> str:
    """Ring all-gather overlapped with the up GEMM, or one all-gather then the GEMM.

    The ring sends t−1 chunks, each after the previous arrived, while the up GEMM of
    the chunk in hand runs: per step max(chunk transfer + one latency + two P2P calls,
    chunk GEMM). One all-gather moves the same bytes in the same t−1 steps but is one
    call, and cannot hide behind the GEMM. So the ring wins once a chunk's GEMM is
    worth more than the calls it costs: at large batches, not at small ones."""
    gathered = [cat for cat in lp.concats if not cat.whole]
    if tp == 1 or not gathered:
        return "-"
    ring = single = 0.0
    for cat in gathered:
        members = {name for name, _ in cat.members}
        up = sum(
            gemm_seconds(work.tokens, *f.local_shape(0), b, dev)
            for f in lp.factors
            if f.factor == "up" and f.matrix in members
        )
        chunk = cat.padded / tp * work.tokens * b / dev.link_bytes_per_s
        step = chunk + dev.link_latency_s
        ring += up / tp + (tp - 1) * max(step + 2 * dev.op_overhead_s, up / tp)
        single += (tp - 1) * step + dev.op_overhead_s + up
    return "ring-overlap" if ring < single else "single"


def _commonest(mp: ModePlan) -> LayerPlan:
    """The layer shape most layers have: the one a per-mode choice is made for."""
    return max(mp.layer_plans, key=lambda lp: len(lp.layers))


def layer_seconds(lp: LayerPlan, mp: ModePlan, dev: DeviceProfile, work: Workload) -> float:
    """Predicted time of one layer of plan ``lp`` (run under ``mp``'s tp, head size and
    dtype): its GEMMs, attention, per-operator overhead and collectives."""
    b = mp.dtype_bytes
    gemms = local_gemms(lp)
    return (
        sum(gemm_seconds(work.tokens, i, o, b, dev) for _, i, o in gemms)
        + attention_seconds(lp, mp, work, dev)
        + (len(gemms) + ELEMENTWISE_OPS) * dev.op_overhead_s
        + comm_seconds(lp, mp.tp, work.tokens, dev, b)
    )


def predict_block(mp: ModePlan, dev: DeviceProfile, work: Workload) -> BlockPrediction:
    """The mean block of ``mp`` (layers weighted by count) at ``work`` on ``dev``."""
    b = mp.dtype_bytes
    gemm = attention = overhead = comm = moved = count = 0.0
    for lp in mp.layer_plans:
        share = len(lp.layers) / mp.num_layers
        gemms = local_gemms(lp)
        gemm += share * sum(gemm_seconds(work.tokens, i, o, b, dev) for _, i, o in gemms)
        attention += share * attention_seconds(lp, mp, work, dev)
        overhead += share * (len(gemms) + ELEMENTWISE_OPS) * dev.op_overhead_s
        comm += share * comm_seconds(lp, mp.tp, work.tokens, dev, b)
        moved += share * sum(c.ring_elements_per_rank(mp.tp) for c in lp.collectives)
        count += share * len(lp.collectives)
    return BlockPrediction(
        mode=mp.mode,
        tp=mp.tp,
        gemm_s=gemm,
        attention_s=attention,
        overhead_s=overhead,
        comm_s=comm if mp.tp > 1 else 0.0,
        comm_bytes_per_rank=moved * work.tokens * b if mp.tp > 1 else 0.0,
        collectives=round(count),
        gather=_gather_choice(_commonest(mp), mp.tp, work, dev, b) if mp.mode == "deinfer" else "-",
    )


def predicted_faster_up_layout(
    replicated: ModePlan, sharded: ModePlan, dev: DeviceProfile, work: Workload
) -> str:
    """The layout of deinfer's o/down up factors this model predicts faster for ``work``:
    replicated (the paper: more weight bytes per rank) or split by columns (two more
    all-gathers of h per block). ``deinfer predict`` reports it; the engine's ``auto``
    does not ask it (its rule is ``runtime.engine.config.auto_up_layout``)."""
    rep, shard = (predict_block(mp, dev, work).total_s for mp in (replicated, sharded))
    return sharded.up_layout if shard < rep else replicated.up_layout


def kv_choice(
    mp: ModePlan, dev: DeviceProfile, work: Workload
) -> list[tuple[tuple[int, ...], str]]:
    """Per layer shape: the cache whose decode attention the model predicts faster."""
    out = []
    for lp in mp.layer_plans:
        if lp.kv_latent_per_rank is None:
            out.append((lp.layers, "dense"))
            continue
        dense = attention_seconds(lp, mp, Workload(work.tokens, work.context, "dense"), dev)
        latent = attention_seconds(lp, mp, Workload(work.tokens, work.context, "latent"), dev)
        out.append((lp.layers, "latent" if latent < dense else "dense"))
    return out


def link_rate_for_ratio(
    mp: ModePlan, dev: DeviceProfile, work: Workload, comm_over_compute: float
) -> float:
    """The link bytes/s at which ``mp``'s comm / compute per block equals the ratio
    (latency per step kept as in ``dev``)."""
    pred = predict_block(mp, dev, work)
    steps = sum(
        (mp.tp - 1) * (1 if c.kind == ALL_GATHER else 2) for c in mp.layer_plans[0].collectives
    )
    budget = comm_over_compute * pred.compute_s - steps * dev.link_latency_s
    if budget <= 0:
        lowest = steps * dev.link_latency_s / pred.compute_s
        raise ValueError(
            f"comm/compute {comm_over_compute:g} is out of reach: the link's latency alone "
            f"({steps} messages per block, {dev.link_latency_s * 1e6:.0f} us each) gives "
            f"{lowest:.2f}; ask for a larger ratio"
        )
    return pred.comm_bytes_per_rank / budget


def overlap_from_rows(mp: ModePlan, dev: DeviceProfile, context: int = 0) -> int | None:
    """The smallest power-of-two row count from which the ring overlap beats one
    all-gather (``RunnerConfig.overlap_min_rows``); None if it never does up to 8192."""
    rows = 1
    while rows <= 8192:
        if predict_block(mp, dev, Workload(rows, context)).gather == "ring-overlap":
            return rows
        rows *= 2
    return None
