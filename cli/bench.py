"""``deinfer bench``: arguments, progress, and the JSON / markdown / PNG outputs."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from dsl.ranks import RULES

if TYPE_CHECKING:
    from bench.config import BenchConfig


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def add_bench(sub: argparse._SubParsersAction) -> None:
    from bench.runner import PRESETS

    p = sub.add_parser("bench", help="throughput, serving and breakdown, modes side by side")
    p.add_argument("--preset", default="cpu-smoke", choices=sorted(PRESETS))
    p.add_argument("--spec", default=None, help="override the preset's spec")
    p.add_argument("--tps", type=_ints, default=None, help="e.g. 1,2,4")
    p.add_argument("--modes", default=None, help="e.g. deinfer,base,dense")
    p.add_argument("--kv-caches", default=None, help="e.g. dense,latent")
    p.add_argument("--ratios", default=None, help="compression ratios, e.g. 0.2,0.4,0.6")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=None, help="requests/s; inf: at once")
    p.add_argument("--backend", choices=("triton", "torch"), default=None)
    p.add_argument(
        "--path",
        choices=("static", "dynamic"),
        default=None,
        help="execution path (default: static on a GPU, dynamic on a CPU)",
    )
    p.add_argument("--threads", type=int, default=None, help="threads per rank (cores // tp)")
    p.add_argument(
        "--tp1-threads",
        type=_ints,
        default=None,
        help="further tp 1 rows with these thread counts, e.g. 2: the cores that tp N uses, "
        "used by threads instead of ranks",
    )
    p.add_argument(
        "--rank-alone",
        action="store_true",
        help="each tp > 1 row again as its rank 0 alone in this process, its collectives "
        "waiting for no one: the rank's own work per step (timing only)",
    )
    p.add_argument("--batches", type=_ints, default=None, help="decode batches, e.g. 1,16")
    p.add_argument(
        "--hf", action="store_true", help="add transformers generate on the same weights"
    )
    p.add_argument(
        "--peer",
        action="store_true",
        help="add llama.cpp on the same weights (needs llama-cpp-python)",
    )
    _add_engine_options(p)
    _add_serve_options(p)
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    p.add_argument("--no-plots", action="store_true")
    p.set_defaults(func=run)


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="one all-gather instead of the ring overlapped with the up GEMM",
    )
    p.add_argument(
        "--no-weight-packing",
        action="store_true",
        help="engines tune their products without reordered weights (oneDNN's blocks, the "
        "native panels), which otherwise replace or sit beside the weights",
    )
    p.add_argument(
        "--lockstep",
        action="store_true",
        help="run the engine rows of each batch (and link) in lockstep: a decode step of each "
        "in turn, each timed over its own, their breakdowns too (transformers rows run alone)",
    )
    p.add_argument(
        "--up-layouts",
        default=None,
        help="deinfer rows: o/down up-factor layouts, e.g. auto,replicated,sharded",
    )
    p.add_argument(
        "--down-layouts",
        default=None,
        help="deinfer rows: layouts of the column groups' down factors, e.g. "
        "auto,sharded,replicated",
    )
    p.add_argument(
        "--layouts",
        default=None,
        help="deinfer rows: matrix layouts, e.g. optimized,paper (default optimized)",
    )
    p.add_argument(
        "--rule",
        choices=RULES,
        default=None,
        help="how --ratios become ranks: the paper's rule (default) or a parameter cut",
    )
    p.add_argument(
        "--link",
        action="append",
        default=None,
        metavar="RATE[,LATENCY]",
        help="emulated link between the ranks (repeat for several): a tc rate such as "
        "200mbit, or ratio:X for the rate at which Base's comm/compute per block is X "
        "(by the cost model, after calibrating this machine); needs root and iproute2",
    )
    p.add_argument(
        "--hosts",
        type=int,
        default=None,
        help="with --link: spread each linked row's ranks over this many emulated machines "
        "(tp // hosts ranks each, loopback between them); default one machine per rank",
    )


def _add_serve_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--serve",
        default=None,
        metavar="URL|start",
        help="the serving benchmark through HTTP: load a running OpenAI-compatible server at "
        "URL, or 'start': run deinfer serve for each of --modes (default deinfer,base,dense) "
        "at one --tps value (default 2) on --spec (default specs/cpu-smoke.yaml), and the "
        "same load in-process",
    )
    p.add_argument("--rates", default=None, help="--serve: requests/s, e.g. 2,8,inf")
    p.add_argument("--num-prompts", type=int, default=None, help="--serve: requests per rate")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=None, help="output tokens per request")
    p.add_argument("--dataset", default=None, help="--serve: JSONL of {prompt, max_tokens}")


def run_serve(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from bench.serve import ServeBenchConfig, bench_modes, bench_url
    from bench.serve_report import markdown, plot
    from dsl.errors import UserError

    if args.tps is not None and len(args.tps) != 1:
        raise UserError("--serve runs one tp degree; give one --tps value")
    overrides = {
        "spec": args.spec,
        "modes": tuple(args.modes.split(",")) if args.modes else None,
        "tp": args.tps[0] if args.tps else None,
        "rates": tuple(float(x) for x in args.rates.split(",")) if args.rates else None,
        "num_prompts": args.num_prompts,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "reps": args.reps,
        "dataset": args.dataset,
    }
    cfg = replace(ServeBenchConfig(), **{k: v for k, v in overrides.items() if v is not None})
    if any(not r > 0 for r in cfg.rates) or cfg.num_prompts < 1 or cfg.reps < 1:
        raise UserError("--rates must be positive, --num-prompts and --reps at least 1")
    bar = tqdm(desc="bench --serve", unit="run", file=sys.stderr)

    def progress(message: str) -> None:
        bar.set_postfix_str(message)
        bar.update(1)

    if args.serve == "start":
        results = bench_modes(cfg, progress)
    else:
        results = bench_url(args.serve, cfg, progress)
    bar.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    table = markdown(results)
    (args.out / "results.md").write_text(table)
    png = None if args.no_plots else plot(results, args.out)
    print(table)
    written = [args.out / "results.json", args.out / "results.md", *([png] if png else [])]
    print("wrote " + ", ".join(map(str, written)))
    return 0


def _bench_config(args: argparse.Namespace, cfg: BenchConfig) -> BenchConfig:
    """The preset ``cfg`` with what the command line gave in its place."""
    overrides = {
        "spec": args.spec,
        "tps": args.tps,
        "reps": args.reps,
        "backend": args.backend,
        "request_rate": args.request_rate,
        "modes": tuple(args.modes.split(",")) if args.modes else None,
        "kv_caches": tuple(args.kv_caches.split(",")) if args.kv_caches else None,
        "ratios": tuple(float(x) for x in args.ratios.split(",")) if args.ratios else None,
        "path": args.path,
        "threads": args.threads,
        "tp1_threads": args.tp1_threads,
        "batches": args.batches,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "hf": True if args.hf else None,
        "peer": True if args.peer else None,
        "rank_alone": True if args.rank_alone else None,
        "links": tuple(args.link) if args.link else None,
        "hosts": args.hosts,
        "up_layouts": tuple(args.up_layouts.split(",")) if args.up_layouts else None,
        "down_layouts": tuple(args.down_layouts.split(",")) if args.down_layouts else None,
        "layouts": tuple(args.layouts.split(",")) if args.layouts else None,
        "rule": args.rule,
        "lockstep": True if args.lockstep else None,
    }
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    if args.no_overlap:
        cfg = replace(cfg, overlap=False)
    if args.no_weight_packing:
        cfg = replace(cfg, pack_weights=False)
    return cfg


def run(args: argparse.Namespace) -> int:
    if args.serve:
        return run_serve(args)
    from tqdm import tqdm

    from bench.link_report import link_markdown, link_plot
    from bench.report import markdown, plots
    from bench.runner import preset, run_bench

    cfg = _bench_config(args, preset(args.preset))
    bar = tqdm(desc="bench", unit="run", file=sys.stderr)

    def progress(message: str) -> None:
        bar.set_postfix_str(message)
        bar.update(1)

    planner = None
    if cfg.links:
        from bench.link_planner import CostModelPlanner  # the cost model lives in tune

        planner = CostModelPlanner()
    results = run_bench(cfg, progress, planner)
    bar.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    table = markdown(results) + link_markdown(results)
    (args.out / "results.md").write_text(table)
    written = [] if args.no_plots else plots(results, args.out)
    if not args.no_plots and (link_png := link_plot(results, args.out)):
        written.append(link_png)
    print(table)
    print(
        f"wrote {args.out / 'results.json'}, {args.out / 'results.md'}"
        + "".join(f", {p}" for p in written)
    )
    return 0
