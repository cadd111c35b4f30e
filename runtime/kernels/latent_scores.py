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

import torch

from runtime.kernels import native_build

SOURCE = native_build.NATIVE / "latent_scores.c"


@dataclass(frozen=True)
class LatentKeys:
    """How a layer's keys come from its latents, as ``latent_attention`` takes them: z_k's
    columns ``copied`` (first, count), then row[:r_k] · u_rest [r_k, upad]; the tables
    cos, sin [≥ L, wpad] of the step (``KeyAngles.tables``); each key column's dim and KV
    head (int64 [width])."""

    r_k: int
    copied: tuple[int, int]
    u_rest: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    dims: torch.Tensor
    heads: torch.Tensor


@dataclass(frozen=True)
class LatentScoresLibrary:
    """The loaded library: its vector width (columns are padded to a multiple of it) and
    the most key columns (with padding) one call takes."""

    lib: ctypes.CDLL
    width: int
    max_width: int

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
        _check("latent scores", checks | _row_checks(rows, slots, lengths, r_k))
        operands = (u_rest, cos, sin, queries)
        u_rest, cos, sin, queries = (t.contiguous() for t in operands)
        slots, lengths = slots.contiguous(), lengths.to(torch.int64).contiguous()
        out = torch.empty(batch, heads, length, dtype=torch.float32)
        failed = self.lib.latent_scores(
            rows.data_ptr(), rows.shape[0], rows.stride(0), slots.data_ptr(), batch, length,
            lengths.data_ptr(), r_k, first, copies, u_rest.data_ptr(), upad,
            cos.data_ptr(), sin.data_ptr(), queries.data_ptr(), heads, wpad, out.data_ptr(),
        )  # fmt: skip
        _check("latent scores", {"slots within the cache's rows": failed != -1})
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
        _check("latent values", checks | _row_checks(rows, slots, lengths, r_k))
        probs, slots = probs.contiguous(), slots.contiguous()
        lengths = lengths.to(torch.int64).contiguous()
        out = torch.empty(batch, heads, r_v, dtype=torch.float32)
        failed = self.lib.latent_values(
            probs.data_ptr(), rows.data_ptr(), rows.shape[0], rows.stride(0), slots.data_ptr(),
            batch, length, lengths.data_ptr(), r_k, r_v, heads, out.data_ptr(),
        )  # fmt: skip
        _check("latent values", {"slots within the cache's rows": not failed})
        return out

    def attention(
        self,
        q: torch.Tensor,
        new: tuple[torch.Tensor, torch.Tensor],
        rows: torch.Tensor,
        slots: torch.Tensor,
        lengths: torch.Tensor,
        keys: LatentKeys,
        values: tuple[torch.Tensor, torch.Tensor | None],
        scale: float,
    ) -> torch.Tensor:
        """A latent layer's decode attention in one call: rows ``new`` = (latents [B, r_k +
        r_v], slots [B]) written to the cache ``rows`` first; then queries q [B, H, d]
        (RoPE applied) laid out as ``keys`` says, scaled, scored as ``scores`` scores,
        softmax, · z_v as ``values``, times each KV head's U_v: ``values`` = (U_v
        [kv_heads, r_v, d], bias [kv_heads · d] or None) -> [B, H, d]."""
        (latents, new_slots), (u_v, bias_v) = new, values
        (batch, length), (heads, d), r_k = slots.shape, q.shape[1:], keys.r_k
        kv_heads, r_v = u_v.shape[0], u_v.shape[1]
        wpad, width, (first, copies) = keys.cos.shape[1], keys.dims.numel(), keys.copied
        operands = (q, latents, rows, u_v, keys.u_rest, keys.cos, keys.sin)
        checks = {
            "fp32 operands": all(t.dtype == torch.float32 for t in operands)
            and (bias_v is None or bias_v.dtype == torch.float32),
            "q [B, H, d] with whole KV head groups": q.shape[0] == batch and heads % kv_heads == 0,
            "row-contiguous new latents [B, r_k + r_v]": latents.shape == (batch, r_k + r_v)
            and latents.stride(1) == 1,
            "cache rows of r_k + r_v": rows.shape[-1] == r_k + r_v,
            "U_v [kv_heads, r_v, d]": u_v.shape[2] == d,
            "int64 new slots [B]": new_slots.dtype == torch.int64 and new_slots.shape == (batch,),
            "int64 key dims and heads [width ≤ wpad]": keys.dims.dtype == torch.int64
            and keys.heads.dtype == torch.int64
            and keys.heads.numel() == width <= wpad,
            "bias_v [kv_heads · d]": bias_v is None or bias_v.numel() == kv_heads * d,
        }
        checks |= self._key_checks(r_k, keys.copied, keys.u_rest, keys.cos, rows, length, wpad)
        _check("latent attention", checks | _row_checks(rows, slots, lengths, r_k))
        tensors = (q, u_v, keys.u_rest, keys.cos, keys.sin, slots, new_slots)
        q, u_v, u_rest, cos, sin, slots, new_slots = (t.contiguous() for t in tensors)
        bias = None if bias_v is None else bias_v.contiguous()
        lengths = lengths.to(torch.int64).contiguous()
        out = torch.empty(batch, heads, d, dtype=torch.float32)
        failed = self.lib.latent_attention(
            q.data_ptr(), heads, d, scale, keys.dims.data_ptr(), keys.heads.data_ptr(), width,
            rows.data_ptr(), rows.shape[0], rows.stride(0), latents.data_ptr(),
            latents.stride(0), new_slots.data_ptr(), slots.data_ptr(), batch, length,
            lengths.data_ptr(), r_k, r_v, first, copies, u_rest.data_ptr(), u_rest.shape[1],
            cos.data_ptr(), sin.data_ptr(), wpad, kv_heads, u_v.data_ptr(),
            None if bias is None else bias.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        if failed == -2:
            raise MemoryError("latent attention: no scratch memory")
        _check("latent attention", {"slots within the cache's rows": not failed})
        return out


def _row_checks(rows: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, r_k: int):
    return {
        "row-contiguous cache rows [slots, ·] on the CPU": rows.dim() == 2
        and rows.stride(1) == 1
        and rows.device.type == "cpu",
        "rows of at least r_k": rows.shape[-1] >= r_k,
        "int64 slots [B, L]": slots.dtype == torch.int64 and slots.dim() == 2,
        "one length per sequence": lengths.shape == slots.shape[:1],
    }


def _check(what: str, checks: dict[str, bool]) -> None:
    wrong = [name for name, holds in checks.items() if not holds]
    if wrong:
        raise ValueError(f"{what}: need {', '.join(wrong)}")


def build_library(
    compiler: str, target: Path, flags: tuple[str, ...] = native_build.FLAGS
) -> LatentScoresLibrary:
    """Compile the source to ``target`` (unless it is there) and load it."""
    return _configured(native_build.compile_and_load(compiler, SOURCE, target, flags))


def _configured(lib: ctypes.CDLL) -> LatentScoresLibrary:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.latent_scores.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, ptr]
    lib.latent_scores.argtypes += [i64, ptr, ptr, ptr, i64, i64, ptr]
    lib.latent_values.argtypes = [ptr, ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, ptr]
    lib.latent_attention.argtypes = [ptr, i64, i64, ctypes.c_float, ptr, ptr, i64, ptr, i64, i64]
    lib.latent_attention.argtypes += [ptr, i64, ptr, ptr, i64, i64, ptr, i64, i64, i64, i64, ptr]
    lib.latent_attention.argtypes += [i64, ptr, ptr, i64, i64, ptr, ptr, ptr]
    lib.latent_scores.restype = lib.latent_values.restype = ctypes.c_int
    lib.latent_attention.restype = ctypes.c_int
    return LatentScoresLibrary(lib, int(lib.latent_width()), int(lib.latent_max_width()))


@functools.cache
def latent_scores_library() -> LatentScoresLibrary | None:
    """The library for this CPU (``native_build.cached_library``), or None where it did
    not build."""
    lib = native_build.cached_library(SOURCE, "latent scores")
    return None if lib is None else _configured(lib)
