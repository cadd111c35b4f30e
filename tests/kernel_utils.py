"""Helpers for kernel tests: generate a spec's kernel files in memory and import them."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch
import yaml

from codegen.families.context import GenContext
from codegen.render import KernelFile, render
from dsl import build_plan, parse_spec

_DIR = Path(tempfile.mkdtemp(prefix="deinfer-kernels-"))

# Tolerances per dtype, relative to the output's scale (max(1, max |reference|)):
# fp32 dots accumulate in fp32 (~1e-6 relative); fp16 inputs round to 11 bits
# before an fp32-accumulated dot. bf16 is validated on a GPU only (the Triton
# interpreter mishandles bf16).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2}


def context(raw: dict, device: str | None = None) -> GenContext:
    spec = parse_spec(yaml.safe_dump(raw))
    return GenContext(spec=spec, plan=build_plan(spec), device=device)


def import_kernel(kernel: KernelFile, spec_name: str = "test") -> ModuleType:
    """Render ``kernel`` and import it as a standalone module (cached by content)."""
    source = render(kernel, spec_name, "0" * 64)
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    name = f"deinfer_kernel_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    path = _DIR / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    scale = max(1.0, want.float().abs().max().item()) if want.numel() else 1.0
    err = (got.float() - want.float()).abs().max().item() if want.numel() else 0.0
    assert err <= TOLERANCE[dtype] * scale, (
        f"{what}: max error {err:.3g} > {TOLERANCE[dtype]} x {scale:.3g}"
    )
