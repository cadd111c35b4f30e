"""The native latent scores (``native/latent_scores.c``): a latent decode step's keys
rebuilt, rotated and scored in one pass, built once per machine (``native_build``).
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
        z: torch.Tensor,
        lengths: torch.Tensor,
        r_k: int,
        copied: tuple[int, int],
        u_rest: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        queries: torch.Tensor,
    ) -> torch.Tensor:
        """Scores [B, H, L] (-inf past ``lengths`` [B]) of ``queries`` [B, H, wpad] against
        the keys of z [B, L, ≥ r_k] (row-contiguous): its columns ``copied`` = (first,
        count), then z[..., :r_k] · u_rest [r_k, upad]; pairs rotated by cos, sin [≥ L,
        wpad] (``KeyAngles.tables``)."""
        batch, length, _ = z.shape
        heads, wpad = queries.shape[1], queries.shape[2]
        (first, copies), upad = copied, u_rest.shape[1]
        checks = {
            "fp32 operands": all(t.dtype == torch.float32 for t in (z, u_rest, cos, sin, queries)),
            "row-contiguous z": z.stride(-1) == 1 and z.stride(0) == length * z.stride(1),
            "even copies within z": copies % 2 == 0 and first + copies <= z.shape[-1],
            "u_rest [r_k, padded]": u_rest.shape[0] == r_k and upad % self.width == 0,
            "padded queries": wpad % self.width == 0 and wpad >= copies,
            f"at most {self.max_width} columns": copies + upad <= self.max_width,
            "tables [≥ L, wpad]": cos.shape[0] >= length and cos.shape[1] == wpad,
            "one length per sequence": lengths.shape == (batch,),
        }
        wrong = [what for what, holds in checks.items() if not holds]
        if wrong:
            raise ValueError(f"latent scores: need {', '.join(wrong)}")
        operands = (z, u_rest, cos, sin, queries)
        z, u_rest, cos, sin, queries = (t.contiguous() for t in operands)
        lengths = lengths.to(torch.int64).contiguous()
        out = torch.empty(batch, heads, length, dtype=torch.float32)
        self.lib.latent_scores(
            z.data_ptr(), z.stride(1), batch, length, lengths.data_ptr(), r_k, first,
            copies, u_rest.data_ptr(), upad, cos.data_ptr(), sin.data_ptr(),
            queries.data_ptr(), heads, wpad, out.data_ptr(),
        )  # fmt: skip
        return out


def build_library(
    compiler: str, target: Path, flags: tuple[str, ...] = native_build.FLAGS
) -> LatentScoresLibrary:
    """Compile the source to ``target`` (unless it is there) and load it."""
    return _configured(native_build.compile_and_load(compiler, SOURCE, target, flags))


def _configured(lib: ctypes.CDLL) -> LatentScoresLibrary:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.latent_scores.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, i64]
    lib.latent_scores.argtypes += [ptr, ptr, ptr, i64, i64, ptr]
    lib.latent_scores.restype = None
    return LatentScoresLibrary(lib, int(lib.latent_width()), int(lib.latent_max_width()))


@functools.cache
def latent_scores_library() -> LatentScoresLibrary | None:
    """The library for this CPU (``native_build.cached_library``), or None where it did
    not build."""
    lib = native_build.cached_library(SOURCE, "latent scores")
    return None if lib is None else _configured(lib)
