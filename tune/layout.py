"""The optimized layout: for each layer shape, which matrices run merged (D·U once at
load, a Megatron dense shard) and which keep the latent dataflow — the combination the
cost model (``tune.cost_model``) predicts fastest for one decode workload on one device.

Every subset of a shape's decomposed matrices is a candidate (at most 2⁷ = 128: each is
one layer plan, arithmetic only); the block's collectives follow from the subset (a
column group whose members are all merged has no latent all-gather; a merged o or down
all-reduces its output, Megatron's one all-reduce of h). Ties go to fewer weight bytes
per rank, then to fewer merged matrices. A latent KV cache needs k and v latent:
``keep_latent_kv`` keeps them so where the user asked for that cache.

On the CPU's dynamic path a layer decodes through the native block only where each
column group is merged whole or not at all (``runtime.model.decode_block``): there
``whole_groups`` leaves out the candidates that split a group (on cpu-demo at
param_count, down factors whole, the model merged k and v alone by bytes, 1.05M against
1.13M elements per rank, and the layer lost the block: 0.78x the split-down engine at
batch 1, whose layout left every matrix latent).

The column groups' down factors split (the latent all-gathered) or whole on every rank
(``down_layout``) is the engine's rule (``runtime.engine.config.auto_down_layout``); the
layout is chosen for the one it resolved.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

from dsl.dataflow import build_plan, layer_plan_for
from dsl.layout import Merges, merged_ranks
from dsl.plan import COLUMN_GROUPS, DOWN_SHARDED, UP_REPLICATED, ModePlan
from dsl.spec import LayerRanks, Spec
from tune.cost_model import Workload, layer_seconds
from tune.profiles import DeviceProfile


@dataclass(frozen=True)
class MatrixChoice:
    """One matrix of a shape: its choice and the predicted layer time either way (the
    shape's other matrices as chosen)."""

    name: str
    merged: bool
    latent_s: float
    merged_s: float


@dataclass(frozen=True)
class ShapeChoice:
    shape: LayerRanks  # the checkpoint's ranks
    layers: tuple[int, ...]
    merged: frozenset[str]
    seconds: float  # predicted layer time, as chosen
    paper_s: float  # every decomposed matrix latent (the paper's dataflow)
    dense_s: float  # the dense model's layer under Megatron TP
    weight_elements: int  # per rank, as chosen
    matrices: tuple[MatrixChoice, ...]


class _ShapeCosts:
    """Predicted times of one shape's candidates, each built and timed once."""

    def __init__(self, spec: Spec, mp: ModePlan, shape: LayerRanks, dev, work, up_layout):
        self.spec, self.mp, self.shape = spec, mp, shape
        self.dev, self.work, self.up_layout = dev, work, up_layout
        self.cache: dict[frozenset[str], tuple[float, int]] = {}

    def cost(self, merged: frozenset[str]) -> tuple[float, int]:
        if merged not in self.cache:
            ranks = merged_ranks(self.shape, merged)
            lp = layer_plan_for(
                self.spec.model,
                ranks,
                self.mp.tp,
                "deinfer",
                self.up_layout,
                down_layout=self.mp.down_layout,
            )
            self.cache[merged] = (
                layer_seconds(lp, self.mp, self.dev, self.work),
                lp.weight_elements(),
            )
        return self.cache[merged]


def _groups_whole(merged: frozenset[str], decomposed: set[str]) -> bool:
    """Whether each column group's decomposed matrices are all merged or all latent."""
    for group in COLUMN_GROUPS:
        members = decomposed.intersection(group)
        if merged & members and not members <= merged:
            return False
    return True


def choose_shape(
    spec: Spec,
    mp: ModePlan,
    shape: LayerRanks,
    dev: DeviceProfile,
    work: Workload,
    keep_latent_kv: bool = False,
    whole_groups: bool = False,
) -> ShapeChoice:
    """The fastest subset of ``shape``'s decomposed matrices to merge (``whole_groups``:
    among those that merge a column group whole or not at all)."""
    costs = _ShapeCosts(spec, mp, shape, dev, work, mp.up_layout)
    decomposed = [n for n, r in shape.ranks if r is not None]
    kv = {"k", "v"} if keep_latent_kv and {"k", "v"} <= set(decomposed) else set()
    free = [n for n in decomposed if n not in kv]
    candidates = [frozenset(c) for k in range(len(free) + 1) for c in combinations(free, k)]
    if whole_groups:
        candidates = [c for c in candidates if _groups_whole(c, set(decomposed))]
    best = min(candidates, key=lambda c: (*costs.cost(c), len(c)))
    seconds, elements = costs.cost(best)
    dense = layer_plan_for(spec.model, shape, mp.tp, "dense")
    matrices = tuple(
        MatrixChoice(
            name=n,
            merged=n in best,
            latent_s=costs.cost(best - {n})[0],
            merged_s=costs.cost(best | {n})[0] if n not in kv else float("nan"),
        )
        for n in decomposed
    )
    return ShapeChoice(
        shape=shape,
        layers=spec.layers_of_shape(shape),
        merged=best,
        seconds=seconds,
        paper_s=costs.cost(frozenset())[0],
        dense_s=layer_seconds(dense, mp, dev, work),
        weight_elements=elements,
        matrices=matrices,
    )


def choose_layout(
    spec: Spec,
    dev: DeviceProfile,
    work: Workload,
    tp: int | None = None,
    up_layout: str = UP_REPLICATED,
    keep_latent_kv: bool = False,
    down_layout: str = DOWN_SHARDED,
    whole_groups: bool = False,
) -> tuple[ShapeChoice, ...]:
    """Each layer shape's choice for ``spec`` at ``tp`` (default: the spec's)."""
    plan = build_plan(spec, tp, modes=("deinfer",), up_layout=up_layout, down_layout=down_layout)
    mp = plan.modes["deinfer"]
    return tuple(
        choose_shape(spec, mp, shape, dev, work, keep_latent_kv, whole_groups)
        for shape in spec.layer_shapes()
    )


def merges_of(choices: tuple[ShapeChoice, ...]) -> Merges:
    """The layout ``dsl.layout.with_merged`` takes: shape → merged matrices."""
    return {c.shape: c.merged for c in choices if c.merged}


def predicted_step_s(choices: tuple[ShapeChoice, ...]) -> float:
    """The layers' predicted time per decode step under ``choices``."""
    return sum(c.seconds * len(c.layers) for c in choices)
