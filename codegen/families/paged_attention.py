"""Paged decode attention: one file per (heads, kv heads) per rank that a mode needs."""

from __future__ import annotations

import math

from codegen.families.context import GenContext
from codegen.render import KernelFile
from dsl.plan import MODES
from tune.store import next_pow2


def file_name(heads: int, kv_heads: int, head_dim: int, block_size: int) -> str:
    return f"paged_attention_h{heads}_kv{kv_heads}_d{head_dim}_b{block_size}.py"


def head_layouts(ctx: GenContext) -> list[tuple[int, int]]:
    d = ctx.spec.model.head_dim
    layouts = set()
    for mode in MODES:
        for lp in ctx.layer_plans(mode):
            kv = lp.kv_dense_per_rank // (2 * d)
            layouts.add((lp.attention_heads_per_rank, kv))
    return sorted(layouts)


def kernel_file(heads: int, kv_heads: int, head_dim: int, block_size: int) -> KernelFile:
    kind = "MHA" if heads == kv_heads else ("MQA" if kv_heads == 1 else "GQA")
    values = {
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "head_dim_p2": next_pow2(head_dim),
        "block_size": block_size,
        "scale": 1.0 / math.sqrt(head_dim),
        "kind": kind,
    }
    return KernelFile(
        "paged_attention",
        file_name(heads, kv_heads, head_dim, block_size),
        "paged_attention.py.j2",
        values,
        {"shape_key": f"h{heads}_kv{kv_heads}_d{head_dim}_b{block_size}"},
    )


def generate(ctx: GenContext) -> list[KernelFile]:
    d, bs = ctx.spec.model.head_dim, ctx.spec.runtime.block_size
    return [kernel_file(h, kv, d, bs) for h, kv in head_layouts(ctx)]
