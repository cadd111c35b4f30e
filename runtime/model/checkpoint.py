"""Decomposed checkpoints: HF-style folders (config.json + safetensors, optionally
sharded with an index), read slice by slice so each rank loads only its part.

Format: a decomposed projection is ``<proj>.v.weight`` = Dᵀ [r, in] and
``<proj>.u.weight`` = Uᵀ [out, r] (+ ``<proj>.u.bias``); an undecomposed one keeps
``<proj>.weight`` [out, in] (+ ``<proj>.bias``). Names follow transformers' modules of
each family. Stored tensors are the transpose of our math layout (D [in, r],
U [r, out], W [in, out]), so a math column slice is a stored row slice.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from dsl.errors import UserError
from dsl.spec import ModelConfig, Spec
from runtime.model.shard import pad_dim

FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# A weight this far from its tensor's scale is a corrupted value, not a trained one (a
# finite 3e38 loaded and the model emitted token 0 forever): the largest |w| / RMS of
# any tensor of SmolLM2-135M is 51 (layer 27's gate), its largest |w| 9.25, and no
# trained weight nears fp16's largest value, past which half-precision activations
# overflow.
MAX_WEIGHT_OVER_RMS = 1e4
MAX_WEIGHT = 65504.0
log = logging.getLogger("deinfer.checkpoint")


class CheckpointError(UserError):
    """A checkpoint does not match its spec or is unreadable; the message names the tensor."""


@dataclass(frozen=True)
class Names:
    """transformers tensor names of one model family."""

    layer_prefix: str
    modules: dict[str, str]  # our matrix / norm name -> module path inside a layer
    embed: str
    positions: str | None
    final_norm: str
    lm_head: str

    def layer(self, index: int, name: str) -> str:
        return f"{self.layer_prefix}{index}.{self.modules[name]}"


LLAMA_NAMES = Names(
    layer_prefix="model.layers.",
    modules={
        "q": "self_attn.q_proj",
        "k": "self_attn.k_proj",
        "v": "self_attn.v_proj",
        "o": "self_attn.o_proj",
        "gate": "mlp.gate_proj",
        "up": "mlp.up_proj",
        "down": "mlp.down_proj",
        "input_norm": "input_layernorm",
        "post_norm": "post_attention_layernorm",
        "q_norm": "self_attn.q_norm",
        "k_norm": "self_attn.k_norm",
    },
    embed="model.embed_tokens.weight",
    positions=None,
    final_norm="model.norm",
    lm_head="lm_head.weight",
)
OPT_NAMES = Names(
    layer_prefix="model.decoder.layers.",
    modules={
        "q": "self_attn.q_proj",
        "k": "self_attn.k_proj",
        "v": "self_attn.v_proj",
        "o": "self_attn.out_proj",
        "fc1": "fc1",
        "fc2": "fc2",
        "input_norm": "self_attn_layer_norm",
        "post_norm": "final_layer_norm",
    },
    embed="model.decoder.embed_tokens.weight",
    positions="model.decoder.embed_positions.weight",
    final_norm="model.decoder.final_layer_norm",
    lm_head="lm_head.weight",
)


def names_for(model: ModelConfig) -> Names:
    return OPT_NAMES if model.family == "opt" else LLAMA_NAMES


def expected_tensors(spec: Spec) -> dict[str, tuple[int, ...]]:
    """Every tensor a decomposed checkpoint of ``spec`` holds, with its stored shape."""
    m = spec.model
    names = names_for(m)
    out: dict[str, tuple[int, ...]] = {names.embed: (m.vocab_size, m.hidden_size)}
    if not m.tie_word_embeddings:
        out[names.lm_head] = (m.vocab_size, m.hidden_size)
    if names.positions:
        out[names.positions] = (m.max_position_embeddings + m.positions.offset, m.hidden_size)
    norm_parts = ("weight", "bias") if m.norm.kind == "layer" else ("weight",)
    for part in norm_parts:
        out[f"{names.final_norm}.{part}"] = (m.hidden_size,)
    for i, layer in enumerate(spec.decomposition.layers):
        for name in m.matrices:
            n_in, n_out = m.matrix_shape(name)
            base = names.layer(i, name)
            r = layer.rank(name)
            if r is None:
                out[f"{base}.weight"] = (n_out, n_in)
                bias = f"{base}.bias"
            else:
                out[f"{base}.v.weight"] = (r, n_in)
                out[f"{base}.u.weight"] = (n_out, r)
                bias = f"{base}.u.bias"
            if has_bias(m, name):
                out[bias] = (n_out,)
        for norm in ("input_norm", "post_norm"):
            for part in norm_parts:
                out[f"{names.layer(i, norm)}.{part}"] = (m.hidden_size,)
        if m.qk_norm:
            out[f"{names.layer(i, 'q_norm')}.weight"] = (m.head_dim,)
            out[f"{names.layer(i, 'k_norm')}.weight"] = (m.head_dim,)
    return out


def has_bias(m: ModelConfig, name: str) -> bool:
    return {"q": m.bias.qkv, "k": m.bias.qkv, "v": m.bias.qkv, "o": m.bias.o}.get(name, m.bias.mlp)


class CheckpointReader:
    """Lazy access to the tensors of a checkpoint folder (one file or an index). Every
    value read is checked: NaN or Inf is refused, and so is an absurd magnitude unless
    ``allow_extreme`` (then it is a warning)."""

    def __init__(self, folder: str | Path, allow_extreme: bool = False) -> None:
        self.folder = Path(folder)
        self.allow_extreme = allow_extreme
        if not self.folder.is_dir():
            raise CheckpointError(f"checkpoint folder not found: {self.folder}")
        index = self.folder / "model.safetensors.index.json"
        weight_map = _read_index(index, self.folder) if index.is_file() else None
        if weight_map is not None:
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no .safetensors file in {self.folder}")
        self._handles = {f: _open(self.folder / f) for f in files}
        self.file_of: dict[str, str] = {}
        for f, handle in self._handles.items():
            for key in handle.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
                if key in self.file_of:  # two copies: which is right is anyone's guess
                    raise CheckpointError(
                        f"tensor {key} is stored twice, in {self.file_of[key]} and {f}"
                    )
                if weight_map is not None and weight_map.get(key) != f:
                    raise CheckpointError(
                        f"tensor {key} is in {f}, but {index.name} puts it in "
                        f"{weight_map.get(key, 'no file')}"
                    )
                self.file_of[key] = f
        if weight_map is not None and (lost := sorted(set(weight_map) - set(self.file_of))):
            raise CheckpointError(
                f"{index.name} lists {lost[0]} in {weight_map[lost[0]]}, which does not hold it"
            )

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        return self._slice(name).get_dtype()

    def _slice(self, name: str):
        if name not in self.file_of:
            raise CheckpointError(f"missing tensor {name}")
        return self._handles[self.file_of[name]].get_slice(name)

    def read(
        self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """The stored tensor, or a [rows, cols] slice of it (ranges clipped to its size,
        the remainder zero-padded), as fp32, checked for NaN/Inf."""
        sl = self._slice(name)
        shape = sl.get_shape()
        if len(shape) == 1:
            lo, hi = rows or (0, shape[0])
            t = sl[min(lo, shape[0]) : min(hi, shape[0])]
            t = pad_dim(t, 0, hi - lo)
        else:
            r0, r1 = rows or (0, shape[0])
            c0, c1 = cols or (0, shape[1])
            t = sl[min(r0, shape[0]) : min(r1, shape[0]), min(c0, shape[1]) : min(c1, shape[1])]
            t = pad_dim(pad_dim(t, 0, r1 - r0), 1, c1 - c0)
        t = t.float()
        if not torch.isfinite(t).all():
            raise CheckpointError(f"tensor {name} contains NaN or Inf")
        self._check_magnitude(name, t)
        return t

    def _check_magnitude(self, name: str, t: torch.Tensor) -> None:
        peak = float(t.abs().max()) if t.numel() else 0.0
        if peak == 0.0:
            return
        norm = float(torch.linalg.vector_norm(t))
        if not math.isfinite(norm):  # a huge value's square overflows fp32: again in fp64
            norm = float(torch.linalg.vector_norm(t, dtype=torch.float64))
        rms = norm / math.sqrt(t.numel())
        if peak <= MAX_WEIGHT and peak <= MAX_WEIGHT_OVER_RMS * rms:
            return
        message = (
            f"tensor {name} holds a value of magnitude {peak:.3g}, {peak / rms:.3g} times "
            f"its RMS (the bounds: {MAX_WEIGHT:g}, and {MAX_WEIGHT_OVER_RMS:g} times the RMS)"
        )
        if not self.allow_extreme:
            raise CheckpointError(f"{message}; --allow-extreme-weights loads it anyway")
        log.warning("%s; loaded as asked (--allow-extreme-weights)", message)


def _read_index(index: Path, folder: Path) -> dict[str, str]:
    """The index's tensor -> shard map; every shard a plain file name inside ``folder``."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        reason = f"no {exc}" if isinstance(exc, KeyError) else type(exc).__name__
        raise CheckpointError(f"{index}: not a readable safetensors index ({reason})") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"{index}: weight_map must map tensor names to file names")
    root = folder.resolve()
    for name, shard in weight_map.items():
        where = (folder / shard).resolve()
        if Path(shard).is_absolute() or where.parent != root:
            raise CheckpointError(
                f"{index}: tensor {name} points outside the checkpoint folder ({shard[:80]!r})"
            )
    return weight_map


def _open(path: Path):
    """A safetensors file opened lazily; anything else (a pickle renamed .safetensors, a
    truncated file) is one clear error, and is never unpickled."""
    if not path.is_file():
        raise CheckpointError(f"{path}: listed in the index but missing")
    try:
        return safe_open(path, framework="pt")
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{path}: not a readable safetensors file ({reason})") from None


def validate(reader: CheckpointReader, spec: Spec) -> None:
    """Names, shapes and dtypes against the spec; the first problem raises."""
    want = expected_tensors(spec)
    have = set(reader.file_of)
    for name in sorted(want):
        if name not in have:
            raise CheckpointError(f"missing tensor {name} (expected shape {list(want[name])})")
    extra = sorted(have - set(want))
    if extra:
        raise CheckpointError(f"unexpected tensor {extra[0]} (not in spec {spec.name})")
    for name, shape in want.items():
        found = reader.shape(name)
        if found != shape:
            raise CheckpointError(
                f"tensor {name}: expected shape {list(shape)}, found {list(found)}"
                + _rank_hint(name, shape, found)
            )
        dtype = reader.dtype(name)
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"tensor {name}: dtype {dtype} is not F32, F16 or BF16")


def _rank_hint(name: str, want: tuple[int, ...], found: tuple[int, ...]) -> str:
    if name.endswith(".v.weight") and want[1:] == found[1:]:
        return f" (spec rank {want[0]}, checkpoint rank {found[0]})"
    if name.endswith(".u.weight") and want[:1] == found[:1]:
        return f" (spec rank {want[1]}, checkpoint rank {found[1]})"
    return ""


def has_tokenizer(folder: Path) -> bool:
    """Whether ``folder`` holds a tokenizer transformers can load."""
    return any((Path(folder) / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))
