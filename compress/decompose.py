"""``deinfer decompose``: a dense transformers checkpoint into the decomposed format,
one layer at a time, by plain SVD or a data-aware method (``compress``), and
spec writing from a model's config.

W (math [in, out]) = A·diag(S)·Bᵀ; keeping r singular values, D = A_r·√S_r [in, r]
and U = √S_r·B_rᵀ [r, out], so W ≈ D·U with the singular values split evenly (the
convention of SVD-LLM and the authors' code).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm import tqdm

from compress.calibration import INPUT_OF
from compress.factorize import InputStats, factorize
from compress.output import (
    FORMAT,
    DecomposedWriter,
    check_output_folder,
    staged_folder,
)
from compress.sequential import Factors
from dsl import Spec
from dsl.errors import SpecError
from dsl.spec import ModelConfig
from runtime.model.checkpoint import CheckpointError, CheckpointReader, Names, has_bias, names_for

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
    "chat_template.jinja",
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

TOOL = "deinfer decompose"


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
    return factorize(w_math, rank, "svd")


@dataclass(frozen=True)
class Factorization:
    """How each matrix becomes D·U: the method, its calibration statistics (None for
    svd), the up-factor refit, factors made beforehand (sequential calibration), and
    each matrix's output-column weights (``--fisher``; None: columns alike)."""

    method: str = "svd"
    stats: dict[tuple[int, str], InputStats] | None = None
    alpha: float = 0.5
    refit: bool = False
    made: Factors | None = None
    column_scales: dict[tuple[int, str], torch.Tensor] | None = None


def _layer_factors(reader, m, names, i: int, ranks, how: Factorization) -> dict:
    """Layer ``i``'s projections: factors where the spec gives a rank, else dense."""
    tensors: dict[str, torch.Tensor] = {}
    for matrix in m.matrices:
        base = names.layer(i, matrix)
        stored = reader.read(f"{base}.weight")  # [out, in]
        r = ranks.rank(matrix)
        if r is None:
            tensors[f"{base}.weight"] = stored
        else:
            d, u = _factors(stored.t(), r, how, i, matrix)
            tensors[f"{base}.v.weight"] = d.t()
            tensors[f"{base}.u.weight"] = u.t()
        if has_bias(m, matrix):
            key = f"{base}.bias" if r is None else f"{base}.u.bias"
            tensors[key] = reader.read(f"{base}.bias")
    return tensors


def _factors(w_math: torch.Tensor, rank: int, how: Factorization, i: int, matrix: str):
    if how.made is not None:
        return how.made[(i, matrix)]
    inputs = how.stats.get((i, INPUT_OF[matrix])) if how.stats else None
    scale = how.column_scales[(i, matrix)] if how.column_scales else None
    return factorize(w_math, rank, how.method, inputs, how.alpha, how.refit, scale)


def decompose(
    model_dir: str | Path,
    spec: Spec,
    out_dir: str | Path,
    dtype: str = "float32",
    progress: bool = True,
    how: Factorization | None = None,
    record: dict[str, Any] | None = None,
    force: bool = False,
) -> Path:
    """Write the decomposed checkpoint of ``model_dir`` for ``spec`` into ``out_dir``
    (a new or empty folder, or one ``deinfer decompose`` wrote; any other with ``force``).

    ``how`` (default: plain SVD) says how each matrix is factorised;
    ``record`` (how the checkpoint was made) goes into config.json beside the ranks,
    with the diagonal shift of every Gram matrix that needed one."""
    how = how or Factorization()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    check_output_folder(out_dir, TOOL, (model_dir,), force)  # before any work
    config = read_hf_config(model_dir)
    check_matches(spec, config)
    reader = CheckpointReader(model_dir)
    names = names_for(spec.model)
    m = spec.model
    out_dtype = DTYPES[dtype]
    n_files = m.num_layers + 1
    with staged_folder(out_dir, TOOL, (model_dir,), force) as tmp:
        writer = DecomposedWriter(tmp, n_files, out_dtype)
        for i, ranks in enumerate(
            tqdm(spec.decomposition.layers, desc="decompose", unit="layer", disable=not progress)
        ):
            tensors = _layer_factors(reader, m, names, i, ranks, how)
            tensors.update({k: reader.read(k) for k in layer_norm_names(m, names, i)})
            writer.write(tensors)
        writer.write({k: reader.read(k) for k in model_level_names(m, names)})
        config = dict(config)
        config["torch_dtype"] = dtype
        config["deinfer"] = {
            "format": FORMAT,
            "spec": spec.name,
            "ranks": [layer.as_dict() for layer in spec.decomposition.layers],
            "method": how.method,
            "sequential": how.made is not None,
            "refit": how.refit,
            "fisher": how.column_scales is not None,
            **(record or {}),
        }
        if how.method == "svd-llm" and how.stats:
            config["deinfer"]["whitening_shifts"] = whitening_shifts(how.stats)
        writer.finish(config)
        copy_tokenizer(model_dir, tmp)
    return out_dir


def whitening_shifts(stats: dict[tuple[int, str], InputStats]) -> dict[str, float]:
    """ "layer.input" -> the diagonal shift its Gram matrix needed (only those that did)."""
    shifts = {}
    for (layer, name), entry in sorted(stats.items()):
        if entry.gram is not None and entry.whitening().shift:
            shifts[f"{layer}.{name}"] = entry.whitening().shift
    return shifts


def layer_norm_names(m: ModelConfig, names: Names, layer: int) -> list[str]:
    """The norm tensors of one layer (copied unchanged)."""
    parts = ("weight", "bias") if m.norm.kind == "layer" else ("weight",)
    out = [f"{names.layer(layer, n)}.{p}" for n in ("input_norm", "post_norm") for p in parts]
    if m.qk_norm:
        out += [f"{names.layer(layer, n)}.weight" for n in ("q_norm", "k_norm")]
    return out


def model_level_names(m: ModelConfig, names: Names) -> list[str]:
    """Embedding, final norm, LM head (untied) and learned positions (copied unchanged)."""
    parts = ("weight", "bias") if m.norm.kind == "layer" else ("weight",)
    out = [names.embed] + [f"{names.final_norm}.{p}" for p in parts]
    if not m.tie_word_embeddings:
        out.append(names.lm_head)
    if names.positions:
        out.append(names.positions)
    return out


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
