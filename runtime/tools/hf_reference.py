"""The baseline a user would pick instead: a transformers model holding the products D·U
of a decomposed checkpoint (the same weights the engine serves), run with ``generate``."""

from __future__ import annotations

from pathlib import Path

import torch

from dsl.errors import UserError
from dsl.spec import Spec
from runtime.model.checkpoint import CheckpointReader, names_for

# transformers class names per family (Llama-like ones share the config fields we set).
HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def hf_config(spec: Spec):
    """The transformers config of the spec's architecture."""
    import transformers

    m = spec.model
    if m.family not in HF_CLASSES:
        raise UserError(f"transformers baseline: family {m.family!r} is not supported")
    if m.positions.scaling is not None:
        raise UserError("transformers baseline: RoPE scaling is not supported")
    config_cls = getattr(transformers, HF_CLASSES[m.family][0])
    return config_cls(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        max_position_embeddings=m.max_position_embeddings,
        rms_norm_eps=m.norm.eps,
        rope_theta=m.positions.theta,
        hidden_act=m.mlp.activation,
        attention_bias=m.bias.qkv,
        tie_word_embeddings=m.tie_word_embeddings,
    )


def dense_state(spec: Spec, checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """transformers tensor names -> tensors, each decomposed matrix as U·Dᵀ [out, in]."""
    reader = CheckpointReader(checkpoint)
    names = names_for(spec.model)
    state = {}
    for name in reader.file_of:
        if name.endswith(".v.weight"):
            continue
        if name.endswith(".u.weight"):
            base = name.removesuffix(".u.weight")
            state[f"{base}.weight"] = reader.read(name) @ reader.read(f"{base}.v.weight")
        elif name.endswith(".u.bias"):
            state[name.removesuffix(".u.bias") + ".bias"] = reader.read(name)
        else:
            state[name] = reader.read(name)
    if spec.model.tie_word_embeddings:
        state[names.lm_head] = state[names.embed]
    return state


def load_transformers(spec: Spec, checkpoint: str | Path, dtype: torch.dtype = torch.float32):
    """The transformers model of ``spec`` with the checkpoint's products, in eval mode."""
    import transformers

    model_cls = getattr(transformers, HF_CLASSES[spec.model.family][1])
    model = model_cls(hf_config(spec))
    state = dense_state(spec, checkpoint)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if spec.model.tie_word_embeddings:
        missing = [k for k in missing if k != names_for(spec.model).lm_head]
    if missing or unexpected:
        raise UserError(
            f"transformers baseline: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    model.generation_config.eos_token_id = None  # same output length as the engine
    return model.to(dtype).eval()
