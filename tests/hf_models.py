"""Random small transformers models of each family, and their decomposed twins."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from hypothesis import strategies as st
from safetensors import safe_open

from runtime.model.checkpoint import names_for

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "opt")


@st.composite
def hf_configs(draw, family: str, max_tp: int = 4) -> tuple[dict, int]:
    """(transformers config kwargs, tp) for a random small model of ``family``."""
    kv = draw(st.sampled_from([1, 2, 3, 4]))
    heads = (
        kv * draw(st.sampled_from([1, 2])) if family != "opt" else draw(st.sampled_from([2, 3, 4]))
    )
    if family == "opt":
        kv = heads
    head_dim = draw(st.sampled_from([4, 8]))
    # transformers wants hidden % heads == 0; head_dim may still differ from hidden / heads.
    hidden = heads * (head_dim if family in ("opt", "qwen2") else draw(st.sampled_from([4, 6, 8])))
    inter = draw(st.integers(8, 40))
    layers = draw(st.integers(1, 2))
    vocab = draw(st.integers(20, 50))
    tps = [t for t in range(1, max_tp + 1) if heads % t == 0 and (kv % t == 0 or t % kv == 0)]
    tp = draw(st.sampled_from(tps))
    common = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "max_position_embeddings": 64,
        "initializer_range": 0.1,
    }
    if family == "opt":
        cfg = {
            **common,
            "ffn_dim": inter,
            "word_embed_proj_dim": hidden,
            "do_layer_norm_before": True,
            "activation_function": "relu",
        }
    else:
        cfg = {
            **common,
            "intermediate_size": inter,
            "num_key_value_heads": kv,
            "head_dim": head_dim,
            "rope_theta": draw(st.sampled_from([10000.0, 500000.0])),
            "tie_word_embeddings": draw(st.booleans()),
        }
    return cfg, tp


def build_hf(family: str, kwargs: dict, seed: int):
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "opt": (transformers.OPTConfig, transformers.OPTForCausalLM),
    }
    config_cls, model_cls = classes[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs, attn_implementation="eager")).float().eval()
    with torch.no_grad():  # non-trivial norms so a wrong norm cannot hide
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def load_products(model, spec, checkpoint: Path):
    """Set each decomposed projection of the transformers model to D·U from the checkpoint."""
    names = names_for(spec.model)
    files = {}
    for f in checkpoint.glob("*.safetensors"):
        h = safe_open(f, framework="pt")
        for k in h.keys():  # noqa: SIM118
            files[k] = h
    params = dict(model.named_parameters())
    with torch.no_grad():
        for i, ranks in enumerate(spec.decomposition.layers):
            for matrix in spec.model.matrices:
                base = names.layer(i, matrix)
                if ranks.is_decomposed(matrix):
                    u = files[f"{base}.u.weight"].get_tensor(f"{base}.u.weight").float()
                    v = files[f"{base}.v.weight"].get_tensor(f"{base}.v.weight").float()
                    params[f"{base}.weight"].copy_(u @ v)
    return model


# The small Llama most runtime tests use, and odd ranks that differ per matrix.
TINY_LLAMA = {
    "vocab_size": 40,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 24,
    "max_position_embeddings": 64,
    "initializer_range": 0.1,
}
TINY_RANKS = {"q": 7, "k": 5, "v": 9, "o": 11, "gate": 13, "up": 3, "down": 17}


def tiny_runtime(max_seq_len: int, max_batch_size: int = 4) -> dict:
    """The runtime section of the tiny specs: fp32, blocks of 4 tokens."""
    return {
        "dtype": "float32",
        "block_size": 4,
        "max_batch_size": max_batch_size,
        "max_seq_len": max_seq_len,
        "cuda_graph_batch_sizes": [b for b in (1, 2, 4, 8) if b <= max_batch_size],
    }


def decompose_with_cli(dense: Path, spec_path: Path, out: Path) -> None:
    """``deinfer decompose`` as a user runs it (in process)."""
    from cli.main import main as cli

    args = ["decompose", "--model", str(dense), "--spec", str(spec_path), "--out", str(out)]
    assert cli([*args, "--quiet"]) == 0


def make_decomposed(
    tmp: Path, family: str, kwargs: dict, ranks: dict, tp: int, runtime: dict, seed: int = 3
):
    """A random transformers model saved to tmp/dense, decomposed by ``deinfer decompose``
    into tmp/lowrank with ``ranks``; returns (spec path, checkpoint, reference model with
    the products D·U, spec)."""
    import yaml

    from compress.decompose import model_section
    from dsl import parse_spec

    hf = build_hf(family, kwargs, seed)
    hf.save_pretrained(tmp / "dense")
    raw = {
        "name": "tiny-hf",
        "model": model_section(hf.config.to_dict()),
        "decomposition": {"ranks": ranks},
        "parallel": {"tp": tp},
        "runtime": runtime,
    }
    spec_path = tmp / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(raw))
    decompose_with_cli(tmp / "dense", spec_path, tmp / "lowrank")
    spec = parse_spec(spec_path.read_text())
    return spec_path, tmp / "lowrank", load_products(hf, spec, tmp / "lowrank"), spec
