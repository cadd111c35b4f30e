"""``deinfer decompose``: arguments and entry."""

from __future__ import annotations

import argparse
from pathlib import Path

from dsl import load_spec, parse_spec
from dsl.errors import SpecError
from dsl.ranks import RULES


def add_decompose(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("decompose", help="truncated SVD of a dense transformers checkpoint")
    p.add_argument("--model", required=True, type=Path, help="dense HF checkpoint folder")
    p.add_argument("--spec", type=Path, help="spec giving the ranks")
    p.add_argument("--out", type=Path, help="output folder of the decomposed checkpoint")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--spec-out", type=Path, help="write a spec for the model instead")
    p.add_argument("--ratio", type=float, help="with --spec-out: fraction removed, e.g. 0.4")
    p.add_argument("--rule", default="smaller_dim_fraction", choices=RULES)
    p.add_argument("--rank-multiple", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--name", default=None, help="with --spec-out: spec name")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run_decompose)


def run_decompose(args: argparse.Namespace) -> int:
    from runtime.decompose import decompose, read_hf_config, spec_yaml

    if args.spec_out:
        if args.ratio is None:
            raise SpecError("--ratio", "required with --spec-out")
        config = read_hf_config(args.model)
        name = args.name or args.spec_out.stem
        text = spec_yaml(config, name, args.ratio, args.rule, args.rank_multiple, args.tp)
        parse_spec(text, default_name=name)  # what we write must be a valid spec
        args.spec_out.write_text(text)
        print(f"wrote {args.spec_out}")
        if not args.spec:
            return 0
    if not (args.spec and args.out):
        raise SpecError("--spec", "give --spec and --out (or --spec-out with --ratio)")
    spec = load_spec(args.spec)
    out = decompose(args.model, spec, args.out, dtype=args.dtype, progress=not args.quiet)
    print(f"wrote {out} ({spec.model.num_layers} layers, spec {spec.name})")
    return 0
