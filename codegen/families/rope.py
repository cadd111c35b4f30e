"""In-place RoPE at true positions: one kernel per head count a rank rotates."""

from __future__ import annotations

from codegen.families.context import GenContext
from codegen.render import KernelFile
from dsl.plan import MODES
from tune.store import next_pow2


def rope_file_name(heads: int, head_dim: int) -> str:
    return f"rope_h{heads}_d{head_dim}.py"


def rope_head_counts(ctx: GenContext) -> list[int]:
    """Heads per rank of q and of k in every mode (base rotates all heads)."""
    counts = set()
    for mode in MODES:
        for lp in ctx.layer_plans(mode):
            counts.update((lp.attention_heads_per_rank, lp.kv_heads_per_rank))
    return sorted(counts)


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
    positions = ctx.spec.model.positions
    if positions.kind != "rope":
        return []
    return [
        rope_kernel_file(h, ctx.spec.model.head_dim, positions.style) for h in rope_head_counts(ctx)
    ]
