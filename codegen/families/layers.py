"""The registry of a generated folder: which kernel file serves which shape, and the
layer -> layer-shape map. The layer dataflow itself is hand-written in
``runtime.layers`` (it does not depend on the spec); this file binds it to kernels."""

from __future__ import annotations

from codegen.families import down_proj, gemm_fixed, kv_cache, latent_up, paged_attention
from codegen.families.context import GenContext
from codegen.render import KernelFile


def _module(file_name: str) -> str:
    return file_name.removesuffix(".py")


def generate(ctx: GenContext) -> list[KernelFile]:
    spec = ctx.spec
    concat_kernels = []
    for lp in ctx.layer_plans("deinfer"):
        sid = ctx.shape_id(lp.shape)
        for cat in lp.concats:
            concat_kernels.append(
                (
                    cat.name,
                    sid,
                    _module(down_proj.file_name(sid, cat.name)),
                    _module(latent_up.file_name(sid, cat.name)),
                )
            )
    d, bs = spec.model.head_dim, spec.runtime.block_size
    values = {
        "concat_kernels": concat_kernels,
        "gemms": [
            (k, n, _module(gemm_fixed.file_name(k, n))) for k, n in gemm_fixed.gemm_shapes(ctx)
        ],
        "ropes": [
            (h, _module(kv_cache.rope_file_name(h, d))) for h in kv_cache.rope_head_counts(ctx)
        ]
        if spec.model.positions.kind == "rope"
        else [],
        "attentions": [
            (h, kv, _module(paged_attention.file_name(h, kv, d, bs)))
            for h, kv in paged_attention.head_layouts(ctx)
        ],
        "kv_copies": [
            (w, _module(kv_cache.copy_file_name(w, bs))) for w in kv_cache.latent_widths(ctx)
        ],
        "layer_shapes": [ctx.shape_id(layer) for layer in spec.decomposition.layers],
        "tp": ctx.tp,
    }
    return [KernelFile("registry", "kernels.py", "kernels.py.j2", values)]
