"""Which of a decomposed layer's matrices run merged: their factors multiplied once at
load (D·U) and run as a Megatron dense shard, the others in the latent dataflow.

A layout is a mapping from layer shape (the checkpoint's ranks) to the names of the
matrices merged in layers of that shape. ``with_merged`` turns it into the *execution
spec*: the same spec with those matrices undecomposed, from which the plan, the
generated kernels and the caches follow unchanged — the checkpoint still holds their
factors, and the weight reader forms each rank's slice of D·U
(``runtime.model.weights``). ``paper`` merges nothing (the paper's dataflow);
``optimized`` merges what the cost model predicts faster (``tune.layout``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from dsl.errors import SpecError
from dsl.spec import LayerRanks, Spec

PAPER, OPTIMIZED = "paper", "optimized"
LAYOUTS = (PAPER, OPTIMIZED)

Merges = Mapping[LayerRanks, frozenset[str]]


def merged_ranks(shape: LayerRanks, merged: frozenset[str]) -> LayerRanks:
    """``shape`` with the ``merged`` matrices undecomposed (rank None)."""
    return LayerRanks(tuple((n, None if n in merged else r) for n, r in shape.ranks))


def with_merged(spec: Spec, merges: Merges) -> Spec:
    """The execution spec: ``spec`` whose layers run the matrices ``merges`` names for
    their shape as dense shards. Only decomposed matrices of the model can be merged."""
    if not merges:
        return spec
    shapes = set(spec.layer_shapes())
    for shape, names in merges.items():
        if shape not in shapes:
            raise SpecError("layout", f"no layer has the ranks {shape.key()}")
        for name in names:
            if name not in shape.as_dict() or not shape.is_decomposed(name):
                raise SpecError("layout", f"{name} is not a decomposed matrix of {shape.key()}")
    layers = tuple(
        merged_ranks(ranks, frozenset(merges.get(ranks, ()))) for ranks in spec.decomposition.layers
    )
    return replace(spec, decomposition=replace(spec.decomposition, layers=layers))
