"""The GPU-only checks, as one script for a lent GPU (one call of the device tool):

1. every generated kernel of two specs, compiled (not interpreted), against its torch
   reference in bf16 and fp16;
2. CUDA-graph capture and replay against eager decode in bf16 (the same greedy tokens),
   and the decode-step speed-up from graphs;
3. tuning of the llama3-70b-r40 tp-8 per-rank kernels within a budget, tuned vs default
   vs torch.matmul (cuBLAS) on the same shapes.

    python -m tune.gpu_check --out "$OUT" --tune-budget-s 240

Results go to OUT/gpu_check.json (and the tuned configs to tune/configs/ and OUT).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from dsl import load_spec

BF16_TOL = 3e-2  # relative to the output scale; 8-bit mantissa inputs, fp32 accumulation


def _close(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, float]:
    scale = max(1.0, want.float().abs().max().item())
    err = (got.float() - want.float()).abs().max().item() / scale
    return err <= BF16_TOL, err


def kernel_checks(spec_paths: list[Path], dtype: torch.dtype, dev: str = "cuda") -> list[dict]:
    from codegen.generate import generate, write_atomically
    from runtime.kernels.loader import load_generated

    out = []
    for spec_path in spec_paths:
        with tempfile.TemporaryDirectory() as tmp:
            gen = generate(load_spec(spec_path))
            folder = Path(tmp) / gen.spec.name
            write_atomically(gen.files, folder)
            registry = load_generated(folder).KERNELS
            for key, mod in registry.gemm.items():
                k, n = key
                for rows in (1, 7, 64):
                    a = torch.randn(rows, k, device=dev, dtype=dtype) / math.sqrt(k)
                    b = torch.randn(k, n, device=dev, dtype=dtype)
                    nv = torch.tensor([rows], device=dev, dtype=torch.int32)
                    got = mod.gemm_fixed(a, b, torch.empty(rows, n, device=dev, dtype=dtype), nv)
                    want = mod.torch_reference(
                        a, b, torch.empty(rows, n, device=dev, dtype=torch.float32), nv
                    )
                    ok, err = _close(got, want)
                    out.append(
                        {
                            "spec": gen.spec.name,
                            "kernel": f"gemm {key}",
                            "rows": rows,
                            "ok": ok,
                            "err": err,
                        }
                    )
            for key, mod in registry.down_proj.items():
                k, w = mod.in_features, mod.width
                x = torch.randn(16, k, device=dev, dtype=dtype)
                weight = torch.randn(k, w, device=dev, dtype=dtype) / math.sqrt(k)
                nw = torch.ones(k, device=dev, dtype=dtype)
                got = mod.down_proj(x, weight, torch.empty(16, w, device=dev, dtype=dtype), nw)
                want = mod.torch_reference(x, weight, torch.empty(16, w, device=dev), nw)
                ok, err = _close(got, want)
                out.append(
                    {"spec": gen.spec.name, "kernel": f"down_proj {key}", "ok": ok, "err": err}
                )
            for key, mod in registry.latent_up.items():
                widths = mod.out_widths[: len(mod.ranks)]
                ups = tuple(
                    torch.randn(r, n, device=dev, dtype=dtype) / math.sqrt(r)
                    for r, n in zip(mod.ranks, widths, strict=True)
                )
                chunk = mod.chunk
                accs = tuple(torch.zeros(8, n, device=dev) for n in widths)
                refs = tuple(torch.zeros(8, n, device=dev) for n in widths)
                for j in range(len(mod.segments)):
                    piece = torch.randn(8, chunk, device=dev, dtype=dtype)
                    mod.latent_up_chunk(piece, j, ups, accs)
                    mod.torch_reference(piece, j, ups, refs)
                ok = all(_close(a, r)[0] for a, r in zip(accs, refs, strict=True))
                out.append({"spec": gen.spec.name, "kernel": f"latent_up {key}", "ok": ok})
    return out


def graph_checks(tmp: Path) -> dict:
    """Greedy tokens with and without CUDA graphs (bf16), and decode-step timing."""
    from compress.demo import make_demo
    from dsl import load_spec, with_runtime, with_tp
    from runtime.engine.llm import LLM
    from runtime.engine.sequence import SamplingParams

    spec_path, ckpt = make_demo(tmp)
    bf16 = with_runtime(
        with_tp(load_spec(spec_path), 1),
        dtype="bfloat16",
        max_batch_size=16,
        max_seq_len=128,
        cuda_graph_batch_sizes=[1, 2, 4, 8, 16],
    )
    prompts = [[i + 1, i + 2, i + 3] for i in range(8)]
    params = SamplingParams(max_tokens=32)
    result = {}
    for kv in ("dense", "latent"):
        tokens, times = {}, {}
        for graphs in (False, True):
            with LLM(bf16, ckpt, kv_cache=kv, backend="triton", cuda_graphs=graphs) as llm:
                llm.generate(prompts, SamplingParams(max_tokens=4))  # warm-up
                torch.cuda.synchronize()
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                torch.cuda.synchronize()
                times[graphs] = time.perf_counter() - start
                tokens[graphs] = [o.token_ids for o in outs]
        result[kv] = {
            "same_tokens": tokens[True] == tokens[False],
            "eager_s": times[False],
            "graph_s": times[True],
            "speedup": times[False] / times[True],
        }
    return result


def tune_checks(budget_s: float, out: Path) -> dict:
    from codegen.generate import generate, write_atomically
    from runtime.kernels.loader import load_generated
    from tune.gpu_timer import cublas_ms, cuda_graph_timer
    from tune.store import CONFIG_ROOT, normalise_device_name
    from tune.tuner import jobs_from_manifest, tune

    device = torch.cuda.get_device_name(0)
    spec = Path("specs/llama3-70b-r40.yaml")
    buckets = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    timer = cuda_graph_timer()
    with tempfile.TemporaryDirectory() as tmp:
        gen = generate(load_spec(spec))
        folder = Path(tmp) / gen.spec.name
        write_atomically(gen.files, folder)
        jobs = jobs_from_manifest(folder)
        registry = load_generated(folder)
        package = registry.__name__.rsplit(".", 1)[0]
        modules = {j.file: sys.modules[f"{package}.{j.file.removesuffix('.py')}"] for j in jobs}
        tuned = tune(jobs, modules, buckets, device, timer, budget_s)
        report = []
        for job, table in tuned.items():
            for rows, meta in table.items():
                mod = modules[job.file]
                configs = job.configs(mod)
                default = configs[min(configs, key=lambda b: (abs(b - rows), -b))]
                report.append(
                    {
                        "kernel": job.file,
                        "rows": rows,
                        "tuned": meta,
                        "tuned_ms": timer(mod, job.family, rows, meta),
                        "default_ms": timer(mod, job.family, rows, default),
                        "cublas_ms": cublas_ms(job.n, job.k, rows),
                    }
                )
    target = out / "configs" / normalise_device_name(device)
    if (CONFIG_ROOT / normalise_device_name(device)).is_dir():
        shutil.copytree(CONFIG_ROOT / normalise_device_name(device), target, dirs_exist_ok=True)
    return {"device": device, "kernels_tuned": len(tuned), "timings": report}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tune-budget-s", type=float, default=240.0)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: gpu_check needs a CUDA GPU; none is visible here", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    steps = {
        "kernels_bf16": lambda: kernel_checks(
            [Path("specs/tiny-llama.yaml"), Path("specs/llama3-70b-r40.yaml")], torch.bfloat16
        ),
        "cuda_graphs": lambda: graph_checks(Path(tempfile.mkdtemp())),
        "tuning": lambda: tune_checks(args.tune_budget_s, args.out),
    }
    for name, step in steps.items():  # each step reports even if another failed
        start = time.perf_counter()
        try:
            results[name] = step()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        results[f"{name}_seconds"] = time.perf_counter() - start
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
        print(f"{name}: done in {results[f'{name}_seconds']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
