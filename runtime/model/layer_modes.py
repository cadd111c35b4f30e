"""The decoder layer class of each mode, and of each layer."""

from __future__ import annotations

from dsl.plan import LayerPlan
from runtime.model.deinfer_layers import DeinferLayer
from runtime.model.layers import DecoderLayer
from runtime.model.megatron_layers import BaseLayer, DenseLayer

LAYER_CLASSES: dict[str, type[DecoderLayer]] = {
    "deinfer": DeinferLayer,
    "base": BaseLayer,
    "dense": DenseLayer,
}


def layer_class(lp: LayerPlan) -> type[DecoderLayer]:
    """The class that runs a layer of plan ``lp``: its mode's, except a deinfer layer
    whose matrices all run merged — its dataflow is then Megatron TP's exactly (the
    plan's shards and two all-reduces of h), which the dense layer runs with its fused
    column products and residual adds."""
    if lp.mode == "deinfer" and not lp.concats and all(f.factor != "up" for f in lp.factors):
        return DenseLayer
    return LAYER_CLASSES[lp.mode]
