"""Fixed-size GEMMs: one file per distinct (K, N) that any mode multiplies by, plus the
latent-cache reconstruction GEMMs."""

from __future__ import annotations

from codegen.families.context import GenContext
from codegen.render import KernelFile
from dsl.plan import MODES
from tune.store import ConfigChoice


def file_name(k: int, n: int) -> str:
    return f"gemm_k{k}_n{n}.py"


def gemm_shapes(ctx: GenContext) -> dict[tuple[int, int], list[str]]:
    """(K, N) -> uses, e.g. 'deinfer s0 o.v'. Concat down-projections and the latent
    up-projection have their own kernels; biases are not GEMMs."""
    uses: dict[tuple[int, int], list[str]] = {}
    for mode in MODES:
        for lp in ctx.layer_plans(mode):
            sid = ctx.shape_id(lp.shape)
            # In deinfer mode the up factors of a concat group run in the latent_up kernel.
            latent_up = (
                {n for c in lp.concats for n, _ in c.members} if mode == "deinfer" else set()
            )
            for f in lp.factors:
                if f.factor == "bias" or (f.factor == "up" and f.matrix in latent_up):
                    continue
                k, n = f.local_shape(0)
                uses.setdefault((k, n), []).append(f"{mode} {sid} {f.tensor}")
            if mode == "deinfer" and lp.kv_latent_per_rank is not None:
                for name in ("k", "v"):  # reconstruction of the latent cache
                    k, n = lp.factor(f"{name}.u").local_shape(0)
                    uses.setdefault((k, n), []).append(f"deinfer {sid} {name}.u reconstruct")
    return dict(sorted(uses.items()))


def kernel_file(k: int, n: int, uses: list[str], choice: ConfigChoice) -> KernelFile:
    values = {
        "k": k,
        "n": n,
        "used_by": ", ".join(sorted(set(uses))),
        "configs": choice.configs,
        "meta_source": choice.source,
    }
    return KernelFile(
        "gemm_fixed",
        file_name(k, n),
        "gemm_fixed.py.j2",
        values,
        {"shape_key": f"k{k}_n{n}", "configs": choice.configs, "meta_source": choice.source},
    )


def generate(ctx: GenContext) -> list[KernelFile]:
    return [
        kernel_file(k, n, uses, ctx.meta("gemm_fixed", f"k{k}_n{n}", n, k))
        for (k, n), uses in gemm_shapes(ctx).items()
    ]
