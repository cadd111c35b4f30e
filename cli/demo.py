"""``deinfer demo --out DIR``."""

from __future__ import annotations

import argparse
from pathlib import Path


def run_demo(args: argparse.Namespace) -> int:
    from compress.demo import make_demo

    spec, checkpoint = make_demo(args.out)
    print(f"spec {spec}, checkpoint {checkpoint}")
    return 0


def add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="write a random tiny decomposed Llama and its spec")
    p.add_argument("--out", required=True, type=Path, help="folder to write into")
    p.set_defaults(func=run_demo)
