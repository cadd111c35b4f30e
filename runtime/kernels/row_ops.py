"""The native per-row ops of a decode step (``native/row_ops.c``): RMSNorm and RoPE in
one pass each, built once per machine (``native_build``). Each entry point returns None
for operands it does not take (not fp32, rows not unit-stride, another norm or RoPE
style) and where the library did not build: the caller then uses torch's ops
(``eager.normalize``, ``eager.rotate``), the oracle the tests compare these against."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.kernels import native_build

SOURCE = native_build.NATIVE / "row_ops.c"


@dataclass(frozen=True)
class RowOpsLibrary:
    lib: ctypes.CDLL

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor | None, eps: float
    ) -> torch.Tensor | None:
        """x [rows, dim] (rows any stride, columns unit-stride) / RMS · weight [dim]."""
        if not _rows(x):
            return None
        if weight is not None and (weight.dtype != torch.float32 or weight.shape != x.shape[1:]):
            return None
        rows, dim = x.shape
        w = None if weight is None else weight.contiguous()
        out = torch.empty(rows, dim, dtype=torch.float32)
        self.lib.rms_norm(
            x.data_ptr(), x.stride(0), None if w is None else w.data_ptr(), out.data_ptr(),
            rows, dim, eps,
        )  # fmt: skip
        return out

    def add_rms_norm(
        self,
        x: torch.Tensor,
        parts: list[torch.Tensor],
        weight: torch.Tensor | None,
        eps: float,
        normalize: bool = True,
    ) -> torch.Tensor | None:
        """x [rows, dim] += parts[0] + parts[1] + ... (that order), in place, and
        (``normalize``) its RMSNorm · weight as a new tensor, else x itself. Every part is
        [rows, dim] with unit-stride rows, like x."""
        if not _rows(x) or not parts or any(not _rows(p) or p.shape != x.shape for p in parts):
            return None
        if weight is not None and (weight.dtype != torch.float32 or weight.shape != x.shape[1:]):
            return None
        rows, dim = x.shape
        w = None if weight is None else weight.contiguous()
        out = torch.empty(rows, dim, dtype=torch.float32) if normalize else None
        pointers = (ctypes.c_void_p * len(parts))(*[p.data_ptr() for p in parts])
        strides = (ctypes.c_int64 * len(parts))(*[p.stride(0) for p in parts])
        self.lib.add_rms_norm(
            x.data_ptr(), x.stride(0), pointers, strides, len(parts),
            None if w is None else w.data_ptr(), None if out is None else out.data_ptr(),
            rows, dim, eps,
        )  # fmt: skip
        return x if out is None else out

    def rotate(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str
    ) -> torch.Tensor | None:
        """RoPE of x [tokens, heads, dim] (unit-stride vectors) by the tables cos, sin
        [tokens, 1, dim] of ``eager.rope_tables`` (sin signed), as a new tensor."""
        if style not in ("neox", "gptj") or x.dim() != 3 or x.device.type != "cpu":
            return None
        tokens, heads, dim = x.shape
        want = (tokens, 1, dim)
        fp32 = x.dtype == cos.dtype == sin.dtype == torch.float32
        if not fp32 or x.stride(2) != 1 or cos.shape != want or sin.shape != want or dim % 2:
            return None
        cos, sin = cos.contiguous(), sin.contiguous()
        out = torch.empty(tokens, heads, dim, dtype=torch.float32)
        half = dim // 2 if style == "neox" else 0
        self.lib.rope(
            x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(),
            out.data_ptr(), tokens, heads, dim, half,
        )  # fmt: skip
        return out

    def exp(self, x: torch.Tensor) -> torch.Tensor:
        """exp of each element of x (fp32, CPU) as the decode kernels' softmaxes and SiLU
        compute it (``vexp`` in ``native/vec.h``), as a new tensor."""
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"exp: need an fp32 CPU tensor, got {x.dtype} on {x.device}")
        x = x.contiguous()
        out = torch.empty_like(x)
        self.lib.vector_exp(x.data_ptr(), out.data_ptr(), x.numel())
        return out


def _rows(x: torch.Tensor) -> bool:
    """x is an fp32 CPU matrix with unit-stride rows: what the row kernels read."""
    return x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1 and x.device.type == "cpu"


def build_library(
    compiler: str, target: Path, flags: tuple[str, ...] = native_build.FLAGS
) -> RowOpsLibrary:
    """Compile the source to ``target`` (unless it is there) and load it."""
    return _configured(native_build.compile_and_load(compiler, SOURCE, target, flags))


def _configured(lib: ctypes.CDLL) -> RowOpsLibrary:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.rms_norm.argtypes = [ptr, i64, ptr, ptr, i64, i64, ctypes.c_float]
    lib.rope.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, i64, i64, i64]
    lib.add_rms_norm.argtypes = [ptr, i64, ptr, ptr, i64, ptr, ptr, i64, i64, ctypes.c_float]
    lib.vector_exp.argtypes = [ptr, ptr, i64]
    lib.rms_norm.restype = lib.rope.restype = lib.add_rms_norm.restype = None
    lib.vector_exp.restype = None
    return RowOpsLibrary(lib)


@functools.cache
def row_ops_library() -> RowOpsLibrary | None:
    """The library for this CPU (``native_build.cached_library``), or None where it did
    not build."""
    lib = native_build.cached_library(SOURCE, "row ops")
    return None if lib is None else _configured(lib)
