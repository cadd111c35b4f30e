"""The emulated-link part of a bench report: per link and mode, the block's compute,
communication and total, measured and predicted by the cost model, beside the paper's
Table 5 ratios; and DeInfer's (and dense's) speed-up over Base against the link rate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Table 5 (ms per block, TP 2): Base and DeInfer without and with NVLink.
PAPER_TP2 = {
    "without NVLink": {"base": (2.352, 12.182), "deinfer": (1.809, 0.977)},
    "with NVLink": {"base": (2.391, 0.891), "deinfer": (1.792, 0.232)},
}


def _rows_by_link(results: dict[str, Any]) -> dict[str, dict[str, dict]]:
    """{link: {row name: row}}, a row named by its mode and any down layout asked for."""
    out: dict[str, dict[str, dict]] = {}
    for v in results["variants"]:
        if v.get("link") and "breakdown" in v:
            down = v.get("down_layout", "auto")
            name = v["mode"] + ("" if down == "auto" else f" down={down}")
            out.setdefault(v["link"], {})[name] = v
    return out


def _rate(results: dict[str, Any], link: str) -> float:
    """Bytes/s measured across ``link`` (Base's message size where planned)."""
    planned = results.get("planner", {}).get("links", {}).get(link, {})
    if "measured_bytes_per_s" in planned:
        return planned["measured_bytes_per_s"]
    return results["links"][link]["probe"]["bytes_per_s"]


def _err(measured: float, predicted: float | None) -> str:
    return "" if predicted is None else f"{predicted / measured - 1:+.0%}"


def _own(breakdown: dict[str, Any]) -> str:
    """The layers' own compute per block: the median, and the range over repetitions."""
    own = breakdown.get("block_compute_ms_per_step")
    if own is None:
        return "–"
    spread = [r for r in breakdown.get("block_compute_ms_per_rep", []) if r is not None]
    return f"{own:.2f}" + (f" ({min(spread):.1f}–{max(spread):.1f})" if len(spread) > 1 else "")


def link_markdown(results: dict[str, Any]) -> str:
    rows = _rows_by_link(results)
    if not rows:
        return ""
    lines = [
        "",
        "Per block and decode step, ms: measured (timed collectives; compute is the rest, "
        "with the block's share of the LM head and runtime) and predicted by the cost model "
        "from this machine's calibrated profile and the rate measured across each link. "
        "*layers' own*: the decoder layers' time less their collectives and the waits "
        "before them, per block, on the slowest rank (median, and range, over repetitions).",
        "",
        "| link | measured rate | mode | compute | (pred.) | layers' own | comm | (pred.) | total "
        "| (pred.) | comm / compute | decode tok/s | vs base | comm vs base |",
        "| --- | ---: | --- |" + " ---: |" * 11,
    ]
    for link, modes in rows.items():
        base_comm = modes.get("base", {}).get("breakdown", {}).get("block_ms_per_step", {})
        for mode, v in modes.items():
            b = v["breakdown"]["block_ms_per_step"]
            comp, comm = b["compute_and_overhead"], b["communication"]
            p = v.get("predicted", {})
            cut = f"{comm / base_comm['communication'] - 1:+.0%}" if base_comm else ""
            speed = v.get("decode_speedup_vs_base")
            own = _own(v["breakdown"])
            lines.append(
                f"| {link} | {_rate(results, link) / 1e6:.1f} MB/s | {mode} | {comp:.1f} | "
                f"{_err(comp, p.get('compute_ms'))} | {own} | "
                f"{comm:.1f} | {_err(comm, p.get('comm_ms'))} "
                f"| {comp + comm:.1f} | {_err(comp + comm, p.get('total_ms'))} | "
                f"{comm / comp:.2f} | {v['decode_tokens_per_s']['median']:.1f} | "
                f"{'' if speed is None else f'{speed:.2f}x'} | {cut} |"
            )
    lines += [
        "",
        "(pred.): the prediction's error against the measurement. The paper's Table 5 at "
        "TP 2, for comparison:",
        "",
        "| paper link | Base comm / compute | DeInfer / Base per block | DeInfer comm vs Base |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, t in PAPER_TP2.items():
        (bc, bm), (dc, dm) = t["base"], t["deinfer"]
        lines.append(
            f"| {name} | {bm / bc:.2f} | {(bc + bm) / (dc + dm):.2f}x | {dm / bm - 1:+.0%} |"
        )
    return "\n".join(lines) + "\n"


def link_plot(results: dict[str, Any], out: Path) -> Path | None:
    """Speed-up over Base (decode tok/s medians) against the measured link rate."""
    rows = _rows_by_link(results)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    names = sorted({name for modes in rows.values() for name in modes if name != "base"})
    for mode in names:
        points = sorted(
            (_rate(results, link), modes[mode]["decode_speedup_vs_base"])
            for link, modes in rows.items()
            if mode in modes and modes[mode].get("decode_speedup_vs_base")
        )
        if points:
            ax.plot([p[0] / 1e6 for p in points], [p[1] for p in points], marker="o", label=mode)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("link rate measured across it (MB/s)")
    ax.set_ylabel("decode throughput / Base's")
    ax.set_title("Speed-up over Base vs link rate (tp 2)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "speedup_vs_link.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
