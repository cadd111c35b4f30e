"""The native latent scores (``native/latent_scores.c``): a latent decode step's keys
rebuilt, rotated and scored in one pass, and the probabilities' product with z_v, both
reading the latents where they lie in the cache; built once per machine (``native_build``).
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
        checks = {
            "fp32 operands": fp32,
            "even copies within a row": copies % 2 == 0 and first + copies <= rows.shape[-1],
            "u_rest [r_k, padded]": u_rest.shape[0] == r_k and upad % self.width == 0,
            "padded queries": wpad % self.width == 0 and wpad >= copies,
            f"at most {self.max_width} columns": copies + upad <= self.max_width,
            "tables [≥ L, wpad]": cos.shape[0] >= length and cos.shape[1] == wpad,
        }
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
        _check("latent scores", {"slots within the cache's rows": not failed})
        return out

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
    lib.latent_scores.restype = lib.latent_values.restype = ctypes.c_int
    return LatentScoresLibrary(lib, int(lib.latent_width()), int(lib.latent_max_width()))


@functools.cache
def latent_scores_library() -> LatentScoresLibrary | None:
    """The library for this CPU (``native_build.cached_library``), or None where it did
    not build."""
    lib = native_build.cached_library(SOURCE, "latent scores")
    return None if lib is None else _configured(lib)
