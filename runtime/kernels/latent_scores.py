"""The native latent scores (``native/latent_scores.c``): a latent decode step's keys
rebuilt, rotated and scored in one pass, and the probabilities' product with z_v, both
reading the latents where they lie in the cache, and the layer's whole decode attention
around them in one call (``attention``); built once per machine (``native_build``).
Where it did not build, or for operands it does not take (not fp32, no RoPE, a bias or
a norm on k), decode uses torch's form (``LatentFactors.key_parts``)."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from runtime.kernels import native_build
from runtime.kernels.latent_operands import (
    LatentLayer,
    LatentStep,
    call_checks,
    call_fits,
    check,
    row_checks,
)

SOURCE = native_build.NATIVE / "latent_scores.c"


@dataclass(frozen=True)
class LatentScoresLibrary:
    """The loaded library: its vector width (columns are padded to a multiple of it) and
    the most key columns (with padding) one call takes."""

    lib: ctypes.CDLL
    width: int
    max_width: int
    attention_address: int  # ``latent_attention``'s, for a native caller (``LatentAttention``)

    def padded(self, columns: int) -> int:
        return -(-columns // self.width) * self.width

    def scores(
        self,
        rows: torch.Tensor,
        slots: torch.Tensor,
        lengths: torch.Tensor,
        r_k: int,
        copied: tuple[int, int],
        u_rest: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        queries: torch.Tensor,
    ) -> torch.Tensor:
        """Scores [B, H, L] (-inf past ``lengths`` [B]) of ``queries`` [B, H, wpad] against
        the keys of each sequence's tokens, token j of sequence b at row ``slots`` [B,
        L][b, j] of the cache ``rows`` [slots, ≥ r_k] (row-contiguous; read in place):
        its columns ``copied`` = (first, count), then row[:r_k] · u_rest [r_k, upad];
        pairs rotated by cos, sin [≥ L, wpad] (``KeyAngles.tables``)."""
        (batch, length), heads, wpad = slots.shape, queries.shape[1], queries.shape[2]
        (first, copies), upad = copied, u_rest.shape[1]
        fp32 = all(t.dtype == torch.float32 for t in (rows, u_rest, cos, sin, queries))
        key_checks = self._key_checks(r_k, copied, u_rest, cos, rows, length, wpad)
        checks = {"fp32 operands": fp32} | key_checks
        check("latent scores", checks | row_checks(rows, slots, lengths, r_k))
        operands = (u_rest, cos, sin, queries)
        u_rest, cos, sin, queries = (t.contiguous() for t in operands)
        slots, lengths = slots.contiguous(), lengths.to(torch.int64).contiguous()
        out = torch.empty(batch, heads, length, dtype=torch.float32)
        failed = self.lib.latent_scores(
            rows.data_ptr(), rows.shape[0], rows.stride(0), slots.data_ptr(), batch, length,
            lengths.data_ptr(), r_k, first, copies, u_rest.data_ptr(), upad,
            cos.data_ptr(), sin.data_ptr(), queries.data_ptr(), heads, wpad, out.data_ptr(),
        )  # fmt: skip
        check("latent scores", {"slots within the cache's rows": failed != -1})
        if failed:
            raise MemoryError("latent scores: no scratch memory")
        return out

    def _key_checks(self, r_k, copied, u_rest, cos, rows, length: int, wpad: int) -> dict:
        """What ``latent_scores`` needs of the keys' operands (``scores``' arguments)."""
        (first, copies), upad = copied, u_rest.shape[1]
        return {
            "even copies within a row": copies % 2 == 0 and first + copies <= rows.shape[-1],
            "u_rest [r_k, padded]": u_rest.shape[0] == r_k and upad % self.width == 0,
            "padded queries": wpad % self.width == 0 and wpad >= copies,
            f"at most {self.max_width} columns": copies + upad <= self.max_width,
            "tables [≥ L, wpad]": cos.shape[0] >= length and cos.shape[1] == wpad,
        }

    def values(
        self,
        probs: torch.Tensor,
        rows: torch.Tensor,
        slots: torch.Tensor,
        lengths: torch.Tensor,
        r_k: int,
    ) -> torch.Tensor:
        """probs [B, H, L] · z_v [B, H, r_v] of the same tokens as ``scores`` (z_v: a
        row's columns r_k.., read in place), over each sequence's first ``lengths``."""
        (batch, length), heads = slots.shape, probs.shape[1]
        r_v = rows.shape[-1] - r_k
        checks = {
            "fp32 operands": probs.dtype == rows.dtype == torch.float32,
            "probs [B, H, L]": probs.shape[0] == batch and probs.shape[2] == length,
            "some z_v columns": r_v > 0,
        }
        check("latent values", checks | row_checks(rows, slots, lengths, r_k))
        probs, slots = probs.contiguous(), slots.contiguous()
        lengths = lengths.to(torch.int64).contiguous()
        out = torch.empty(batch, heads, r_v, dtype=torch.float32)
        failed = self.lib.latent_values(
            probs.data_ptr(), rows.data_ptr(), rows.shape[0], rows.stride(0), slots.data_ptr(),
            batch, length, lengths.data_ptr(), r_k, r_v, heads, None, 0, out.data_ptr(),
        )  # fmt: skip
        check("latent values", {"slots within the cache's rows": not failed})
        return out

    def layer(
        self,
        r_k: int,
        copied: tuple[int, int],
        u_rest: torch.Tensor,
        dims: torch.Tensor,
        heads: torch.Tensor,
        u_v: torch.Tensor,
        bias_v: torch.Tensor | None,
    ) -> LatentLayer:
        """A layer's ``LatentLayer``, checked: what ``attention`` would otherwise check at
        every call of every layer (a latent step's Python between its native calls was
        ~6 ms more than a dense-KV step's; cpu-135m, 30 layers)."""
        (first, copies), width = copied, dims.numel()
        wpad = self.padded(width)
        checks = {
            "fp32 operands": u_rest.dtype == u_v.dtype == torch.float32
            and (bias_v is None or bias_v.dtype == torch.float32),
            "even copies within z_k": copies % 2 == 0 and first + copies <= r_k,
            "u_rest [r_k, padded]": u_rest.shape[0] == r_k and u_rest.shape[1] % self.width == 0,
            f"at most {self.max_width} columns": copies + u_rest.shape[1] <= self.max_width,
            "int64 key dims and heads [width]": dims.dtype == heads.dtype == torch.int64
            and heads.numel() == width >= copies,
            "U_v [kv_heads, r_v, d]": u_v.dim() == 3,
            "bias_v [kv_heads · d]": bias_v is None
            or (u_v.dim() == 3 and bias_v.numel() == u_v.shape[0] * u_v.shape[2]),
        }
        check("latent attention", checks)
        tensors = (u_rest, dims, heads, u_v) + (() if bias_v is None else (bias_v,))
        u_rest, dims, heads, u_v, *bias = (t.contiguous() for t in tensors)
        bias_v = bias[0] if bias else None
        return LatentLayer(r_k, copied, u_rest, dims, heads, u_v, bias_v, wpad, value_rows(u_v))

    def attention(
        self,
        q: torch.Tensor,
        latents: torch.Tensor,
        rows: torch.Tensor,
        layer: LatentLayer,
        step: LatentStep,
        tables: tuple[torch.Tensor, torch.Tensor],
        scale: float,
    ) -> torch.Tensor:
        """A latent layer's decode attention in one call: ``latents`` [B, r_k + r_v] (row
        b at ``step``'s new slot b) written to the cache ``rows`` first; then queries q
        [B, H, d] (RoPE applied) laid out as ``layer``'s keys, scaled, scored as
        ``scores`` scores (``tables`` = cos, sin [≥ L, wpad], ``KeyAngles.tables``) against
        ``step``'s tokens, softmax, · z_v as ``values``, times each KV head's U_v -> [B,
        H, d]. Checked here: what changes between calls (one boolean; the message only on
        failure)."""
        cos, sin = tables
        batch, heads, d = q.shape
        if not call_fits(q, latents, rows, layer, step, tables):
            check("latent attention", call_checks(q, latents, rows, layer, step, tables))
            raise ValueError("latent attention: operands it does not take")
        out = torch.empty(batch, heads, d, dtype=torch.float32)
        failed = self.lib.latent_attention(
            layer.address, step.address, q.data_ptr(), heads, d, scale, rows.data_ptr(),
            rows.shape[0], rows.stride(0), latents.data_ptr(), latents.stride(0),
            cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        if failed == -2:
            raise MemoryError("latent attention: no scratch memory")
        check("latent attention", {"slots within the cache's rows": not failed})
        return out


class LatentAttention(NamedTuple):
    """One layer's latent attention as another native call makes it (``DecodeBlockLibrary.
    latent_attention``): the library, the layer's and the step's descriptors, the layer's
    cache rows, the keys' RoPE tables (``KeyAngles.tables``) and the scale."""

    library: LatentScoresLibrary
    layer: LatentLayer
    step: LatentStep
    rows: torch.Tensor
    tables: tuple[torch.Tensor, torch.Tensor]
    scale: float


def value_rows(u_v: torch.Tensor) -> torch.Tensor:
    """Per KV head of u_v [kv_heads, r_v, d]: (first, count) of the rows from its first
    row that is not all zero to its last (0, 0 where all are zero), int64 [kv_heads, 2]."""
    live = (u_v != 0).any(-1)  # [kv_heads, r_v]
    index = torch.arange(u_v.shape[1])
    first = torch.where(live, index, u_v.shape[1]).amin(-1)
    end = torch.where(live, index + 1, 0).amax(-1)
    first = torch.minimum(first, end)
    return torch.stack([first, end - first], -1).contiguous()


def build_library(
    compiler: str, target: Path, flags: tuple[str, ...] = native_build.FLAGS
) -> LatentScoresLibrary:
    """Compile the source to ``target`` (unless it is there) and load it."""
    return _configured(native_build.compile_and_load(compiler, SOURCE, target, flags))


def _configured(lib: ctypes.CDLL) -> LatentScoresLibrary:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.latent_scores.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, ptr]
    lib.latent_scores.argtypes += [i64, ptr, ptr, ptr, i64, i64, ptr]
    lib.latent_values.argtypes = [ptr, ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, i64]
    lib.latent_values.argtypes += [ptr, i64, ptr]
    lib.latent_attention.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float, ptr, i64, i64]
    lib.latent_attention.argtypes += [ptr, i64, ptr, ptr, ptr]
    lib.latent_scores.restype = lib.latent_values.restype = ctypes.c_int
    lib.latent_attention.restype = ctypes.c_int
    address = ctypes.cast(lib.latent_attention, ctypes.c_void_p).value
    return LatentScoresLibrary(lib, int(lib.latent_width()), int(lib.latent_max_width()), address)


@functools.cache
def latent_scores_library() -> LatentScoresLibrary | None:
    """The library for this CPU (``native_build.cached_library``), or None where it did
    not build."""
    lib = native_build.cached_library(SOURCE, "latent scores")
    return None if lib is None else _configured(lib)
