"""A ``Spec`` back to YAML: the canonical text of a parsed spec.

``parse_spec(dump_spec(s)) == s`` for every spec (a test holds it). Ranks are written
out per layer (layer 0's as the defaults, the others as overrides), so the text no
longer depends on how the original file derived them; the ratio and rule stay as the
record of where they came from. Used to hand a derived spec (another tp, another
runtime section) to a program that reads spec files, and for the spec's digest.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from typing import Any

import yaml

from dsl.spec import LayerRanks, ModelConfig, Spec


def dump_spec(spec: Spec) -> str:
    """The canonical YAML text of ``spec``."""
    raw = {
        "name": spec.name,
        "model": _model(spec.model),
        "decomposition": _decomposition(spec),
        "parallel": {"tp": spec.parallel.tp},
        "runtime": {
            **asdict(spec.runtime),
            "cuda_graph_batch_sizes": list(spec.runtime.cuda_graph_batch_sizes),
        },
    }
    return yaml.safe_dump(raw, sort_keys=False, default_flow_style=None)


def spec_digest(spec: Spec) -> str:
    """sha256 of the canonical text: equal specs, equal digests, whatever the file's
    formatting, comments or way of deriving ranks."""
    return hashlib.sha256(dump_spec(spec).encode()).hexdigest()


def _model(model: ModelConfig) -> dict[str, Any]:
    raw = asdict(model)
    positions = raw["positions"]
    if model.positions.kind == "learned":
        raw["positions"] = {"kind": "learned", "offset": positions["offset"]}
    else:
        del positions["offset"]
        if positions["scaling"] is None:
            del positions["scaling"]
    return raw


def _ranks(shape: LayerRanks) -> dict[str, int | str]:
    return {name: "dense" if rank is None else rank for name, rank in shape.ranks}


def _decomposition(spec: Spec) -> dict[str, Any]:
    d = spec.decomposition
    raw: dict[str, Any] = {}
    if d.ratio is not None:
        raw["ratio"] = d.ratio
        raw["rule"] = d.rule
    first = d.layers[0]
    raw["ranks"] = _ranks(first)
    overrides = [
        {"layers": list(spec.layers_of_shape(shape)), "ranks": _ranks(shape)}
        for shape in spec.layer_shapes()
        if shape != first
    ]
    if overrides:
        raw["overrides"] = overrides
    return raw
