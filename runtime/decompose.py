"""``deinfer decompose``: truncated SVD of a dense transformers checkpoint into the
decomposed format, one layer at a time, and spec writing from a model's config.

W (math [in, out]) = A·diag(S)·Bᵀ; keeping r singular values, D = A_r·√S_r [in, r]
and U = √S_r·B_rᵀ [r, out], so W ≈ D·U with the singular values split evenly (the
convention of SVD-LLM and the authors' code). The SVD runs in fp32.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import save_file
from tqdm import tqdm

from dsl import Spec
from dsl.errors import SpecError
from runtime.checkpoint import CheckpointError, CheckpointReader, has_bias, names_for

HF_FAMILIES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "opt": "opt",
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
HF_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "relu": "relu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
}


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"no config.json in {model_dir}")
    config = json.loads(path.read_text())
    if config.get("model_type") not in HF_FAMILIES:
        raise CheckpointError(
            f"config.json model_type {config.get('model_type')!r} is not one "
            f"of {', '.join(HF_FAMILIES)}"
        )
    return config


def model_section(config: dict[str, Any]) -> dict[str, Any]:
    """The spec's ``model`` mapping for a transformers config."""
    family = HF_FAMILIES[config["model_type"]]
    heads = config["num_attention_heads"]
    section: dict[str, Any] = {
        "family": family,
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["ffn_dim"] if family == "opt" else config["intermediate_size"],
        "num_layers": config["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
        "vocab_size": config["vocab_size"],
        "max_position_embeddings": config["max_position_embeddings"],
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", family == "opt")),
    }
    if family == "opt":
        section["positions"] = {"kind": "learned", "offset": 2}
        act = config.get("activation_function", "relu")
        section["mlp"] = {"kind": "plain", "activation": HF_ACTIVATIONS.get(act, act)}
        section["bias"] = {
            "qkv": bool(config.get("enable_bias", True)),
            "o": bool(config.get("enable_bias", True)),
            "mlp": bool(config.get("enable_bias", True)),
        }
        section["norm"] = {"kind": "layer", "eps": 1e-5}
    else:
        rope = config.get("rope_parameters") or {}
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        section["positions"] = {"kind": "rope", "theta": float(theta), "style": "neox"}
        section["norm"] = {"kind": "rms", "eps": float(config.get("rms_norm_eps", 1e-6))}
        act = config.get("hidden_act", "silu")
        section["mlp"] = {"kind": "glu", "activation": HF_ACTIVATIONS.get(act, act)}
        if family in ("llama", "mistral"):
            bias = bool(config.get("attention_bias", False))
            section["bias"] = {"qkv": bias, "o": bias, "mlp": bool(config.get("mlp_bias", False))}
    return section


def spec_yaml(
    config: dict[str, Any], name: str, ratio: float, rule: str, multiple: int, tp: int
) -> str:
    """A spec for decomposing the model of ``config`` at ``ratio`` under ``rule``."""
    raw = {
        "name": name,
        "model": model_section(config),
        "decomposition": {"ratio": ratio, "rule": rule, "rank_multiple": multiple},
        "parallel": {"tp": tp},
        "runtime": {"dtype": "float32"},
    }
    return yaml.safe_dump(raw, sort_keys=False)


def check_matches(spec: Spec, config: dict[str, Any]) -> None:
    """The spec must describe the checkpoint's architecture."""
    want = model_section(config)
    m = spec.model
    for key in (
        "family",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "vocab_size",
        "tie_word_embeddings",
    ):
        found = getattr(m, key)
        expected = want[key]
        if key == "family" and {found, expected} <= {"llama", "mistral"}:
            continue
        if found != expected:
            raise SpecError(
                f"model.{key}", f"spec says {found}, the checkpoint's config.json says {expected}"
            )


def svd_factors(w_math: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """D [in, r], U [r, out] with D·U the best rank-r approximation of w_math (fp32)."""
    a, s, bt = torch.linalg.svd(w_math.float(), full_matrices=False)
    root = s[:rank].sqrt()
    return a[:, :rank] * root[None, :], root[:, None] * bt[:rank]


def decompose(
    model_dir: str | Path,
    spec: Spec,
    out_dir: str | Path,
    dtype: str = "float32",
    progress: bool = True,
) -> Path:
    """Write the decomposed checkpoint of ``model_dir`` for ``spec`` into ``out_dir``."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = read_hf_config(model_dir)
    check_matches(spec, config)
    reader = CheckpointReader(model_dir)
    names = names_for(spec.model)
    m = spec.model
    out_dtype = DTYPES[dtype]
    n_files = m.num_layers + 1
    weight_map: dict[str, str] = {}
    norm_parts = ("weight", "bias") if m.norm.kind == "layer" else ("weight",)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        for i, ranks in enumerate(
            tqdm(spec.decomposition.layers, desc="decompose", unit="layer", disable=not progress)
        ):
            tensors: dict[str, torch.Tensor] = {}
            for matrix in m.matrices:
                base = names.layer(i, matrix)
                stored = reader.read(f"{base}.weight")  # [out, in]
                r = ranks.rank(matrix)
                if r is None:
                    tensors[f"{base}.weight"] = stored
                else:
                    d, u = svd_factors(stored.t(), r)
                    tensors[f"{base}.v.weight"] = d.t()
                    tensors[f"{base}.u.weight"] = u.t()
                if has_bias(m, matrix):
                    key = f"{base}.bias" if r is None else f"{base}.u.bias"
                    tensors[key] = reader.read(f"{base}.bias")
            extra = ["input_norm", "post_norm"] + (["q_norm", "k_norm"] if m.qk_norm else [])
            for norm in extra:
                parts = norm_parts if norm in ("input_norm", "post_norm") else ("weight",)
                for p in parts:
                    key = f"{names.layer(i, norm)}.{p}"
                    tensors[key] = reader.read(key)
            _save(
                tensors,
                tmp,
                f"model-{i + 1:05d}-of-{n_files:05d}.safetensors",
                out_dtype,
                weight_map,
            )
        rest = [names.embed] + [f"{names.final_norm}.{p}" for p in norm_parts]
        if not m.tie_word_embeddings:
            rest.append(names.lm_head)
        if names.positions:
            rest.append(names.positions)
        _save(
            {k: reader.read(k) for k in rest},
            tmp,
            f"model-{n_files:05d}-of-{n_files:05d}.safetensors",
            out_dtype,
            weight_map,
        )
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps(
                {
                    "metadata": {"format": "deinfer-lowrank-v1"},
                    "weight_map": dict(sorted(weight_map.items())),
                },
                indent=2,
            )
        )
        config = dict(config)
        config["torch_dtype"] = dtype
        config["deinfer"] = {
            "format": "deinfer-lowrank-v1",
            "spec": spec.name,
            "ranks": [layer.as_dict() for layer in spec.decomposition.layers],
        }
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for name in TOKENIZER_FILES:
            if (model_dir / name).is_file():
                shutil.copy(model_dir / name, tmp / name)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _save(
    tensors: dict[str, torch.Tensor],
    folder: Path,
    file_name: str,
    dtype: torch.dtype,
    weight_map: dict[str, str],
) -> None:
    save_file(
        {k: v.to(dtype).contiguous() for k, v in tensors.items()},
        folder / file_name,
        metadata={"format": "pt"},
    )
    weight_map.update({k: file_name for k in tensors})
