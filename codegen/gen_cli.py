"""Arguments and entry of ``deinfer gen`` / ``deinfer-gen``."""

from __future__ import annotations

import argparse


def add_gen_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="?", help="path to a YAML spec")


def run_gen(args: argparse.Namespace) -> int:
    raise NotImplementedError("deinfer-gen arrives with the code generator")
