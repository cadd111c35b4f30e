"""``deinfer plan``: a spec's sharding, communication, FLOPs and memory per mode, and
deinfer's per-matrix layout — each matrix merged or latent, with the predicted layer
time of each alternative and the predicted block step against the paper's layout, Base
and the dense model, for one device profile, link and decode batch."""

from __future__ import annotations

import argparse
import json
from typing import Any

from dsl import MODES, Plan, build_plan, load_spec, with_tp
from dsl.layout import LAYOUTS, OPTIMIZED, with_merged
from dsl.plan import DOWN_LAYOUTS, DOWN_SHARDED
from dsl.report import layer_ranges, plan_json, plan_table, shards_table
from runtime.dist.emulated_link import LinkSpec
from runtime.engine.config import layout_profile
from tune.cost_model import Workload, predict_block
from tune.layout import ShapeChoice, choose_layout, merges_of

PAPER_COLUMN = "deinfer-paper"  # the paper's layout beside the optimized deinfer column


def add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="sharding, communication, FLOPs and memory plan of a spec")
    p.add_argument("spec", help="path to a YAML spec")
    p.add_argument("--tp", type=int, default=None, help="TP degree (default: the spec's)")
    p.add_argument("--mode", choices=MODES, default=None, help="only this mode")
    p.add_argument("--json", action="store_true", help="print one JSON object (shards included)")
    p.add_argument(
        "--shards", action="store_true", help="also list every factor's slice on every rank"
    )
    p.add_argument(
        "--layout",
        choices=LAYOUTS,
        default=OPTIMIZED,
        help="deinfer's matrices: each merged or latent as predicted faster (optimized), "
        "or all latent (paper)",
    )
    p.add_argument(
        "--device",
        default=None,
        help="device profile the layout is chosen for (a name in tune/profiles or a .yaml "
        "path; default: cpu-here, or a800-nvlink on a GPU)",
    )
    p.add_argument(
        "--link", default=None, help="link between the ranks, RATE[,LATENCY] (e.g. 10gbit,5us)"
    )
    p.add_argument(
        "--down-layout",
        choices=DOWN_LAYOUTS,
        default=DOWN_SHARDED,
        help="deinfer's column groups' down factors: split, the latent all-gathered (the "
        "paper; default), or whole on every rank (no all-gather: what the engine holds "
        "where CPU ranks talk over gloo)",
    )
    p.add_argument("--batch", type=int, default=16, help="decode rows (default 16)")
    p.add_argument("--context", type=int, default=1024, help="tokens attended (default 1024)")
    p.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    spec = spec if args.tp is None else with_tp(spec, args.tp)
    modes = (args.mode,) if args.mode else MODES
    plan = build_plan(spec, modes=modes, down_layout=args.down_layout)
    choices: tuple[ShapeChoice, ...] = ()
    if "deinfer" in modes and args.layout == OPTIMIZED:
        dev = layout_profile(args.device, LinkSpec.parse(args.link) if args.link else None)
        work = Workload(args.batch, args.context)
        choices = choose_layout(spec, dev, work, down_layout=args.down_layout)
        executed = with_merged(spec, merges_of(choices))
        down = args.down_layout
        optimized = build_plan(executed, modes=("deinfer",), down_layout=down).modes["deinfer"]
        paper = build_plan(spec, modes=("deinfer",)).modes["deinfer"]  # its dataflow
        by_mode = {**plan.modes, "deinfer": optimized, PAPER_COLUMN: paper}
        plan = Plan(spec=spec, tp=plan.tp, modes=by_mode)
        steps = {name: predict_block(mp, dev, work).total_s for name, mp in by_mode.items()}
    if args.json:
        data = plan_json(plan)
        if choices:
            data["layout"] = _layout_json(choices, steps, dev.name, work)
            data["layout"]["down_layout"] = args.down_layout
        print(json.dumps(data, indent=2))
        return 0
    print(plan_table(plan))
    if choices:
        print(_layout_table(choices, steps, dev.name, work, args.down_layout))
    if args.shards:
        print(shards_table(plan))
    return 0


def _layout_json(choices, steps: dict[str, float], device: str, work: Workload) -> dict[str, Any]:
    return {
        "device": device,
        "batch": work.tokens,
        "context": work.context,
        "predicted_block_step_s": steps,
        "shapes": [
            {
                "layers": list(c.layers),
                "ranks": c.shape.as_dict(),
                "merged": sorted(c.merged),
                "predicted_layer_s": {
                    "chosen": c.seconds,
                    "paper": c.paper_s,
                    "dense": c.dense_s,
                },
                "matrices": {
                    m.name: {"merged": m.merged, "latent_s": m.latent_s, "merged_s": m.merged_s}
                    for m in c.matrices
                },
            }
            for c in choices
        ],
    }


def _layout_table(choices, steps: dict[str, float], device: str, work: Workload, down: str) -> str:
    lines = [
        f"deinfer layout (optimized) on {device}, down factors {down}, decode batch {work.tokens}, "
        f"context {work.context}: predicted layer time with each matrix latent / merged"
    ]
    for c in choices[:8]:
        cells = "  ".join(
            f"{m.name}:{'M' if m.merged else 'L'} {m.latent_s * 1e3:.3g}/{m.merged_s * 1e3:.3g}"
            for m in c.matrices
        )
        lines.append(f"  layers {layer_ranges(c.layers)}: {cells} ms")
    if len(choices) > 8:
        lines.append(f"  ... {len(choices) - 8} more layer shapes (--json lists them all)")
    dense = steps.get("dense")
    parts = []
    for name, s in steps.items():
        ratio = f" ({dense / s:.2f}x dense)" if dense and name != "dense" else ""
        parts.append(f"{name} {s * 1e3:.4g} ms{ratio}")
    lines.append("predicted block step: " + ", ".join(parts))
    return "\n".join(lines)
