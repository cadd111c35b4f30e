"""The registry of a generated folder: which kernel file serves which shape, and the
layer -> layer-shape map. The layer dataflow itself is hand-written in
``runtime.model.layers`` (it does not depend on the spec); this file binds it to kernels."""

from __future__ import annotations

from codegen.families import down_proj, gemm_fixed, kv_copy, latent_up, paged_attention, rope
from codegen.families.context import GenContext
from codegen.render import KernelFile


def _module(file_name: str) -> str:
    return file_name.removesuffix(".py")


def generate(ctx: GenContext) -> list[KernelFile]:
    spec = ctx.spec
    concat_kernels = any(lp.concats for lp in ctx.layer_plans("deinfer"))
    d, bs = spec.model.head_dim, spec.runtime.block_size
    values = {
        "concat_kernels": concat_kernels,
        "down_module": _module(down_proj.FILE_NAME),
        "up_module": _module(latent_up.FILE_NAME),
        "gemms": list(gemm_fixed.gemm_shapes(ctx)),
        "gemm_module": _module(gemm_fixed.FILE_NAME),
        "ropes": [(h, _module(rope.rope_file_name(h, d))) for h in rope.rope_head_counts(ctx)]
        if spec.model.positions.kind == "rope"
        else [],
        "attentions": [
            (h, kv, _module(paged_attention.file_name(h, kv, d, bs)))
            for h, kv in paged_attention.head_layouts(ctx)
        ],
        "kv_copies": bool(kv_copy.latent_widths(ctx)),
        "kv_copy_module": _module(kv_copy.FILE_NAME),
    }
    return [KernelFile("registry", "kernels.py", "kernels.py.j2", values)]
