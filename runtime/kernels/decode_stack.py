"""A decode step's layers on one rank in one native call (``decode_layers`` of
``native/decode_block.c``): each layer's attention half and MLP half as the decode block
computes them (``decode_block``), one after the other, with no Python between them.
A layer's attention reads a dense cache (``DenseOperands``: ``decode_attention``'s) or a
latent one (``LatentOperands``: ``decode_latent_attention``'s, W_o then in the MLP
half's call). ``layer_array`` describes the layers (their norms, projections and cache
rows); ``DecodeBlockLibrary`` loads the entry point with the halves'."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from runtime.kernels.decode_block import DecodeBlockLibrary, Projection
from runtime.kernels.latent_operands import LatentLayer, LatentStep

_POINTER, _INT = ctypes.c_void_p, ctypes.c_int64


class _Layer(ctypes.Structure):
    """``layer_t`` of the C file."""

    _fields_ = [
        *((name, _POINTER) for name in ("input_norm", "qkv", "k_rows", "v_rows", "o", "q", "kv")),
        ("kv_first", _INT),
        *((name, _POINTER) for name in ("scores", "z")),
        *((name, _INT) for name in ("rows", "ldz")),
        *((name, _POINTER) for name in ("key_cos", "key_sin", "post_norm", "gate_up")),
        ("inter", _INT),
        ("down", _POINTER),
    ]


@dataclass(frozen=True)
class DenseOperands:
    """A layer's attention half over a dense cache: q|k|v, W_o, the K and V rows
    [slots, KV heads, head_dim]."""

    qkv: Projection
    o: Projection
    k_rows: torch.Tensor
    v_rows: torch.Tensor


@dataclass(frozen=True)
class LatentOperands:
    """A layer's attention half over a latent cache (``DecodeBlockLibrary.
    latent_attention``'s): q (None: q's up factor is ``kv``'s one member) and the k|v
    latent's projection, the new latents' first column, the native scores' layer, the
    cache rows [slots, r_k + r_v], the keys' RoPE tables; then W_o."""

    q: Projection | None
    kv: Projection
    kv_first: int
    scores: LatentLayer
    rows: torch.Tensor
    tables: tuple[torch.Tensor, torch.Tensor]
    o: Projection


@dataclass(frozen=True)
class StackLayer:
    """One layer's operands: its norms' weights, attention half, and MLP half (each
    projection whole: one rank)."""

    input_norm: torch.Tensor
    attention: DenseOperands | LatentOperands
    post_norm: torch.Tensor
    gate_up: Projection
    inter: int
    down: Projection


def _described(layer: StackLayer) -> _Layer:
    a, norms = layer.attention, (layer.input_norm.data_ptr(), layer.post_norm.data_ptr())
    if isinstance(a, DenseOperands):
        attention = (a.qkv.address, a.k_rows.data_ptr(), a.v_rows.data_ptr(), a.o.address)
        latent = (None, None, 0, None, None, 0, 0, None, None)
    else:
        attention = (None, None, None, a.o.address)
        rows, (cos, sin) = a.rows, a.tables
        latent = (
            None if a.q is None else a.q.address, a.kv.address, a.kv_first, a.scores.address,
            rows.data_ptr(), rows.shape[0], rows.stride(0), cos.data_ptr(), sin.data_ptr(),
        )  # fmt: skip
    mlp = (norms[1], layer.gate_up.address, layer.inter, layer.down.address)
    return _Layer(norms[0], *attention, *latent, *mlp)


def layer_array(layers: list[StackLayer]) -> ctypes.Array:
    """The C descriptors of ``layers`` (the caller keeps ``layers`` alive with it)."""
    return (_Layer * len(layers))(*[_described(layer) for layer in layers])


@dataclass(frozen=True)
class StepTokens:
    """A decode step's tokens, the same in every layer: for dense caches (new_slots [m],
    slots [m, L], lengths [m], int64, contiguous, within every layer's cache rows:
    ``DenseDecodeCache.checked``), for latent ones ``LatentStep`` (its slots checked by
    the call); None where no layer reads that kind."""

    dense: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    latent: LatentStep | None


def decode_layers(
    library: DecodeBlockLibrary,
    x: torch.Tensor,
    eps: float,
    layers: ctypes.Array,
    heads: tuple[int, int, int],
    rope: tuple[torch.Tensor, torch.Tensor, int],
    tokens: StepTokens,
    scale: float,
    attend: int | None = None,
) -> torch.Tensor:
    """x [m, h] (contiguous fp32, updated in place) through every layer of ``layers``
    (``layer_array``); the last layer's MLP output [m, h], which the caller adds to x.
    ``heads`` and ``rope`` as ``DecodeBlockLibrary.attention``'s; ``attend``: the native
    latent attention's address (``LatentScoresLibrary.attention_address``) where a layer
    reads a latent cache."""
    m, h = x.shape
    cos, sin, half = rope
    if not (x.dtype == torch.float32 and x.is_contiguous() and cos.numel() == sin.numel()):
        raise ValueError(f"decode layers: x must be a contiguous fp32 [m, h], found {x.shape}")
    dense = tokens.dense or (None, torch.zeros(m, 0, dtype=torch.long), None)
    if tokens.dense and not all(
        t.dtype == torch.int64 and t.is_contiguous() and len(t) == m for t in tokens.dense
    ):
        raise ValueError(f"decode layers: int64 slots and lengths of {m} rows")
    pointers = [None if t is None else t.data_ptr() for t in dense]
    step = None if tokens.latent is None else tokens.latent.address
    out = torch.empty(m, h)
    failed = library.lib.decode_layers(
        x.data_ptr(), m, h, eps, ctypes.addressof(layers), len(layers), *heads, cos.data_ptr(),
        sin.data_ptr(), half, pointers[0], pointers[1], dense[1].shape[1], pointers[2], attend,
        step, scale, out.data_ptr(),
    )  # fmt: skip
    if failed == -2:
        raise ValueError("latent attention: need slots within the cache's rows")
    if failed:
        raise MemoryError(f"decode layers: no scratch for {m} rows")
    return out
