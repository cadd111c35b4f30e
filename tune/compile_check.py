"""Compile every kernel of a generated folder for a GPU target, without a GPU.

Triton lowers to PTX and ptxas assembles a cubin on the CPU, so this proves that the
generated kernels are valid compiled Triton (not only interpreter-valid) for, e.g.,
sm_90 (H100/H200) in bf16. Run in a process without TRITON_INTERPRET:

    python -m tune.compile_check generated/llama3-70b-r40 --arch 90 --dtype bf16
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

INDEX_POINTERS = (
    "n_valid_ptr",
    "num_runs_ptr",
    "copy_list_ptr",
    "table_ptr",
    "lens_ptr",
    "pos_ptr",
    "counter_ptr",
)
FP32_POINTERS = ("inv_freq_ptr", "acc_ptr", "acc0_ptr", "acc1_ptr", "acc2_ptr")


def signature(fn, dtype: str, constexprs: dict) -> dict[str, str]:
    """Types from the naming convention of our kernels: ``*_ptr`` pointers (index
    pointers int32, accumulators and frequencies fp32, data ``dtype``), other
    arguments int32 scalars, ``constexprs`` as given."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in INDEX_POINTERS:
            sig[name] = "*i32"
        elif name in FP32_POINTERS:
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = f"*{dtype}"
        else:
            sig[name] = "i32"
    return sig


def _specialisations(module) -> list[tuple[object, dict]]:
    """(jit function, constexpr values) for every specialisation the runtime launches,
    without the meta-parameters."""
    name = module.__name__.rsplit(".", 1)[-1]
    if name == "down_proj":  # the sides are launch arguments: one variant for all shapes
        layer = module.NORM_KIND.value == 2
        return [(module._down_proj_kernel, {"HAS_NORM_WEIGHT": True, "HAS_NORM_BIAS": layer})]
    if name == "latent_up":  # segments are launch arguments too
        return [(module._latent_up_chunk_kernel, {})]
    if name.startswith("gemm_"):
        return [
            (module._gemm_fixed_kernel, {"COUNT_WORK": False, "K": k, "N": n})
            for k, n in module.CONFIGS
        ]
    if name == "kv_copy":  # a variant per power of two of the widths
        widths = {1 << (w - 1).bit_length() for w in module.WIDTHS}
        return [(module._kv_block_copy_kernel, {"WIDTH_P2": p2}) for p2 in sorted(widths)]
    if name.startswith("rope_"):
        return [(module._rope_kernel, {})]
    if name.startswith("paged_attention_"):
        return [(module._paged_decode_kernel, {})]
    return []


def variants(module) -> list[tuple[object, dict, dict]]:
    """(jit function, constexprs, compile options) for every specialisation and every
    distinct meta-parameter config the module may launch."""
    configs = getattr(module, "CONFIGS", None) or {}
    if module.__name__.rsplit(".", 1)[-1].startswith("gemm_"):  # (K, N) -> bucket -> meta
        configs = {(shape, b): cfg for shape, table in configs.items() for b, cfg in table.items()}
    for key, shape in getattr(module, "SHAPES", {}).items():  # (group, shape) -> bucket -> meta
        configs.update({(key, b): cfg for b, cfg in shape.configs.items()})
    metas = []
    for cfg in configs.values():
        if cfg not in metas:
            metas.append(cfg)
    out = []
    for fn, constexprs in _specialisations(module):
        if not metas:
            out.append((fn, constexprs, {"num_warps": 4}))
        for cfg in metas:
            blocks = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
            out.append(
                (
                    fn,
                    {**constexprs, **blocks},
                    {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]},
                )
            )
    return out


def compile_folder(folder: Path, arch: int, dtype: str) -> list[str]:
    """Compile every kernel variant; returns one line per kernel."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter does not compile")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from runtime.kernels.loader import load_generated

    registry = load_generated(folder)
    package = registry.__name__.rsplit(".", 1)[0]
    target = GPUTarget("cuda", arch, 32)
    lines = []
    for path in sorted(folder.glob("*.py")):
        if path.stem in ("__init__", "kernels"):
            continue
        module = sys.modules[f"{package}.{path.stem}"]
        for fn, constexprs, options in variants(module):
            start = time.perf_counter()
            sig = signature(fn, dtype, constexprs)
            src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
            compiled = triton.compile(src, target=target, options=options)
            regs = compiled.metadata.shared if hasattr(compiled.metadata, "shared") else 0
            lines.append(
                f"{path.stem}: sm_{arch} {dtype} ok, {len(compiled.asm['cubin'])} B cubin, "
                f"{regs} B shared, {time.perf_counter() - start:.1f} s"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    args = p.parse_args(argv)
    for line in compile_folder(args.folder, args.arch, args.dtype):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
