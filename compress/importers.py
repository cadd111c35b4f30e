"""``deinfer import``: checkpoints other low-rank tools publish, read into our format
(``<proj>.v.weight`` = Dᵀ [r, in], ``<proj>.u.weight`` = Uᵀ [out, r], ``<proj>.u.bias``)
with a spec holding their per-layer ranks. Only safetensors and JSON are read: a
pickle (``.bin``, ``.pt``) is refused, never loaded.

Layouts, per projection ``P`` at module path ``…/<name>`` of the transformers model:

* ``svd-llm`` (SVD-LLM, ``component/svd_*.py``): ``…/<stem>_v_proj`` [r, in] then
  ``…/<stem>_u_proj`` [out, r] beside the layer's other modules, where ``<stem>`` is
  the name without ``_proj`` (q, k, v, o, out, gate, up, down; fc1/fc2 keep their
  name). Both factors may carry a bias (OPT); v's is folded into u's: y = (x·Vᵀ + b_v)·Uᵀ
  + b_u = x·Vᵀ·Uᵀ + (U·b_v + b_u). Ranks are not recorded: they are the factors' shapes.
* ``asvd`` (ASVD, ``huggingface_repos/modeling_asvd_*.py``): ``P.BLinear.weight``
  [r, in] and ``P.ALinear.weight`` [out, r] (+ ``P.ALinear.bias``); config.json
  ``truncation_ranks`` maps each decomposed module path to its rank.
* ``palu-headwise`` (Palu, ``HeadwiseLowRankModule``): ``P.VT.weight`` [Σr_g, in] and,
  per head group g, ``P.U.<g>.weight`` [out/G, r_g] (+ ``P.U.<g>.bias``); config.json
  ``head_wise_ranks`` maps each module path to its list of group ranks. Our rank is
  Σr_g and U is the block diagonal of the groups' U_g: the products are identical.

A projection stored whole (``P.weight``) stays dense.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from compress.output import (
    FORMAT,
    DecomposedWriter,
    check_output_folder,
    staged_folder,
)
from dsl import Spec, parse_spec
from dsl.errors import UserError
from dsl.spec import ModelConfig
from runtime.model.checkpoint import CheckpointError, CheckpointReader, Names, names_for

FORMATS = ("svd-llm", "asvd", "palu-headwise", "gguf")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
# model_type prefixes the tools give their configs (Palu: "palullama").
TYPE_PREFIXES = ("palu", "asvd", "svd")

Factors = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # Dᵀ [r,in], Uᵀ [out,r], bias

IMPORT_TOOL = "deinfer import"


def read_source_config(src: Path) -> dict[str, Any]:
    if not src.is_dir():
        raise UserError(f"{src}: not a checkpoint folder")
    pickles = sorted(p.name for p in src.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles and not any(src.glob("*.safetensors")):
        raise UserError(
            f"{src / pickles[0]}: a pickle file; it is never loaded (it can run code). "
            "Export the state dict with safetensors.torch.save_file and import that folder"
        )
    path = src / "config.json"
    if not path.is_file():
        raise UserError(f"{src}: no config.json")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(config, dict):
        raise UserError(f"{path}: expected a JSON object")
    model_type = str(config.get("model_type", ""))
    for prefix in TYPE_PREFIXES:
        if model_type.startswith(prefix) and model_type != prefix:
            config = {**config, "model_type": model_type.removeprefix(prefix)}
    return config


class Layout:
    """How one tool stores a projection's factors."""

    def __init__(self, reader: CheckpointReader, config: dict[str, Any]) -> None:
        self.reader, self.config = reader, config

    def has(self, name: str) -> bool:
        return name in self.reader.file_of

    def factors(self, module: str) -> Factors | None:  # None: not decomposed
        raise NotImplementedError

    def tensor(self, name: str, shape: tuple[int | None, ...] | None = None) -> torch.Tensor:
        t = self.reader.read(name)
        if shape is not None and (
            t.dim() != len(shape)
            or any(w is not None and w != f for w, f in zip(shape, t.shape, strict=False))
        ):
            want = [("r" if w is None else w) for w in shape]
            raise CheckpointError(f"tensor {name}: expected shape {want}, found {list(t.shape)}")
        return t


class SvdLlmLayout(Layout):
    def factors(self, module: str) -> Factors | None:
        parent, _, leaf = module.rpartition(".")
        stem = leaf.removesuffix("_proj")
        u_name, v_name = f"{parent}.{stem}_u_proj", f"{parent}.{stem}_v_proj"
        if not self.has(f"{u_name}.weight"):
            return None
        v = self.tensor(f"{v_name}.weight")
        u = self.tensor(f"{u_name}.weight")
        if v.dim() != 2 or u.dim() != 2 or u.shape[1] != v.shape[0]:
            raise CheckpointError(
                f"tensors {u_name}.weight {list(u.shape)} and {v_name}.weight "
                f"{list(v.shape)}: expected [out, r] and [r, in]"
            )
        bias = self.tensor(f"{u_name}.bias") if self.has(f"{u_name}.bias") else None
        if self.has(f"{v_name}.bias"):
            folded = u @ self.tensor(f"{v_name}.bias", (v.shape[0],))
            bias = folded if bias is None else bias + folded
        return v, u, bias


class RankedLayout(Layout):
    """A layout whose config.json maps each decomposed module path to its rank(s)."""

    RANKS_KEY = ""
    TOOL = ""
    MARKER = ""  # a tensor suffix only a decomposed module has

    def __init__(self, reader: CheckpointReader, config: dict[str, Any]) -> None:
        super().__init__(reader, config)
        ranks = config.get(self.RANKS_KEY)
        if not isinstance(ranks, dict):
            raise UserError(
                f"config.json has no {self.RANKS_KEY} mapping (not a {self.TOOL} checkpoint?)"
            )
        self.ranks = ranks

    def ranks_of(self, module: str) -> Any:
        """The config's rank entry of ``module``; None when it stays dense."""
        if module not in self.ranks:
            if self.has(f"{module}.{self.MARKER}"):
                raise UserError(f"config.json {self.RANKS_KEY}: missing {module}")
            return None
        return self.ranks[module]


class AsvdLayout(RankedLayout):
    RANKS_KEY, TOOL, MARKER = "truncation_ranks", "ASVD", "BLinear.weight"

    def factors(self, module: str) -> Factors | None:
        r = self.ranks_of(module)
        if r is None:
            return None
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise UserError(f"config.json truncation_ranks.{module}: expected a positive integer")
        v = self.tensor(f"{module}.BLinear.weight", (r, None))
        u = self.tensor(f"{module}.ALinear.weight", (None, r))
        bias_name = f"{module}.ALinear.bias"
        return v, u, self.tensor(bias_name) if self.has(bias_name) else None


class PaluLayout(RankedLayout):
    RANKS_KEY, TOOL, MARKER = "head_wise_ranks", "Palu", "VT.weight"

    def factors(self, module: str) -> Factors | None:
        groups = self.ranks_of(module)
        if groups is None:
            return None
        if (
            not isinstance(groups, list)
            or not groups
            or not all(isinstance(r, int) and not isinstance(r, bool) and r > 0 for r in groups)
        ):
            raise UserError(
                f"config.json head_wise_ranks.{module}: expected a list of positive integers"
            )
        total = sum(groups)
        vt = self.tensor(f"{module}.VT.weight", (total, None))
        blocks = [self.tensor(f"{module}.U.{g}.weight", (None, r)) for g, r in enumerate(groups)]
        if len({b.shape[0] for b in blocks}) != 1:
            raise CheckpointError(f"tensors {module}.U.*.weight: groups of unequal output width")
        u = torch.block_diag(*blocks)  # [out, Σr]: group g reads only its own latents
        biases = [f"{module}.U.{g}.bias" for g in range(len(groups))]
        bias = torch.cat([self.tensor(b) for b in biases]) if self.has(biases[0]) else None
        return vt, u, bias


LAYOUTS = {"svd-llm": SvdLlmLayout, "asvd": AsvdLayout, "palu-headwise": PaluLayout}


def _layer_tensors(
    layout, m: ModelConfig, names: Names, i: int
) -> tuple[dict[str, torch.Tensor], dict[str, int | None]]:
    """Layer ``i``'s projections in our format (factors or dense), with their ranks."""
    tensors: dict[str, torch.Tensor] = {}
    ranks: dict[str, int | None] = {}
    for matrix in m.matrices:
        module = names.layer(i, matrix)
        n_in, n_out = m.matrix_shape(matrix)
        found = layout.factors(module)
        if found is None:
            tensors[f"{module}.weight"] = layout.tensor(f"{module}.weight", (n_out, n_in))
            if layout.has(f"{module}.bias"):
                tensors[f"{module}.bias"] = layout.tensor(f"{module}.bias", (n_out,))
            ranks[matrix] = None
            continue
        v, u, bias = found
        r = v.shape[0]
        if tuple(v.shape) != (r, n_in) or tuple(u.shape) != (n_out, r):
            raise CheckpointError(
                f"{module}: factors {list(u.shape)}·{list(v.shape)}, expected "
                f"[{n_out}, r]·[r, {n_in}]"
            )
        if r > min(n_in, n_out):
            raise CheckpointError(f"{module}: rank {r} exceeds min(in, out) = {min(n_in, n_out)}")
        tensors[f"{module}.v.weight"] = v
        tensors[f"{module}.u.weight"] = u
        if bias is not None:
            tensors[f"{module}.u.bias"] = bias
        ranks[matrix] = r
    return tensors, ranks


def _base_spec(config: dict, src: Path, name: str) -> tuple[str, Spec]:
    """The source model's spec text (ranks still to be filled in) and its parse."""
    from compress.decompose import HF_FAMILIES, spec_yaml

    try:
        text = spec_yaml(config, name, 0.0, "smaller_dim_fraction", 1, 1)
    except KeyError as exc:
        raise UserError(f"{src / 'config.json'}: missing field {exc}") from None
    if config.get("model_type") not in HF_FAMILIES:
        raise UserError(
            f"config.json model_type {config.get('model_type')!r} is not one of "
            f"{', '.join(HF_FAMILIES)}"
        )
    return text, parse_spec(text, default_name=name)


def _config_record(config: dict, spec: Spec, fmt: str) -> dict:
    """config.json of the imported checkpoint: the source's, without its remote-code
    fields, plus our format's record."""
    dropped = ("truncation_ranks", "head_wise_ranks", "auto_map", "architectures")
    clean = {k: v for k, v in config.items() if k not in dropped}
    clean["torch_dtype"] = "float32"
    clean["deinfer"] = {
        "format": FORMAT,
        "spec": spec.name,
        "ranks": [layer.as_dict() for layer in spec.decomposition.layers],
        "method": f"import:{fmt}",
    }
    return clean


def import_checkpoint(
    fmt: str,
    src: str | Path,
    out: str | Path,
    spec_out: str | Path,
    name: str | None = None,
    force: bool = False,
) -> tuple[Path, Path]:
    """Read ``src`` (layout ``fmt``) into a decomposed checkpoint at ``out`` and its spec
    at ``spec_out`` (``out``: a new or empty folder, or one this importer wrote; any other
    with ``force``)."""
    from compress.allocate import allocated_spec_yaml
    from compress.decompose import copy_tokenizer, layer_norm_names, model_level_names

    if fmt not in LAYOUTS:
        raise UserError(f"--format must be one of {', '.join(FORMATS)}, found {fmt!r}")
    src, out, spec_out = Path(src), Path(out), Path(spec_out)
    check_output_folder(out, IMPORT_TOOL, (src,), force)
    config = read_source_config(src)
    base_text, base = _base_spec(config, src, name or spec_out.stem)
    m, names = base.model, names_for(base.model)
    reader = CheckpointReader(src)
    layout = LAYOUTS[fmt](reader, config)
    ranks: list[dict[str, int | None]] = []
    with staged_folder(out, IMPORT_TOOL, (src,), force) as tmp:
        writer = DecomposedWriter(tmp, m.num_layers + 1, torch.float32)
        for i in range(m.num_layers):
            tensors, layer_ranks = _layer_tensors(layout, m, names, i)
            tensors.update({k: reader.read(k) for k in layer_norm_names(m, names, i)})
            writer.write(tensors)
            ranks.append(layer_ranks)
        writer.write({k: reader.read(k) for k in model_level_names(m, names)})
        note = f"imported by deinfer import --format {fmt} from {src.name}"
        spec_text = allocated_spec_yaml(base_text, base.name, ranks, note)
        spec = parse_spec(spec_text, default_name=base.name)  # must load before anything lands
        writer.finish(_config_record(config, spec, fmt))
        copy_tokenizer(src, tmp)
        spec_out.parent.mkdir(parents=True, exist_ok=True)
        spec_out.write_text(spec_text)
    return out, spec_out
