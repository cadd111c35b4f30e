"""Read and validate a YAML spec into frozen dataclasses.

A spec is untrusted input: ``dsl.yaml_read`` turns the file into plain data safely;
here every mapping is checked for unknown and missing keys and every scalar for type
and range. Each failure raises ``SpecError`` naming the YAML path.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from dsl.checks import _join, _kind
from dsl.errors import SpecError
from dsl.load_ranks import RankParser
from dsl.spec import (
    ACTIVATIONS,
    DTYPES,
    FAMILIES,
    KV_CACHE_KINDS,
    ROPE_SCALING_TYPES,
    ROPE_STYLES,
    Bias,
    Mlp,
    ModelConfig,
    Norm,
    Parallel,
    Positions,
    RopeScaling,
    RuntimeConfig,
    Spec,
)
from dsl.yaml_read import _quote, read_spec_text, read_yaml

NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")  # always fullmatch: "$" lets "\n" in
MODEL_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "vocab_size",
    "max_position_embeddings",
)

# What each family implies unless the spec says otherwise (the HF configs' defaults).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "positions": {"kind": "rope"},
        "norm": {"kind": "rms", "eps": 1e-5},
        "mlp": {"kind": "glu", "activation": "silu"},
        "bias": {"qkv": False, "o": False, "mlp": False},
        "qk_norm": False,
    },
    "mistral": {
        "positions": {"kind": "rope"},
        "norm": {"kind": "rms", "eps": 1e-5},
        "mlp": {"kind": "glu", "activation": "silu"},
        "bias": {"qkv": False, "o": False, "mlp": False},
        "qk_norm": False,
    },
    "qwen2": {
        "positions": {"kind": "rope"},
        "norm": {"kind": "rms", "eps": 1e-6},
        "mlp": {"kind": "glu", "activation": "silu"},
        "bias": {"qkv": True, "o": False, "mlp": False},
        "qk_norm": False,
    },
    "qwen3": {
        "positions": {"kind": "rope"},
        "norm": {"kind": "rms", "eps": 1e-6},
        "mlp": {"kind": "glu", "activation": "silu"},
        "bias": {"qkv": False, "o": False, "mlp": False},
        "qk_norm": True,
    },
    "opt": {
        "positions": {"kind": "learned", "offset": 2},
        "norm": {"kind": "layer", "eps": 1e-5},
        "mlp": {"kind": "plain", "activation": "relu"},
        "bias": {"qkv": True, "o": True, "mlp": True},
        "qk_norm": False,
    },
}


def load_spec(path: str | Path) -> Spec:
    """Read, parse and validate the spec at ``path``."""
    return parse_spec(read_spec_text(path), default_name=Path(path).stem)


def parse_spec(text: str, default_name: str = "spec") -> Spec:
    """Parse YAML text into a validated ``Spec``."""
    return SpecParser().spec(read_yaml(text), default_name)


class SpecParser(RankParser):
    """Validating walk over the raw YAML tree; every check knows its path."""

    def spec(self, raw: Any, default_name: str) -> Spec:
        top = self.mapping(
            raw, "", required={"model", "decomposition"}, optional={"name", "parallel", "runtime"}
        )
        name = top.get("name", default_name)
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise SpecError(
                "name",
                f"must match {NAME_PATTERN.pattern} (lowercase letters, digits, "
                f"'.', '_', '-'), found {_quote(name)}",
            )
        model = self.model(top["model"], "model")
        parallel = self.parallel(top.get("parallel", {}), "parallel", model)
        decomposition = self.decomposition(top["decomposition"], "decomposition", model)
        runtime = self.runtime(top.get("runtime", {}), "runtime", model)
        return Spec(
            name=name, model=model, decomposition=decomposition, parallel=parallel, runtime=runtime
        )

    # --- generic checks -------------------------------------------------------------

    def model(self, raw: Any, path: str) -> ModelConfig:
        m = self.mapping(
            raw,
            path,
            required={"family", *MODEL_SIZES},
            optional={
                "num_kv_heads",
                "head_dim",
                "positions",
                "norm",
                "mlp",
                "bias",
                "qk_norm",
                "tie_word_embeddings",
            },
        )
        family = self.choice(m["family"], _join(path, "family"), FAMILIES)
        defaults = FAMILY_DEFAULTS[family]
        sizes = self.sizes(m, path)
        return ModelConfig(
            family=family,
            **sizes,
            positions=self.positions(
                m.get("positions", defaults["positions"]),
                _join(path, "positions"),
                sizes["head_dim"],
            ),
            norm=self.norm(m.get("norm", defaults["norm"]), _join(path, "norm")),
            mlp=self.mlp(m.get("mlp", defaults["mlp"]), _join(path, "mlp")),
            bias=self.bias(m.get("bias", defaults["bias"]), _join(path, "bias")),
            qk_norm=self.boolean(m.get("qk_norm", defaults["qk_norm"]), _join(path, "qk_norm")),
            tie_word_embeddings=self.boolean(
                m.get("tie_word_embeddings", False), _join(path, "tie_word_embeddings")
            ),
        )

    def sizes(self, m: dict[str, Any], path: str) -> dict[str, int]:
        """The model's integer sizes, head counts and head dimension."""
        v = {k: self.integer(m[k], _join(path, k), hi=1 << 24) for k in sorted(MODEL_SIZES)}
        v["num_layers"] = self.integer(m["num_layers"], _join(path, "num_layers"), hi=4096)
        heads = v["num_heads"]
        kv_heads = self.integer(m.get("num_kv_heads", heads), _join(path, "num_kv_heads"), hi=heads)
        if heads % kv_heads:
            raise SpecError(
                _join(path, "num_kv_heads"),
                f"num_heads {heads} must be a multiple of num_kv_heads {kv_heads}",
            )
        v["num_kv_heads"] = kv_heads
        head_dim = m.get("head_dim", v["hidden_size"] // heads)
        v["head_dim"] = self.integer(head_dim, _join(path, "head_dim"), hi=1024)
        return v

    def positions(self, raw: Any, path: str, head_dim: int) -> Positions:
        m = self.mapping(
            raw, path, required={"kind"}, optional={"theta", "style", "scaling", "offset"}
        )
        kind = self.choice(m["kind"], _join(path, "kind"), ("rope", "learned"))
        if kind == "learned":
            for key in ("theta", "style", "scaling"):
                if key in m:
                    raise SpecError(_join(path, key), "only allowed with kind: rope")
            return Positions(
                kind="learned",
                offset=self.integer(m.get("offset", 0), _join(path, "offset"), lo=0, hi=1 << 16),
            )
        if "offset" in m:
            raise SpecError(_join(path, "offset"), "only allowed with kind: learned")
        if head_dim % 2:
            raise SpecError(path, f"rotary embeddings need an even head_dim, found {head_dim}")
        scaling = None
        if m.get("scaling") is not None:
            s = self.mapping(
                m["scaling"],
                _join(path, "scaling"),
                required={"type", "factor"},
                optional={
                    "low_freq_factor",
                    "high_freq_factor",
                    "original_max_position_embeddings",
                },
            )
            sp = _join(path, "scaling")
            scaling = RopeScaling(
                type=self.choice(s["type"], _join(sp, "type"), ROPE_SCALING_TYPES),
                factor=self.number(s["factor"], _join(sp, "factor"), 1.0, 1024.0),
                low_freq_factor=self.number(
                    s.get("low_freq_factor", 1.0), _join(sp, "low_freq_factor"), 0.0, 1024.0, True
                ),
                high_freq_factor=self.number(
                    s.get("high_freq_factor", 4.0), _join(sp, "high_freq_factor"), 0.0, 1024.0, True
                ),
                original_max_position_embeddings=self.integer(
                    s.get("original_max_position_embeddings", 1),
                    _join(sp, "original_max_position_embeddings"),
                    hi=1 << 24,
                ),
            )
        return Positions(
            kind="rope",
            theta=self.number(m.get("theta", 10000.0), _join(path, "theta"), 1.0, 1e9),
            style=self.choice(m.get("style", "neox"), _join(path, "style"), ROPE_STYLES),
            scaling=scaling,
        )

    def norm(self, raw: Any, path: str) -> Norm:
        m = self.mapping(raw, path, required={"kind"}, optional={"eps"})
        return Norm(
            kind=self.choice(m["kind"], _join(path, "kind"), ("rms", "layer")),
            eps=self.number(m.get("eps", 1e-5), _join(path, "eps"), 0.0, 1.0, True),
        )

    def mlp(self, raw: Any, path: str) -> Mlp:
        m = self.mapping(raw, path, required={"kind"}, optional={"activation"})
        kind = self.choice(m["kind"], _join(path, "kind"), ("glu", "plain"))
        default = "silu" if kind == "glu" else "relu"
        return Mlp(
            kind=kind,
            activation=self.choice(
                m.get("activation", default), _join(path, "activation"), ACTIVATIONS
            ),
        )

    def bias(self, raw: Any, path: str) -> Bias:
        m = self.mapping(raw, path, required=set(), optional={"qkv", "o", "mlp"})
        return Bias(
            **{k: self.boolean(m.get(k, False), _join(path, k)) for k in ("qkv", "o", "mlp")}
        )

    def parallel(self, raw: Any, path: str, model: ModelConfig) -> Parallel:
        m = self.mapping(raw, path, required=set(), optional={"tp"})
        tp = self.integer(m.get("tp", 1), _join(path, "tp"), hi=1024)
        error = tp_error(model, tp)
        if error:
            raise SpecError(_join(path, "tp"), error)
        return Parallel(tp=tp)

    def runtime(self, raw: Any, path: str, model: ModelConfig) -> RuntimeConfig:
        m = self.mapping(
            raw,
            path,
            required=set(),
            optional={
                "dtype",
                "block_size",
                "max_batch_size",
                "max_seq_len",
                "kv_cache",
                "cuda_graph_batch_sizes",
            },
        )
        block_size = self.integer(m.get("block_size", 16), _join(path, "block_size"), hi=1024)
        if block_size & (block_size - 1):
            raise SpecError(
                _join(path, "block_size"), f"must be a power of two, found {block_size}"
            )
        max_batch = self.integer(
            m.get("max_batch_size", 256), _join(path, "max_batch_size"), hi=1 << 16
        )
        max_seq = self.integer(
            m.get("max_seq_len", min(4096, model.max_position_embeddings)),
            _join(path, "max_seq_len"),
            hi=model.max_position_embeddings,
        )
        default_graphs = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b <= max_batch]
        graphs = m.get("cuda_graph_batch_sizes", default_graphs)
        gpath = _join(path, "cuda_graph_batch_sizes")
        if not isinstance(graphs, list):
            raise SpecError(gpath, f"expected a list, found {_kind(graphs)}")
        sizes = [self.integer(b, f"{gpath}[{i}]", hi=max_batch) for i, b in enumerate(graphs)]
        if sizes != sorted(set(sizes)):
            raise SpecError(gpath, "must be strictly increasing")
        return RuntimeConfig(
            dtype=self.choice(m.get("dtype", "bfloat16"), _join(path, "dtype"), DTYPES),
            block_size=block_size,
            max_batch_size=max_batch,
            max_seq_len=max_seq,
            kv_cache=self.choice(
                m.get("kv_cache", "auto"), _join(path, "kv_cache"), KV_CACHE_KINDS
            ),
            cuda_graph_batch_sizes=tuple(sizes),
        )


def tp_error(model: ModelConfig, tp: int) -> str | None:
    """Why ``tp`` does not fit the head counts, or None.

    Rule: q heads divisible by tp; kv heads divisible by tp, or tp divisible by kv
    heads (then each kv head is replicated on tp / kv_heads ranks).
    """
    if model.num_heads % tp:
        return f"num_heads {model.num_heads} is not divisible by tp {tp}"
    kv = model.num_kv_heads
    if kv % tp and tp % kv:
        return f"num_kv_heads {kv} and tp {tp}: one must divide the other"
    return None
