"""Validated replacements of one section of a parsed ``Spec``: the same checks as the
loader, on the new values only (the rest of the spec is already valid)."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

from dsl.load import SpecParser
from dsl.spec import Spec


def with_tp(spec: Spec, tp: int) -> Spec:
    """``spec`` at another TP degree (checked against the head counts)."""
    return replace(spec, parallel=SpecParser().parallel({"tp": tp}, "parallel", spec.model))


def with_runtime(spec: Spec, **changes: Any) -> Spec:
    """``spec`` with some ``runtime`` fields replaced, e.g. ``max_batch_size=16``."""
    raw = {**asdict(spec.runtime), **changes}
    raw["cuda_graph_batch_sizes"] = list(raw["cuda_graph_batch_sizes"])
    return replace(spec, runtime=SpecParser().runtime(raw, "runtime", spec.model))


def with_ratio(
    spec: Spec, ratio: float, rule: str = "smaller_dim_fraction", rank_multiple: int = 1
) -> Spec:
    """``spec`` with every layer's ranks derived from one compression ratio."""
    raw = {"ratio": ratio, "rule": rule, "rank_multiple": rank_multiple}
    return replace(spec, decomposition=SpecParser().decomposition(raw, "decomposition", spec.model))
