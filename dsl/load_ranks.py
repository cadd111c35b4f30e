"""The ``decomposition`` section of a spec: default ranks from a ratio and a rule,
explicit ranks, per-layer overrides."""

from __future__ import annotations

import re
from typing import Any

from dsl.checks import Checks, _join, _kind
from dsl.errors import SpecError
from dsl.ranks import RULES, rank_from_ratio
from dsl.spec import Decomposition, LayerRanks, ModelConfig
from dsl.yaml_read import _quote

DENSE = "dense"


class RankParser(Checks):
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
