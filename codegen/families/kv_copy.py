"""Latent-cache block copy: one kernel per latent width (per token, ``[z_k | z_v]``)."""

from __future__ import annotations

from codegen.families.context import GenContext
from codegen.render import KernelFile
from tune.store import next_pow2


def copy_file_name(width: int, block_size: int) -> str:
    return f"kv_copy_w{width}_b{block_size}.py"


def latent_widths(ctx: GenContext) -> list[int]:
    """Every width a latent cache can have (a kernel each), whatever kv_cache asks."""
    return ctx.plan.modes["deinfer"].latent_widths("latent")


def copy_kernel_file(width: int, block_size: int) -> KernelFile:
    values = {"block_size": block_size, "width": width, "width_p2": next_pow2(width)}
    return KernelFile(
        "kv_copy",
        copy_file_name(width, block_size),
        "kv_copy.py.j2",
        values,
        {"shape_key": f"w{width}_b{block_size}"},
    )


def generate(ctx: GenContext) -> list[KernelFile]:
    block_size = ctx.spec.runtime.block_size
    return [copy_kernel_file(w, block_size) for w in latent_widths(ctx)]
