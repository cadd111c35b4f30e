"""Read and validate a YAML spec into frozen dataclasses.

A spec is untrusted input: the file is size-capped, must be UTF-8, is parsed with
a safe loader (no tags, no duplicate keys), every mapping is checked for unknown
and missing keys, and every scalar for type and range. Each failure raises
``SpecError`` naming the YAML path.
"""

from __future__ import annotations

import re
import reprlib
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from dsl.errors import SpecError
from dsl.ranks import RULES, rank_from_ratio
from dsl.spec import (
    ACTIVATIONS,
    DTYPES,
    FAMILIES,
    KV_CACHE_KINDS,
    ROPE_SCALING_TYPES,
    ROPE_STYLES,
    Bias,
    Decomposition,
    LayerRanks,
    Mlp,
    ModelConfig,
    Norm,
    Parallel,
    Positions,
    RopeScaling,
    RuntimeConfig,
    Spec,
)

MAX_SPEC_BYTES = 1 << 20  # real specs are a few KiB; a larger file is a mistake or an attack
NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")  # always fullmatch: "$" lets "\n" in
# A spec is a few hundred nodes; these bound what an untrusted file can make the parser
# build (an alias "bomb" expands 9 aliases of 9 aliases... to 10**9 nodes) or recurse into.
MAX_YAML_NODES = 20_000  # counted with every alias expanded
MAX_YAML_DEPTH = 32
_QUOTE = reprlib.Repr()
_QUOTE.maxstring = _QUOTE.maxother = 60
_QUOTE.maxlist = _QUOTE.maxdict = 4
_QUOTE.maxlevel = 2


def _quote(value: Any) -> str:
    """A bad value as an error message shows it: at most ~80 characters, whatever it is."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        return f"an integer of {value.bit_length()} bits"  # str() of a huge int raises
    return _QUOTE.repr(value)


DENSE = "dense"

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


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that also rejects duplicate keys (a silent override hides typos) and
    trees deeper than MAX_YAML_DEPTH or larger than MAX_YAML_NODES once expanded."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):  # type: ignore[no-untyped-def]
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                line = self.peek_event().start_mark.line + 1
                reason = f"YAML nested deeper than {MAX_YAML_DEPTH} levels (line {line})"
                raise SpecError("", reason)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_node(self):  # type: ignore[no-untyped-def]
        node = super().get_single_node()
        if node is not None and _expanded_size(node, {}) > MAX_YAML_NODES:
            raise SpecError("", f"YAML has more than {MAX_YAML_NODES} nodes once aliases expand")
        return node


def _expanded_size(node: yaml.Node, seen: dict[int, int]) -> int:
    """Nodes in the tree with every alias copied out (shared nodes counted per use)."""
    if id(node) in seen:
        return seen[id(node)]
    seen[id(node)] = 1  # a cycle (only via a recursive alias) counts once
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(_expanded_size(child, seen) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size += sum(_expanded_size(k, seen) + _expanded_size(v, seen) for k, v in node.value)
    seen[id(node)] = min(size, MAX_YAML_NODES + 1)
    return seen[id(node)]


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, Hashable):
            line = key_node.start_mark.line + 1
            raise SpecError("", f"a {type(key).__name__} used as a mapping key at line {line}")
        if key in seen:
            line = key_node.start_mark.line + 1
            raise SpecError("", f"duplicate key {_quote(key)} at line {line}")
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_spec_text(path: str | Path) -> str:
    """A spec file's text: it must exist, be at most 1 MiB and be UTF-8."""
    path = Path(path)
    if not path.is_file():
        raise SpecError("", f"spec file not found: {path}")
    size = path.stat().st_size
    if size > MAX_SPEC_BYTES:
        raise SpecError("", f"spec file is {size} bytes, more than the {MAX_SPEC_BYTES} allowed")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError("", f"spec file is not UTF-8 (byte {exc.start})") from None


def load_spec(path: str | Path) -> Spec:
    """Read, parse and validate the spec at ``path``."""
    return parse_spec(read_spec_text(path), default_name=Path(path).stem)


def parse_spec(text: str, default_name: str = "spec") -> Spec:
    """Parse YAML text into a validated ``Spec``."""
    try:
        raw = yaml.load(text, Loader=_StrictLoader)
    except SpecError:
        raise
    except yaml.constructor.ConstructorError as exc:
        raise SpecError("", f"YAML construct not allowed: {exc.problem}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise SpecError("", f"invalid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    except (ValueError, OverflowError) as exc:  # e.g. an integer of 100,000 digits
        raise SpecError("", f"unreadable YAML value: {str(exc)[:80]}") from None
    return _Parser().spec(raw, default_name)


class _Parser:
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

    @staticmethod
    def mapping(raw: Any, path: str, required: set[str], optional: set[str]) -> dict[str, Any]:
        if not isinstance(raw, dict):
            raise SpecError(path or "(top level)", f"expected a mapping, found {_kind(raw)}")
        for key in raw:
            if not isinstance(key, str) or key not in required | optional:
                allowed = ", ".join(sorted(required | optional))
                raise SpecError(_join(path, str(key)), f"unknown key (allowed: {allowed})")
        for key in sorted(required):
            if key not in raw:
                raise SpecError(_join(path, key), "missing required field")
        return raw

    @staticmethod
    def integer(raw: Any, path: str, lo: int = 1, hi: int = 1 << 31) -> int:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise SpecError(path, f"expected an integer, found {_kind(raw)}")
        if not lo <= raw <= hi:
            raise SpecError(path, f"must be between {lo} and {hi}, found {_quote(raw)}")
        return raw

    @staticmethod
    def number(raw: Any, path: str, lo: float, hi: float, open_lo: bool = False) -> float:
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise SpecError(path, f"expected a number, found {_kind(raw)}")
        if not (lo < raw if open_lo else lo <= raw) or not raw <= hi:
            bracket = "(" if open_lo else "["
            raise SpecError(path, f"must be in {bracket}{lo}, {hi}], found {_quote(raw)}")
        return float(raw)

    @staticmethod
    def boolean(raw: Any, path: str) -> bool:
        if not isinstance(raw, bool):
            raise SpecError(path, f"expected true or false, found {_kind(raw)}")
        return raw

    @staticmethod
    def choice(raw: Any, path: str, allowed: tuple[str, ...]) -> str:
        if not isinstance(raw, str) or raw not in allowed:
            raise SpecError(path, f"must be one of {', '.join(allowed)}, found {_quote(raw)}")
        return raw

    # --- sections -------------------------------------------------------------------

    def model(self, raw: Any, path: str) -> ModelConfig:
        sizes = {
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "vocab_size",
            "max_position_embeddings",
        }
        m = self.mapping(
            raw,
            path,
            required={"family"} | sizes,
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
        v = {k: self.integer(m[k], _join(path, k), hi=1 << 24) for k in sorted(sizes)}
        v["num_layers"] = self.integer(m["num_layers"], _join(path, "num_layers"), hi=4096)
        heads = v["num_heads"]
        kv_heads = self.integer(m.get("num_kv_heads", heads), _join(path, "num_kv_heads"), hi=heads)
        if heads % kv_heads:
            raise SpecError(
                _join(path, "num_kv_heads"),
                f"num_heads {heads} must be a multiple of num_kv_heads {kv_heads}",
            )
        default_head_dim = v["hidden_size"] // heads
        head_dim = self.integer(
            m.get("head_dim", default_head_dim), _join(path, "head_dim"), hi=1024
        )
        positions = self.positions(
            m.get("positions", defaults["positions"]), _join(path, "positions"), head_dim
        )
        norm = self.norm(m.get("norm", defaults["norm"]), _join(path, "norm"))
        mlp = self.mlp(m.get("mlp", defaults["mlp"]), _join(path, "mlp"))
        bias = self.bias(m.get("bias", defaults["bias"]), _join(path, "bias"))
        return ModelConfig(
            family=family,
            hidden_size=v["hidden_size"],
            intermediate_size=v["intermediate_size"],
            num_layers=v["num_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=v["vocab_size"],
            max_position_embeddings=v["max_position_embeddings"],
            positions=positions,
            norm=norm,
            mlp=mlp,
            bias=bias,
            qk_norm=self.boolean(m.get("qk_norm", defaults["qk_norm"]), _join(path, "qk_norm")),
            tie_word_embeddings=self.boolean(
                m.get("tie_word_embeddings", False), _join(path, "tie_word_embeddings")
            ),
        )

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

    def decomposition(self, raw: Any, path: str, model: ModelConfig) -> Decomposition:
        m = self.mapping(
            raw,
            path,
            required=set(),
            optional={"ratio", "rule", "rank_multiple", "ranks", "overrides"},
        )
        matrices = model.matrices
        ratio = rule = None
        if "ratio" in m:
            ratio = self.number(m["ratio"], _join(path, "ratio"), 0.0, 1.0)
            if ratio >= 1.0:
                raise SpecError(_join(path, "ratio"), "must be below 1 (1 would remove everything)")
            rule = self.choice(m.get("rule", "smaller_dim_fraction"), _join(path, "rule"), RULES)
        elif "rule" in m:
            raise SpecError(_join(path, "rule"), "needs decomposition.ratio")
        multiple = self.integer(m.get("rank_multiple", 1), _join(path, "rank_multiple"), hi=4096)
        explicit = self.ranks(m.get("ranks", {}), _join(path, "ranks"), model)
        defaults: dict[str, int | None] = {}
        for name in matrices:
            if name in explicit:
                defaults[name] = explicit[name]
            elif ratio is not None:
                shape = model.matrix_shape(name)
                defaults[name] = rank_from_ratio(rule, ratio, shape, multiple)
                if defaults[name] > min(shape):
                    raise SpecError(
                        _join(path, "rank_multiple"),
                        f"{multiple} is larger than matrix {name}'s smaller dimension "
                        f"{min(shape)} (its rank would exceed min(in, out))",
                    )
            else:
                raise SpecError(
                    _join(path, f"ranks.{name}"),
                    "missing: give a rank, 'dense', or decomposition.ratio",
                )
        per_layer = [dict(defaults) for _ in range(model.num_layers)]
        overrides = m.get("overrides", [])
        opath = _join(path, "overrides")
        if not isinstance(overrides, list):
            raise SpecError(opath, f"expected a list, found {_kind(overrides)}")
        for i, item in enumerate(overrides):
            ipath = f"{opath}[{i}]"
            o = self.mapping(item, ipath, required={"layers", "ranks"}, optional=set())
            layers = self.layer_list(o["layers"], _join(ipath, "layers"), model.num_layers)
            ranks = self.ranks(o["ranks"], _join(ipath, "ranks"), model)
            for layer in layers:
                per_layer[layer].update(ranks)
        return Decomposition(
            rule=rule,
            ratio=ratio,
            layers=tuple(LayerRanks(tuple((n, lr[n]) for n in matrices)) for lr in per_layer),
        )

    def ranks(self, raw: Any, path: str, model: ModelConfig) -> dict[str, int | None]:
        m = self.mapping(raw, path, required=set(), optional=set(model.matrices))
        out: dict[str, int | None] = {}
        for name, value in m.items():
            if value == DENSE:
                out[name] = None
                continue
            n_in, n_out = model.matrix_shape(name)
            limit = min(n_in, n_out)
            if isinstance(value, bool) or not isinstance(value, int):
                raise SpecError(
                    _join(path, name),
                    f"expected a positive integer rank or 'dense', found {_kind(value)}",
                )
            if value <= 0:
                raise SpecError(_join(path, name), f"rank must be positive, found {value}")
            if value > limit:
                raise SpecError(
                    _join(path, name),
                    f"rank {value} exceeds min(in, out) = min({n_in}, {n_out}) = {limit}",
                )
            out[name] = value
        return out

    def layer_list(self, raw: Any, path: str, num_layers: int) -> list[int]:
        """Layers as a list of ints and "a-b" inclusive ranges."""
        if not isinstance(raw, list) or not raw:
            raise SpecError(path, f"expected a non-empty list of layers, found {_kind(raw)}")
        layers: list[int] = []
        for j, item in enumerate(raw):
            ipath = f"{path}[{j}]"
            if isinstance(item, str) and re.fullmatch(r"\d{1,9}-\d{1,9}", item):
                lo, hi = (int(x) for x in item.split("-"))
                if lo > hi:
                    raise SpecError(ipath, f"empty range {_quote(item)}")
                span = range(lo, hi + 1)
            elif isinstance(item, int) and not isinstance(item, bool):
                span = range(item, item + 1)
            else:
                found = _quote(item)
                raise SpecError(ipath, f"expected a layer index or 'a-b' range, found {found}")
            if span.start < 0 or span.stop > num_layers:
                raise SpecError(ipath, f"layer out of range 0-{num_layers - 1}: {_quote(item)}")
            layers.extend(span)
        return layers

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


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _kind(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, bool):
        return f"a boolean ({value})"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    return f"{type(value).__name__} {_quote(value)}"
