"""Latent-cache block copy (per latent width) and in-place RoPE (per head layout)."""

from __future__ import annotations

from codegen.families.context import GenContext
from codegen.render import KernelFile
from dsl.plan import MODES
from tune.store import next_pow2


def copy_file_name(width: int, block_size: int) -> str:
    return f"kv_copy_w{width}_b{block_size}.py"


def rope_file_name(heads: int, head_dim: int) -> str:
    return f"rope_h{heads}_d{head_dim}.py"


def latent_widths(ctx: GenContext) -> list[int]:
    return sorted(
        {
            lp.kv_latent_per_rank
            for lp in ctx.layer_plans("deinfer")
            if lp.kv_latent_per_rank is not None
        }
    )


def rope_head_counts(ctx: GenContext) -> list[int]:
    """Heads per rank of q and of k in every mode (base rotates all heads)."""
    d = ctx.spec.model.head_dim
    counts = set()
    for mode in MODES:
        for lp in ctx.layer_plans(mode):
            counts.add(lp.attention_heads_per_rank)
            counts.add(lp.kv_dense_per_rank // (2 * d))
    return sorted(counts)


def copy_kernel_file(width: int, block_size: int) -> KernelFile:
    values = {"block_size": block_size, "width": width, "width_p2": next_pow2(width)}
    return KernelFile(
        "kv_copy",
        copy_file_name(width, block_size),
        "kv_copy.py.j2",
        values,
        {"shape_key": f"w{width}_b{block_size}"},
    )


def rope_kernel_file(heads: int, head_dim: int, style: str) -> KernelFile:
    values = {
        "heads": heads,
        "head_dim": head_dim,
        "half_p2": next_pow2(head_dim // 2),
        "style": style,
        "neox": int(style == "neox"),
        "block_rows": 16,
    }
    return KernelFile(
        "rope",
        rope_file_name(heads, head_dim),
        "rope.py.j2",
        values,
        {"shape_key": f"h{heads}_d{head_dim}_{style}"},
    )


def generate(ctx: GenContext) -> list[KernelFile]:
    block_size = ctx.spec.runtime.block_size
    files = [copy_kernel_file(w, block_size) for w in latent_widths(ctx)]
    positions = ctx.spec.model.positions
    if positions.kind == "rope":
        files += [
            rope_kernel_file(h, ctx.spec.model.head_dim, positions.style)
            for h in rope_head_counts(ctx)
        ]
    return files
