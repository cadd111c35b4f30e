"""One row of the bench's report: a variant's runs with what its engine holds and chose,
and the thread count each row runs at."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from bench.config import BenchConfig
from bench.measure import median_breakdown
from bench.variants import Variant, planned_elements
from runtime.engine.config import default_path, default_threads


def threads_per_rank(cfg: BenchConfig, v: Variant) -> int:
    """The row's intra-op threads per rank: its own, the bench's, or cores // tp. The hf
    row is one process, which a user would give every core the widest engine row uses
    (at tp 2 with one thread per rank: two threads), never more than the machine has."""
    if v.mode == "hf" and not v.threads:
        cores = default_threads(1)
        return min(cores, cfg.threads * max(cfg.tps)) if cfg.threads else cores
    return v.threads or cfg.threads or default_threads(v.tp)


def streamed_bytes(v: Variant, engine) -> int:
    """The weight bytes a decode step of the row's engine streams per rank."""
    if not v.external:
        return engine.workers.call("streamed_weight_bytes")[0]
    if v.mode == "llama.cpp":
        return engine.streamed_weight_bytes
    named = engine.named_parameters(remove_duplicate=False)
    return sum(p.numel() * p.element_size() for n, p in named if "embed_tokens" not in n)


def report_row(v: Variant, runs: list[dict[str, Any]], engine, spec, cfg: BenchConfig) -> dict:
    """The report's row of ``v``: its runs, what its engine holds and chose, and the
    median of its per-repetition breakdowns."""

    def rank0(method: str) -> Any:
        """Rank 0's answer to ``method`` (None for the rows of other programs)."""
        return None if v.external else engine.workers.call(method)[0]

    row = {
        **asdict(v),
        "label": v.label,
        "threads_per_rank": threads_per_rank(cfg, v),
        "path": None if v.external else cfg.path or default_path(),
        "throughput": [r["throughput"] for r in runs],
        "serving": [r["serving"] for r in runs if "serving" in r],
        "streamed_weight_bytes_per_rank": streamed_bytes(v, engine),
        # rank 0's tuned product forms (the ranks of a group choose alike when their
        # shards have the same shapes), {"KxN": {rows: form}}; none off the CPU path
        "gemm_forms": rank0("gemm_forms"),
        # the layout the engine holds deinfer's o/down up factors in ("auto" resolved)
        "up_layout_used": rank0("plan_up_layout"),
        # ... and its column groups' down factors (split, or whole on every rank)
        "down_layout_used": None if v.external else engine.plan.down_layout,
        # rank 0's start-up tuning: shapes, classes, timed, from the cache, seconds
        "tuning": None if v.external else asdict(rank0("tuning_report")),
        # rank 0's reordered weight copies (the tuned "packed" form), beside its weights
        "packed_weight_bytes_per_rank": rank0("packed_weight_bytes"),
        # rank 0's weights kept only in a tuned form's layout (in place of the weight)
        "released_weight_bytes_per_rank": rank0("released_weight_bytes"),
        # rank 0's latent layers: {layer: [key columns copied from the latent, of all]}
        "latent_key_copies": rank0("latent_key_copies"),
    }
    breakdowns = [r["breakdown"] for r in runs if "breakdown" in r]
    if breakdowns:
        row["breakdown"] = median_breakdown(breakdowns)
        planned = planned_elements(spec, v.mode, row["up_layout_used"], row["down_layout_used"])
        row["planned_elements_per_token_per_block"] = planned
    return row
