"""``deinfer predict``: the cost model's per-block prediction for a spec on a device,
the choices it implies, ``--calibrate`` to measure this machine's profile, and
``--table5`` to set the model against the paper's published breakdown."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from dsl.errors import UserError
from dsl.plan import MODES, UP_SHARDED


def add_predict(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "predict", help="predict per-block compute and communication time (cost model)"
    )
    p.add_argument("spec", nargs="?", help="path to a YAML spec")
    p.add_argument("--device", default="a800-pcie", help="built-in profile name or a .yaml path")
    p.add_argument("--tp", type=int, default=None, help="TP degree (default: the spec's)")
    p.add_argument("--batch", type=int, default=None, help="tokens per forward (default 1..max)")
    p.add_argument("--context", type=int, default=None, help="positions attended (default 512)")
    p.add_argument(
        "--ratios",
        default=None,
        help="also compare modes with the spec re-decomposed at these compression ratios "
        "(rank = (1 - ratio) · smaller dimension), e.g. 0.2,0.4,0.6,0.8",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine (memory, GEMM, per-op overhead, link) into a profile",
    )
    p.add_argument("--threads", type=int, default=1, help="--calibrate: threads per rank")
    p.add_argument("--link", default=None, help="--calibrate across an emulated link")
    p.add_argument(
        "--out", type=Path, default=Path("cpu-here.yaml"), help="--calibrate: profile file"
    )
    p.add_argument(
        "--table5", action="store_true", help="the paper's Table 5, published vs predicted"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.calibrate:
        return _calibrate(args)
    if args.table5:
        return _table5()
    if not args.spec:
        raise UserError("predict needs a spec (or --calibrate / --table5)")
    return _predict(args)


def _calibrate(args: argparse.Namespace) -> int:
    from runtime.dist.emulated_link import LinkSpec
    from tune.calibrate import calibrate

    link = LinkSpec.parse(args.link) if args.link else None
    profile = calibrate(args.tp or 2, args.threads, link, name=args.out.stem)
    args.out.write_text(
        "# Measured by: deinfer predict --calibrate "
        f"--tp {args.tp or 2} --threads {args.threads}"
        + (f" --link {args.link}" if args.link else "")
        + f" --out {args.out}\n"
        + profile.to_yaml()
    )
    print(profile.to_yaml(), end="")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _table5() -> int:
    from dsl import load_spec
    from tune.table5 import TOLERANCE, reproduce, scan, table

    spec = Path(__file__).resolve().parents[1] / "specs" / "llama3-70b-r40.yaml"
    if not spec.is_file():
        raise UserError(f"{spec} not found: --table5 runs from a source checkout")
    spec = load_spec(spec)
    tokens, rows = reproduce(spec)
    print(table(tokens, rows))
    print(f"\nFitting on each figure in turn (others within ±{TOLERANCE:.0%}):\n")
    print("| fitted figure | tokens | others within |")
    print("| --- | ---: | ---: |")
    for fit, fit_tokens, count in scan(spec):
        print(f"| {' '.join(map(str, fit))} | {fit_tokens} | {count} of 19 |")
    return 0


def _predict(args: argparse.Namespace) -> int:
    from dsl import load_spec
    from tune.profiles import load_profile

    spec = load_spec(args.spec)
    dev = load_profile(args.device)
    context = args.context if args.context is not None else 512
    batches = [args.batch] if args.batch else [b for b in spec.runtime.cuda_graph_batch_sizes]
    out = _prediction(spec, args.tp, dev, batches, context)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(_prediction_text(out, spec.name, dev, batches))
    if args.ratios:
        print(_ratio_table(args, dev, batches[-1], context))
    return 0


def _prediction(spec, tp: int | None, dev, batches: list[int], context: int) -> dict:
    """Per mode (and deinfer's sharded up layout) and batch, the predicted block; per
    mode, the choices the model implies."""
    from dsl import build_plan
    from tune.cost_model import (
        Workload,
        kv_choice,
        overlap_from_rows,
        predict_block,
        predicted_faster_up_layout,
    )

    plan = build_plan(spec, tp=tp)
    out = {"spec": spec.name, "tp": plan.tp, "device": asdict(dev), "context": context, "rows": []}
    sharded = build_plan(spec, tp=tp, modes=("deinfer",), up_layout=UP_SHARDED).modes["deinfer"]
    layouts = {"deinfer up=sharded": sharded} if plan.tp > 1 else {}
    for mode, mp in [*((m, plan.modes[m]) for m in MODES), *layouts.items()]:
        for batch in batches:
            pred = predict_block(mp, dev, Workload(batch, context))
            out["rows"].append(
                {**asdict(pred), "mode": mode, "batch": batch, "compute_s": pred.compute_s}
            )
    work = Workload(batches[-1], context)
    out["choices"] = {
        m: {"overlap_from_rows": overlap_from_rows(plan.modes[m], dev, context)} for m in MODES
    }
    deinfer = plan.modes["deinfer"]
    out["choices"]["deinfer"]["kv_cache"] = [
        {"layers": list(layers), "cache": kind} for layers, kind in kv_choice(deinfer, dev, work)
    ]
    out["choices"]["deinfer"]["up_layout"] = {
        b: predicted_faster_up_layout(deinfer, sharded, dev, Workload(b, context)) for b in batches
    }
    return out


def _prediction_text(out: dict, name: str, dev, batches: list[int]) -> str:
    lines = [
        f"{name} at tp {out['tp']} on {dev.name} ({dev.description}); "
        f"context {out['context']}; ms per block per forward",
        "| mode | batch | gemm | attention | overhead | compute | comm | total | comm MB/rank |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in out["rows"]:
        lines.append(
            f"| {r['mode']} | {r['batch']} | {r['gemm_s'] * 1e3:.3f} | "
            f"{r['attention_s'] * 1e3:.3f} | {r['overhead_s'] * 1e3:.3f} | "
            f"{r['compute_s'] * 1e3:.3f} | {r['comm_s'] * 1e3:.3f} | "
            f"{(r['compute_s'] + r['comm_s']) * 1e3:.3f} | {r['comm_bytes_per_rank'] / 1e6:.2f} |"
        )
    choice = out["choices"]["deinfer"]
    start = choice["overlap_from_rows"]
    lines.append(
        "deinfer all-gather: "
        + (
            f"ring overlapped with the up GEMM from {start} rows, one all-gather below"
            if start
            else "one all-gather at every size (the ring never pays off)"
        )
    )
    kinds = ", ".join(
        f"layers {c['layers'][0]}-{c['layers'][-1]}: {c['cache']}" for c in choice["kv_cache"]
    )
    lines.append(f"deinfer KV cache at batch {batches[-1]}: {kinds}")
    ups = ", ".join(f"{b}: {layout}" for b, layout in choice["up_layout"].items())
    lines.append(
        f"deinfer o/down up factors (replicated: the paper; sharded: + all-gather), by batch: {ups}"
    )
    return "\n".join(lines)


def _ratio_table(args: argparse.Namespace, dev, batch: int, context: int) -> str:
    """DeInfer's block time against dense TP and Base at several compression ratios."""
    from dsl import build_plan, load_spec, with_ratio
    from tune.cost_model import Workload, predict_block

    base = load_spec(args.spec)
    lines = [
        f"\nper block at batch {batch}, context {context}: deinfer / dense and deinfer / base "
        "(below 1: deinfer faster)",
        "| ratio | deinfer ms | dense ms | base ms | deinfer / dense | deinfer / base |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for ratio in (float(x) for x in args.ratios.split(",") if x):
        spec = with_ratio(base, ratio, "smaller_dim_fraction", rank_multiple=2)
        plan = build_plan(spec, tp=args.tp)
        t = {
            m: predict_block(plan.modes[m], dev, Workload(batch, context)).total_s * 1e3
            for m in ("deinfer", "dense", "base")
        }
        lines.append(
            f"| {ratio:g} | {t['deinfer']:.3f} | {t['dense']:.3f} | {t['base']:.3f} | "
            f"{t['deinfer'] / t['dense']:.2f} | {t['deinfer'] / t['base']:.2f} |"
        )
    return "\n".join(lines)
