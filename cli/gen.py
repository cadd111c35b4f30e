"""Arguments and entry of ``deinfer gen`` / ``deinfer-gen``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from codegen.folder import check_owned
from codegen.generate import generate, stale_files, summary_line, write_atomically
from dsl import load_spec
from dsl.errors import SpecError


def add_gen_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "spec", nargs="?", help="path to a YAML spec (with --check: default all of --specs-dir)"
    )
    p.add_argument("--out", default=None, help="output folder (default: <out-root>/<spec name>)")
    p.add_argument("--out-root", default="generated", help="root of generated folders")
    p.add_argument("--specs-dir", default="specs", help="where --check finds specs")
    p.add_argument(
        "--device-name",
        default=None,
        help="GPU name for tuned configs (default: the local GPU, if any)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace a generated folder that another spec file (of the same name) wrote",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 listing generated files that are not current",
    )


def _local_device_name() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def _target(spec_path: Path, args: argparse.Namespace, check: bool = False):
    spec = load_spec(spec_path)
    out = Path(args.out) if args.out else Path(args.out_root) / spec.name
    device = args.device_name
    if check and device is None:
        device = _manifest_device(out)  # check against what the folder was made for
    gen = generate(spec, device=device, spec_file=spec_path.name)
    return gen, out


def _manifest_device(out: Path) -> str | None:
    try:
        return json.loads((out / "manifest.json").read_text()).get("device")
    except (OSError, ValueError, AttributeError):
        return None


def run_gen(args: argparse.Namespace) -> int:
    if args.check:
        return _check(args)
    if args.device_name is None:
        args.device_name = _local_device_name()
    if not args.spec:
        raise SpecError("", "give a spec file (or --check)")
    start = time.perf_counter()
    path = Path(args.spec)
    gen, out = _target(path, args)
    check_owned(out, path.name, force=args.force)
    write_atomically(gen.files, out)
    print(summary_line(gen, out))
    print(f"  done in {time.perf_counter() - start:.1f} s")
    return 0


def _check(args: argparse.Namespace) -> int:
    paths = [Path(args.spec)] if args.spec else sorted(Path(args.specs_dir).glob("*.yaml"))
    stale: list[str] = []
    names = set()
    for path in paths:
        gen, out = _target(path, args, check=True)
        names.add(out.name)
        stale += stale_files(gen.files, out)
    root = Path(args.out_root)
    if not args.spec and not args.out and root.is_dir():
        stale += [
            str(p)
            for p in sorted(root.iterdir())
            # hidden ".name.new-PID-*" siblings belong to a write in progress (or a killed
            # one, removed by the next write), not to the generated code
            if p.is_dir() and p.name not in names and not p.name.startswith(".")
        ]
    if stale:
        print("generated code is not current (run deinfer-gen on its spec):", file=sys.stderr)
        for item in stale:
            print(f"  {item}", file=sys.stderr)
        return 1
    print(f"deinfer-gen --check: {len(paths)} spec(s) current")
    return 0
