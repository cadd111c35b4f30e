"""The decoder layer class of each mode."""

from __future__ import annotations

from runtime.model.layers import DecoderLayer, DeinferLayer
from runtime.model.megatron_layers import BaseLayer, DenseLayer

LAYER_CLASSES: dict[str, type[DecoderLayer]] = {
    "deinfer": DeinferLayer,
    "base": BaseLayer,
    "dense": DenseLayer,
}
