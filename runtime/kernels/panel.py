"""The native decode product (``native/panel_product.c``): built once per machine
(``native_build``), and offered to the tuner (``cpu_gemm``) as the "panel" form only
where it built.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.kernels import native_build
from runtime.kernels.huge_pages import empty_on_huge_pages

SOURCE = native_build.NATIVE / "panel_product.c"
FLAGS = native_build.FLAGS


@dataclass(frozen=True)
class PanelLibrary:
    """The loaded library: its panel width (output columns per stored panel)."""

    lib: ctypes.CDLL
    width: int

    def pack(self, b: torch.Tensor) -> torch.Tensor:
        """b [K, N] (stored [N, K]) as panels [ceil(N / width), K, width], zero past N,
        on huge pages where the kernel gives them (``huge_pages``)."""
        w = b.t()
        n, k = w.shape
        panels = -(-n // self.width)
        padded = torch.zeros(panels * self.width, k, dtype=w.dtype)
        padded[:n] = w
        out = empty_on_huge_pages((panels, k, self.width), w.dtype)  # streamed every step
        return out.copy_(padded.view(panels, self.width, k).transpose(1, 2))

    def product(self, a: torch.Tensor, panels: torch.Tensor, n: int) -> torch.Tensor:
        """a [M, K] fp32 (rows any stride) · the matrix ``panels`` holds (N = n
        columns) -> [M, n]."""
        k = a.shape[-1]
        want = (-(-n // self.width), k, self.width)
        if a.dim() != 2 or a.dtype != torch.float32 or panels.dtype != torch.float32:
            found = f"{a.dtype} {a.dim()}-D a, {panels.dtype} panels"
            raise ValueError(f"panel product: fp32 a [M, K] and panels, found {found}")
        if tuple(panels.shape) != want or not panels.is_contiguous():
            raise ValueError(f"panel product: panels of shape {want}, found {tuple(panels.shape)}")
        if a.stride(1) != 1:
            a = a.contiguous()
        c = torch.empty(a.shape[0], n, dtype=a.dtype)
        failed = self.lib.panel_product(
            a.data_ptr(), a.stride(0), panels.data_ptr(), c.data_ptr(), a.shape[0], k, n
        )
        if failed:
            raise MemoryError(f"panel product: no scratch for a of shape {tuple(a.shape)}")
        return c


def build_library(
    compiler: str, target: Path, flags: tuple[str, ...] = native_build.FLAGS
) -> PanelLibrary:
    """Compile the source to ``target`` (unless it is there) and load it."""
    return _configured(native_build.compile_and_load(compiler, SOURCE, target, flags))


def _configured(lib: ctypes.CDLL) -> PanelLibrary:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.panel_product.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64]
    lib.panel_product.restype = ctypes.c_int
    return PanelLibrary(lib, int(lib.panel_width()))


@functools.cache
def panel_library() -> PanelLibrary | None:
    """The library for this CPU (``native_build.cached_library``), or None where it did
    not build (the tuner then chooses among the torch forms)."""
    lib = native_build.cached_library(SOURCE, "decode product")
    return None if lib is None else _configured(lib)
