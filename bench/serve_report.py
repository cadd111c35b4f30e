"""The HTTP serving benchmark as a markdown table and a latency-vs-rate plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.report import cpu_label


def _rate(rate: float) -> str:
    return "all at once" if rate == float("inf") else f"{rate:g}/s"


def markdown(results: dict[str, Any]) -> str:
    cfg = results["config"]
    lines = []
    if m := results.get("machine"):
        lines.append(
            f"Machine: {cpu_label(m)}, {m['cores']} cores, torch {m['torch']}; tp {cfg['tp']}, "
            f"{results['threads_per_rank']} thread(s) per rank; client, server and ranks on "
            "the same cores."
        )
    lines.append(
        f"Workload: {cfg['num_prompts']} requests per rate, prompt {cfg['prompt_len']} and "
        f"output {cfg['output_len']} tokens (greedy, EOS ignored), Poisson arrivals "
        f"(seed {cfg['seed']}); each number the median of {cfg['reps']} repetitions, rates "
        "interleaved within each repetition.\n"
    )
    lines += [
        "| mode | transport | rate | req/s | out tok/s | TTFT ms (p50 / p99) "
        "| TPOT ms (p50) | ITL ms (p50 / p99) | E2E ms (p50) | failed |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r.get('mode', '–')} | {r['transport']} | {_rate(r['rate'])} "
            f"| {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} "
            f"| {r['ttft_ms']['median']:.0f} / {r['ttft_ms']['p99']:.0f} "
            f"| {r['tpot_ms']['median']:.1f} "
            f"| {r['itl_ms']['median']:.1f} / {r['itl_ms']['p99']:.1f} "
            f"| {r['e2e_ms']['median']:.0f} | {r['requests'] - r['completed']} |"
        )
    if results.get("http_overhead"):
        lines += [
            "",
            "HTTP against the same engine in-process (the server's own loop, no HTTP):",
            "",
            "| mode | rate | out tok/s HTTP ÷ in-process | TTFT ms added | ITL ms added |",
            "| --- | --- | ---: | ---: | ---: |",
        ]
        for o in results["http_overhead"]:
            lines.append(
                f"| {o['mode']} | {_rate(o['rate'])} | {o['tokens_per_s_ratio']:.3f} "
                f"| {o['ttft_ms_added']:+.1f} | {o['itl_ms_added']:+.2f} |"
            )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = results["rows"]
    finite = [r["rate"] for r in rows if r["rate"] != float("inf")]
    at_once = 2 * max(finite) if finite else 1.0  # where "all at once" sits on the x axis
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (
        ("ttft_ms", "TTFT p50 (ms)"),
        ("tpot_ms", "TPOT p50 (ms)"),
        ("e2e_ms", "E2E p50 (ms)"),
    )

    def series_of(r: dict[str, Any]) -> tuple[str, str]:
        return r.get("mode", "server"), r["transport"]

    series = sorted({series_of(r) for r in rows})
    modes = sorted({mode for mode, _ in series})
    colour = {mode: f"C{i}" for i, mode in enumerate(modes)}  # one colour per mode
    ticks = sorted({at_once if r["rate"] == float("inf") else r["rate"] for r in rows})
    for ax, (key, title) in zip(axes, panels, strict=True):
        for mode, transport in series:
            mine = [r for r in rows if series_of(r) == (mode, transport)]
            xs = [at_once if r["rate"] == float("inf") else r["rate"] for r in mine]
            ys = [r[key]["median"] for r in mine]
            style = "-o" if transport == "http" else "--x"
            ax.plot(xs, ys, style, color=colour[mode], label=f"{mode} ({transport})")
        ax.set_xscale("log")
        ax.set_xticks(ticks, ["all" if t == at_once else f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("request rate (req/s; all: every request at once)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path = out / "latency_vs_rate.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
