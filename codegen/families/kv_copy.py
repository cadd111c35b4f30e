"""Latent-cache block copy: one file, one entry per latent width (per token, ``[z_k | z_v]``)."""

from __future__ import annotations

from codegen.families.context import GenContext
from codegen.render import KernelFile

FILE_NAME = "kv_copy.py"


def latent_widths(ctx: GenContext) -> list[int]:
    """Every width a latent cache can have, whatever kv_cache asks."""
    return ctx.plan.modes["deinfer"].latent_widths("latent")


def copy_kernel_file(widths: list[int], block_size: int) -> KernelFile:
    values = {"block_size": block_size, "widths": sorted(set(widths))}
    manifest = [{"shape_key": f"w{w}_b{block_size}"} for w in values["widths"]]
    return KernelFile("kv_copy", FILE_NAME, "kv_copy.py.j2", values, manifest)


def generate(ctx: GenContext) -> list[KernelFile]:
    widths = latent_widths(ctx)
    return [copy_kernel_file(widths, ctx.spec.runtime.block_size)] if widths else []
