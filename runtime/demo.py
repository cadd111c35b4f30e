"""``deinfer demo --out DIR``: a random tiny Llama (transformers), decomposed with
``deinfer decompose``, and its spec — an offline checkpoint for trying the runtime."""

from __future__ import annotations

import argparse
from pathlib import Path

DEMO_CONFIG = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "initializer_range": 0.1,
}


def make_demo(out: Path, seed: int = 0) -> tuple[Path, Path]:
    import torch
    import transformers

    from runtime.cli_decompose import run_decompose

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**DEMO_CONFIG))
    model.save_pretrained(out / "dense")
    spec = out / "tiny-demo.yaml"
    common = {
        "model": out / "dense",
        "dtype": "float32",
        "rule": "smaller_dim_fraction",
        "rank_multiple": 1,
        "quiet": True,
        "name": "tiny-demo",
    }
    run_decompose(argparse.Namespace(**common, spec=None, out=None, spec_out=spec, ratio=0.4, tp=2))
    run_decompose(
        argparse.Namespace(
            **common, spec=spec, out=out / "lowrank", spec_out=None, ratio=None, tp=2
        )
    )
    return spec, out / "lowrank"


def add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="write a random tiny decomposed Llama and its spec")
    p.add_argument("--out", required=True, type=Path)
    p.set_defaults(
        func=lambda args: print("spec {}, checkpoint {}".format(*make_demo(args.out))) or 0
    )
