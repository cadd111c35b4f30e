"""A decomposed checkpoint with random factors of a spec's shapes (benchmarks, demos):
no dense model and no SVD needed."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dsl.spec import Spec
from runtime.model.checkpoint import expected_tensors


def write_random_checkpoint(
    spec: Spec, out: Path, seed: int = 0, dtype: torch.dtype = torch.float32
) -> Path:
    """Norm weights are ones, biases small, matrices N(0, 1/fan_in)."""
    g = torch.Generator().manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, shape in expected_tensors(spec).items():
        if "norm" in name or "layernorm" in name:
            t = torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
        elif len(shape) == 1:
            t = torch.randn(shape, generator=g) * 0.02
        else:
            t = torch.randn(shape, generator=g) / shape[1] ** 0.5
        tensors[name] = t.to(dtype).contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(
        json.dumps(
            {
                "deinfer": {
                    "format": "deinfer-lowrank-v1",
                    "spec": spec.name,
                    "random": True,
                    "ranks": [layer.as_dict() for layer in spec.decomposition.layers],
                }
            },
            indent=2,
        )
    )
    return out
