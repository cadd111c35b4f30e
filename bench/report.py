"""Bench results as a markdown table and PNG plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _x(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def _serving_cells(v: dict[str, Any]) -> str:
    if not v.get("serving"):
        return "– | –"
    serving = v["serving"][len(v["serving"]) // 2]
    return (
        f"{serving['ttft_ms']['median']:.0f} | {serving['itl_ms']['median']:.1f} / "
        f"{serving['itl_ms']['p99']:.1f}"
    )


def _breakdown_cells(v: dict[str, Any]) -> str:
    br = v.get("breakdown")
    if br is None:
        return "– | – | –"
    measured = br["elements_per_token_per_block"]
    planned = v["planned_elements_per_token_per_block"]
    same = all(abs(measured.get(k, 0) - planned[k]) < 1e-9 for k in planned)
    elements = ", ".join(f"{k.replace('all_', '')} {measured.get(k, 0):,.0f}" for k in planned)
    return (
        f"{br['block_ms_per_step']['communication']:.2f} | "
        f"{br['block_ms_per_step']['compute_and_overhead']:.2f} | "
        f"{elements or 'none'} ({'=' if same else '≠'} plan)"
    )


def _vs_base(v: dict[str, Any]) -> str:
    """The ratio of medians, and the range of the ratio within each repetition."""
    paired = v.get("decode_speedup_vs_base_per_rep")
    if not paired or v["mode"] == "base":
        return _x(v["decode_speedup_vs_base"])
    return f"{_x(v['decode_speedup_vs_base'])} ({paired['min']:.2f}–{paired['max']:.2f})"


def _vs_dense(v: dict[str, Any]) -> str:
    """The row's decode rate over the dense model's under the same tp, link and batch
    (and the range within one repetition)."""
    paired = v.get("decode_speedup_vs_dense_per_rep")
    if not paired or v["mode"] == "dense":
        return _x(v.get("decode_speedup_vs_dense"))
    return f"{_x(v['decode_speedup_vs_dense'])} ({paired['min']:.2f}–{paired['max']:.2f})"


def _vs_dense_kv(v: dict[str, Any]) -> str:
    """A latent-KV row's decode step over the dense-KV row's (and the range within one
    repetition)."""
    if "step_vs_dense_kv" not in v:
        return ""
    paired = v["step_vs_dense_kv_per_rep"]
    return f"{_x(v['step_vs_dense_kv'])} ({paired['min']:.2f}–{paired['max']:.2f})"


def _vs_peer(v: dict[str, Any]) -> str:
    """A tp 1 row's decode rate over llama.cpp's at its thread count (and the range
    within one repetition)."""
    if "decode_speedup_vs_peer" not in v:
        return ""
    paired = v["decode_speedup_vs_peer_per_rep"]
    return f"{_x(v['decode_speedup_vs_peer'])} ({paired['min']:.2f}–{paired['max']:.2f})"


def _vs_tp1(v: dict[str, Any]) -> str:
    """A row's decode rate over the same configuration's at tp 1 (and the range within
    one repetition)."""
    if "decode_speedup_vs_tp1" not in v:
        return ""
    paired = v["decode_speedup_vs_tp1_per_rep"]
    return f"{_x(v['decode_speedup_vs_tp1'])} ({paired['min']:.2f}–{paired['max']:.2f})"


def _label(v: dict[str, Any]) -> str:
    """The row's label, with the up layout an ``auto`` deinfer row resolved to (and its
    down layout where it holds the down factors whole)."""
    if v["mode"] != "deinfer" or v["tp"] == 1:
        return v["label"]
    resolved = []
    up, down = v.get("up_layout_used"), v.get("down_layout_used")
    if v.get("up_layout", "auto") == "auto" and up:
        resolved.append(f"up={up}")
    if v.get("down_layout", "auto") == "auto" and down == "replicated":  # not the paper's
        resolved.append(f"down={down}")
    return f"{v['label']} ({', '.join(resolved)})" if resolved else v["label"]


def _header(latent: bool, scaling: bool, peer: bool = False) -> list[str]:
    """The table's header rows; a latent-vs-dense column only where a latent row has one,
    a vs-tp-1 column only where a row is set against tp 1, a vs-llama.cpp column only
    where the bench ran llama.cpp."""
    columns = [
        "config",
        "threads/rank",
        "decode tok/s (min / median / max)",
        "vs base",
        "vs dense",
        "vs hf",
        *(["vs llama.cpp"] if peer else []),
        *(["vs tp 1"] if scaling else []),
        *(["step vs kv=dense"] if latent else []),
        "of floor",
        "output tok/s",
        "TTFT ms (median)",
        "ITL ms (median / p99)",
        "block comm ms",
        "block rest ms",
        "elements/token/block (measured = plan)",
    ]
    return ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]


def cpu_label(m: dict[str, Any]) -> str:
    """The machine's CPU as reports name it: model and widest vector instructions."""
    return f"{m['cpu']} ({m['vector_isa']})" if m.get("vector_isa") else m["cpu"]


def _preamble(results: dict[str, Any]) -> str:
    m = results["machine"]
    cfg = results["config"]
    bandwidth = m.get("memory_bandwidth_bytes_per_s")
    return (
        f"Machine: {cpu_label(m)}, {m['cores']} cores, GPU {m['gpu'] or 'none'}; "
        f"torch {m['torch']}, triton {m['triton']}. Spec `{cfg['spec']}`, "
        f"{cfg['prompt_len']} prompt + "
        f"{cfg['output_len']} output tokens per request, {cfg['reps']} interleaved repetitions "
        "after a warm-up"
        + (
            " (in each, the engines' decode steps taken in turn, each engine timed over its own)."
            if cfg.get("lockstep")
            else "."
        )
        + (
            f" Memory bandwidth measured by the bench: {bandwidth / 1e9:.1f} GB/s "
            f"({m['bandwidth_threads']} threads)."
            if bandwidth
            else ""
        )
        + (
            f" CPU time taken by the hypervisor for other guests (steal) during the bench: "
            f"{100 * steal:.1f}% (/proc/stat)."
            if (steal := m.get("cpu_steal_fraction")) is not None
            else ""
        )
    )


def _legend(latent: bool, scaling: bool, alone: bool = False, peer: bool = False) -> str:
    return (
        "*of floor*: decode tok/s over batch / (tp · weight bytes streamed per rank and step /"
        " measured memory bandwidth). *vs hf*: transformers `generate` on the same weights "
        "(products D·U), same prompts and lengths, EOS ignored. *vs base*, *vs dense*: ratio "
        "of the medians to Base's and to the dense model's (Megatron TP over the products "
        "D·U) in the same configuration (in brackets: the lowest and highest ratio within one "
        "repetition). *layout=paper*: deinfer with every decomposed matrix latent, as in the "
        "paper; without it, the optimized layout (each matrix merged or latent as the cost "
        "model predicts faster). "
        + (
            "*vs llama.cpp*: the ratio of the medians to llama.cpp (llama-cpp-python, greedy, "
            "its default f16 KV cache) on the same weights as an fp32 GGUF, at the row's "
            "thread count (in brackets: within one repetition). "
            if peer
            else ""
        )
        + (
            "*step vs kv=dense*: a latent-KV row's decode step time over the same engine's "
            "with a dense KV cache (in brackets: within one repetition). "
            if latent
            else ""
        )
        + (
            "*vs tp 1*: the ratio of the medians to the same configuration at tp 1 with the "
            "bench's threads per rank (in brackets: within one repetition); a tp 1 row with "
            "`threads=N` is the same cores used by one process's threads instead of ranks. "
            if scaling
            else ""
        )
        + (
            "*rank alone*: rank 0 of that tp degree alone in the bench's process, its "
            "collectives waiting for no one (its tokens mean nothing): the rank's own work "
            "per step, what tp N would take if its ranks never waited for each other or for "
            "the driver; the real row's step beyond it is what synchronising costs. "
            if alone
            else ""
        )
        + "*up*: how deinfer held the o/down up factors (replicated, the paper's layout, or "
        "sharded with an all-gather of the output; `auto` picks sharded where the ranks "
        "share memory)."
    )


def _startup(variants: list[dict[str, Any]]) -> str:
    """One sentence: each engine's start-up seconds and what its tuning did."""
    parts = []
    for v in variants:
        seconds, tuning = v.get("start_seconds"), v.get("tuning")
        if seconds is None:
            continue
        note = ""
        if tuning and tuning["shapes"]:
            note = (
                f" (tuning {tuning['seconds']:.1f} s: {tuning['timed']} of "
                f"{tuning['shapes']} shapes timed)"
            )
        parts.append(f"{v['label']} {seconds:.1f} s{note}")
    if not parts:
        return ""
    return "*Start-up* (engine construction: weights, tuning, caches): " + "; ".join(parts) + "."


def markdown(results: dict[str, Any]) -> str:
    latent = any("step_vs_dense_kv" in v for v in results["variants"])
    scaling = any("decode_speedup_vs_tp1" in v for v in results["variants"])
    peer = any("decode_speedup_vs_peer" in v for v in results["variants"])
    lines = [_preamble(results), "", *_header(latent, scaling, peer)]
    for v in results["variants"]:
        d = v["decode_tokens_per_s"]
        floor = v.get("fraction_of_floor")
        lines.append(
            f"| {_label(v)} | {v.get('threads_per_rank', '')} | "
            f"{d['min']:.1f} / {d['median']:.1f} / {d['max']:.1f} | "
            f"{_vs_base(v)} | {_vs_dense(v)} | {_x(v.get('decode_speedup_vs_hf'))} | "
            + (f"{_vs_peer(v)} | " if peer else "")
            + (f"{_vs_tp1(v)} | " if scaling else "")
            + (f"{_vs_dense_kv(v)} | " if latent else "")
            + f"{'' if floor is None else f'{floor:.0%}'} | "
            f"{v['output_tokens_per_s']['median']:.1f} | {_serving_cells(v)} | "
            f"{_breakdown_cells(v)} |"
        )
    alone = any(v.get("alone") for v in results["variants"])
    lines += ["", _legend(latent, scaling, alone, peer)]
    startup = _startup(results["variants"])
    lines += ["", startup] if startup else []
    return "\n".join(lines) + "\n"


def plots(results: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict[str, list[tuple[int, float]]] = {}
    for v in results["variants"]:
        name = v["label"].replace(f" tp{v['tp']}", "")
        series.setdefault(name, []).append((v["tp"], v["decode_tokens_per_s"]["median"]))
    for name, points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    ax.set_xticks(sorted({v["tp"] for v in results["variants"]}))
    ax.set_xlabel("tensor-parallel degree")
    ax.set_ylabel("decode tokens / s (median)")
    ax.set_title("Decode throughput vs TP")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "throughput_vs_tp.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(7, 4))
    broken = [v for v in results["variants"] if "breakdown" in v]
    if not broken:
        return written
    labels = [v["label"] for v in broken]
    comm = [v["breakdown"]["block_ms_per_step"]["communication"] for v in broken]
    rest = [v["breakdown"]["block_ms_per_step"]["compute_and_overhead"] for v in broken]
    ax.bar(labels, rest, label="compute + overhead")
    ax.bar(labels, comm, bottom=rest, label="communication")
    ax.set_ylabel("ms per block per decode step")
    ax.set_title("Per-block breakdown (paper Table 5)")
    ax.tick_params(axis="x", rotation=45, labelsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "breakdown.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)
    return written
