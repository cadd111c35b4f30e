"""The bench's comparisons between rows: each row's spread over repetitions, its ratio to
base, to transformers, to the same configuration at tp 1 and to the weight-streaming
floor, and a latent-KV row's step time against the same engine with a dense KV cache."""

from __future__ import annotations

import statistics
from typing import Any

from bench.variants import EXTERNAL_MODES


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _rates(var: dict[str, Any]) -> list[float]:
    return [r["decode_tokens_per_s"] for r in var["throughput"]]


def _key(var: dict[str, Any], **changes: Any) -> tuple:
    """The row ``var`` would be with ``changes`` (mode, kv_cache, tp, up_layout, threads —
    None: the bench's —, alone — its rank 0 alone, ``RankAloneLLM`` — ...); every other
    field its own."""
    row = {
        "mode": var["mode"],
        "kv_cache": var["kv_cache"],
        "tp": var["tp"],
        "ratio": var["ratio"],
        "batch": var["batch"],
        "max_seq_len": var["max_seq_len"],
        "link": var.get("link"),
        "up_layout": var.get("up_layout", "auto"),
        "layout": var.get("layout", "optimized"),
        "down_layout": var.get("down_layout", "auto"),
        "threads": var.get("threads"),
        "alone": bool(var.get("alone")),
    }
    return tuple((row | changes).values())


# The fields of the transformers row of a row's ratio and batch: tp 1 in one process at
# the bench's threads, no KV-cache kind, up layout, length or link of its own.
_TRANSFORMERS = {
    "mode": "hf",
    "kv_cache": "-",
    "tp": 1,
    "max_seq_len": None,
    "link": None,
    "up_layout": "auto",
    "layout": "optimized",
    "down_layout": "auto",
    "threads": None,
    "alone": False,
}


# The fields of the llama.cpp row of a row's ratio, batch and thread count (``peer``).
_PEER = _TRANSFORMERS | {"mode": "llama.cpp"}


def _paired(rates: list[float], reference: list[float]) -> dict[str, float]:
    """The ratio within each repetition (rows of one repetition run minutes apart at
    most, so the machine's drift between repetitions cancels): min/median/max."""
    return _spread([a / b for a, b in zip(rates, reference, strict=True)])


def add_ratios(results: dict[str, Any]) -> None:
    """min/median/max over repetitions; each median's ratio to base (same tp, ratio,
    batch, length and link), to transformers (same ratio and batch) and to the
    weight-streaming floor: batch / (tp · streamed bytes per rank / memory bandwidth),
    since the ranks share the memory bus. A latent-KV row also gets its decode step
    time over the dense-KV row's of the same engine configuration."""
    rates: dict[tuple, list[float]] = {}
    for var in results["variants"]:
        var["decode_tokens_per_s"] = _spread(_rates(var))
        var["output_tokens_per_s"] = _spread([r["output_tokens_per_s"] for r in var["throughput"]])
        rates[_key(var)] = _rates(var)
    for var in results["variants"]:
        _against_base_and_hf(var, rates)
        _against_tp1(var, rates)
        _latent_against_dense(var, rates)
        _against_floor(var, results)


def _against_base_and_hf(var: dict[str, Any], rates: dict[tuple, list[float]]) -> None:
    median = var["decode_tokens_per_s"]["median"]
    others = {"kv_cache": "dense", "up_layout": "auto", "layout": "optimized"}
    others["down_layout"] = "auto"
    base = rates.get(_key(var, mode="base", **others))
    dense = rates.get(_key(var, mode="dense", **others))
    hf = rates.get(_key(var, **_TRANSFORMERS))
    var["decode_speedup_vs_base"] = median / statistics.median(base) if base else None
    if base:
        var["decode_speedup_vs_base_per_rep"] = _paired(_rates(var), base)
    # the dense model under the same tp, link and batch: what a user would serve instead
    var["decode_speedup_vs_dense"] = median / statistics.median(dense) if dense else None
    if dense:
        var["decode_speedup_vs_dense_per_rep"] = _paired(_rates(var), dense)
    if var["mode"] == "deinfer" and var.get("layout", "optimized") != "paper":
        paper = rates.get(_key(var, layout="paper", down_layout="auto"))
        var["decode_speedup_vs_paper_layout"] = median / statistics.median(paper) if paper else None
    var["decode_speedup_vs_hf"] = median / statistics.median(hf) if hf else None
    # llama.cpp at the row's thread count, where the bench ran it (tp 1 rows)
    peer = rates.get(_key(var, **(_PEER | {"threads": var.get("threads")})))
    if peer and var["tp"] == 1:
        var["decode_speedup_vs_peer"] = median / statistics.median(peer)
        var["decode_speedup_vs_peer_per_rep"] = _paired(_rates(var), peer)


def _against_tp1(var: dict[str, Any], rates: dict[tuple, list[float]]) -> None:
    """Scaling: the row's decode rate over the same configuration's at tp 1 with the
    bench's thread count (tp 1 rows with their own thread count, ``tp1_threads``, are
    the same cores used by threads instead of ranks)."""
    if var["mode"] in EXTERNAL_MODES or (var["tp"] == 1 and var.get("threads") is None):
        return
    one = rates.get(_key(var, tp=1, threads=None, alone=False))
    if not one:
        return
    var["decode_speedup_vs_tp1"] = var["decode_tokens_per_s"]["median"] / statistics.median(one)
    var["decode_speedup_vs_tp1_per_rep"] = _paired(_rates(var), one)


def _latent_against_dense(var: dict[str, Any], rates: dict[tuple, list[float]]) -> None:
    """Step time ratio = dense tok/s over latent tok/s (same batch, so same tokens per
    step): what a latent cache costs per decode step."""
    dense = rates.get(_key(var, kv_cache="dense"))
    if var["kv_cache"] != "latent" or not dense:
        return
    var["step_vs_dense_kv"] = statistics.median(dense) / var["decode_tokens_per_s"]["median"]
    var["step_vs_dense_kv_per_rep"] = _paired(dense, _rates(var))


def _against_floor(var: dict[str, Any], results: dict[str, Any]) -> None:
    cfg = results["config"]
    bandwidth = results["machine"].get("memory_bandwidth_bytes_per_s")
    batch = var["batch"] or min(cfg["num_requests"], cfg["max_batch"])
    streamed = var.get("streamed_weight_bytes_per_rank")
    if bandwidth and streamed:
        floor_step = var["tp"] * streamed / bandwidth
        var["floor_decode_tokens_per_s"] = batch / floor_step
        var["fraction_of_floor"] = var["decode_tokens_per_s"]["median"] * floor_step / batch
