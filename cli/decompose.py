"""``deinfer decompose``: arguments and entry."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from compress.factorize import METHODS
from dsl import load_spec, parse_spec
from dsl.errors import SpecError, UserError
from dsl.ranks import RULES

# Ranks on a grid of 8: an 8-wide row is one 32-byte vector in fp32 (16 bytes in bf16),
# the N of a tensor-core tile, and --allocate then writes few distinct layer shapes (each
# costs tuning at start-up and an entry in the generated files). Measured on SmolLM2-135M
# (param_count 20 %, svd-llm, self:64 x 128, --allocate): see docs/COMPRESSION.md.
DEFAULT_RANK_MULTIPLE = 8


def add_decompose(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "decompose", help="decompose a dense transformers checkpoint (svd, asvd or svd-llm)"
    )
    p.add_argument("--model", required=True, type=Path, help="dense HF checkpoint folder")
    p.add_argument("--spec", type=Path, help="spec giving the ranks")
    p.add_argument("--out", type=Path, help="output folder of the decomposed checkpoint")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--spec-out", type=Path, help="write a spec for the model instead")
    p.add_argument("--ratio", type=float, help="with --spec-out: fraction removed, e.g. 0.4")
    p.add_argument("--rule", default="smaller_dim_fraction", choices=RULES)
    p.add_argument(
        "--rank-multiple",
        type=int,
        default=DEFAULT_RANK_MULTIPLE,
        help=f"ranks are multiples of this (default {DEFAULT_RANK_MULTIPLE}; 1: any rank)",
    )
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--name", default=None, help="with --spec-out: spec name")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace --out even if it holds files deinfer decompose did not write (never "
        "--model, nor a folder holding it or the current folder)",
    )
    _add_data_aware_options(p)
    p.set_defaults(func=run_decompose)


def _add_data_aware_options(p: argparse.ArgumentParser) -> None:
    """The method and what feeds it: calibration data, allocation, corrections."""
    p.add_argument(
        "--method",
        default="svd",
        choices=METHODS,
        help="svd: plain truncated SVD; asvd: activation-aware scaling; svd-llm: "
        "truncation-aware whitening (both need --calib)",
    )
    p.add_argument(
        "--calib",
        default=None,
        help="calibration data: a text or JSONL file, or self:N (N sequences sampled from "
        "the dense model, data-free)",
    )
    p.add_argument("--calib-len", type=int, default=128, help="tokens per calibration sequence")
    p.add_argument("--seed", type=int, default=0, help="seed of self:N sampling")
    p.add_argument("--alpha", type=float, default=0.5, help="asvd: scale = mean|x|^alpha")
    p.add_argument(
        "--allocate",
        type=Path,
        default=None,
        metavar="SPEC_OUT",
        help="spend the spec's parameter count where the spectra say it matters most; "
        "the allocated ranks are written as a spec to SPEC_OUT and used",
    )
    p.add_argument(
        "--sequential",
        action="store_true",
        help="calibrate each layer on the inputs the compressed layers below it produce "
        "(needs --calib)",
    )
    p.add_argument(
        "--refit",
        action="store_true",
        help="refit each up factor by least squares to the dense outputs on the calibration "
        "tokens (needs --calib)",
    )
    p.add_argument(
        "--fisher",
        action="store_true",
        help="weight each output channel's error by its Fisher information (one backward "
        "pass of the dense model over the calibration tokens; needs --calib)",
    )


def run_decompose(args: argparse.Namespace) -> int:
    from compress.decompose import read_hf_config, spec_yaml

    if getattr(args, "spec_out", None):
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
    from compress.decompose import TOOL
    from compress.output import check_output_folder

    spec = load_spec(args.spec)
    check_output_folder(args.out, TOOL, (args.model,), args.force)  # before calibrating
    out = decompose_with_options(args, spec, args.spec.read_text())
    print(f"wrote {out} ({spec.model.num_layers} layers, spec {spec.name})")
    return 0


def decompose_with_options(args: argparse.Namespace, spec, spec_text: str) -> Path:
    from compress.calibration import CalibrationSource
    from compress.decompose import decompose
    from compress.pipeline import Calibrated, Calibration, allocate, allocated_spec, dense_count

    method = getattr(args, "method", "svd")
    calib = getattr(args, "calib", None)
    if calib and args.calib_len < 2:
        raise UserError(f"--calib-len must be at least 2, found {args.calib_len}")
    calibration = (
        Calibration(CalibrationSource.parse(calib), args.calib_len, args.seed) if calib else None
    )
    progress = not args.quiet
    calibrated = Calibrated(args.model, calibration, progress=progress)
    alpha = getattr(args, "alpha", 0.5)
    fisher = getattr(args, "fisher", False)
    if getattr(args, "allocate", None):
        from compress.decompose import check_matches, read_hf_config

        check_matches(spec, read_hf_config(args.model))
        allocation = allocate(calibrated, spec, method, alpha, args.rank_multiple, fisher)
        name = args.allocate.stem
        spec, text = allocated_spec(spec, spec_text, allocation, name, method)
        args.allocate.write_text(text)
        print(
            f"wrote {args.allocate}: ranks for {allocation.used:,} of {allocation.budget:,} "
            f"parameters ({dense_count(allocation)} matrices kept dense)"
        )
    sequential = getattr(args, "sequential", False)
    if sequential:
        # the one-shot statistics (the allocation's) and their Cholesky factors are not
        # used again: ~1.6 GB on SmolLM2-135M, which kept the peak at 3.7 GiB
        calibrated.stats = None
    refit = getattr(args, "refit", False)
    how = calibrated.factorization(spec, method, alpha, sequential, refit, fisher)
    out = decompose(
        args.model,
        spec,
        args.out,
        dtype=args.dtype,
        progress=progress,
        how=how,
        record=calibrated.record,
        force=getattr(args, "force", False),
    )
    stats = how.stats
    if stats and method == "svd-llm":
        from compress.decompose import whitening_shifts

        shifts = whitening_shifts(stats)
        for where, shift in shifts.items():
            layer, name = where.split(".")
            print(
                f"layer {layer} {name}-projection input: Gram matrix not positive definite, "
                f"diagonal shift {shift:.3g} added",
                file=sys.stderr,
            )
    return out
