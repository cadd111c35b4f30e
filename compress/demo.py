"""A random tiny Llama (transformers), its spec and its decomposed checkpoint: an
offline model for trying the runtime (``deinfer demo --out DIR``)."""

from __future__ import annotations

from pathlib import Path

DEMO_CONFIG = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "initializer_range": 0.1,
}


def make_demo(out: Path, seed: int = 0) -> tuple[Path, Path]:
    """Write the dense model, its spec (40% by the paper's rule, tp 2) and the
    decomposed checkpoint under ``out``; returns (spec file, checkpoint)."""
    import torch
    import transformers

    from compress.decompose import decompose, read_hf_config, spec_yaml
    from dsl import parse_spec

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**DEMO_CONFIG))
    model.save_pretrained(out / "dense")
    config = read_hf_config(out / "dense")
    text = spec_yaml(config, "tiny-demo", 0.4, "smaller_dim_fraction", 1, 2)
    spec = parse_spec(text, default_name="tiny-demo")
    spec_path = out / "tiny-demo.yaml"
    spec_path.write_text(text)
    decompose(out / "dense", spec, out / "lowrank", dtype="float32", progress=False)
    return spec_path, out / "lowrank"
