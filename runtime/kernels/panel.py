"""The native decode product (``native/panel_product.c``): built once per machine with
the system's C compiler for the CPU it runs on, loaded with ctypes, and offered to the
tuner (``cpu_gemm``) as the "panel" form only where it built.

The library links the OpenMP runtime torch has already loaded (one ``libgomp.so.1`` in
the process), so its threads are torch's intra-op threads: ``torch.set_num_threads``
sizes both, and neither waits on the other's spinning workers.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.kernels.huge_pages import empty_on_huge_pages

SOURCE = Path(__file__).with_name("native") / "panel_product.c"
# -march=native: the vector width is the build machine's, so the library is cached per CPU
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


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
        """a [M, K] fp32 · the matrix ``panels`` holds (N = n columns) -> [M, n]."""
        k = a.shape[-1]
        want = (-(-n // self.width), k, self.width)
        if a.dim() != 2 or a.dtype != torch.float32 or panels.dtype != torch.float32:
            found = f"{a.dtype} {a.dim()}-D a, {panels.dtype} panels"
            raise ValueError(f"panel product: fp32 a [M, K] and panels, found {found}")
        if tuple(panels.shape) != want or not panels.is_contiguous():
            raise ValueError(f"panel product: panels of shape {want}, found {tuple(panels.shape)}")
        a = a.contiguous()
        c = torch.empty(a.shape[0], n, dtype=a.dtype)
        failed = self.lib.panel_product(
            a.data_ptr(), panels.data_ptr(), c.data_ptr(), a.shape[0], k, n
        )
        if failed:
            raise MemoryError(f"panel product: no scratch for a of shape {tuple(a.shape)}")
        return c


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(
            sorted({ln for ln in lines if ln.startswith(("model name", "flags", "Features"))})
        )
    return platform.processor() or platform.machine()


def build_library(compiler: str, target: Path, flags: tuple[str, ...] = FLAGS) -> PanelLibrary:
    """Compile the source to ``target`` (unless it is there) and load it."""
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            command = [compiler, *flags, str(SOURCE), "-o", tmp]
            subprocess.run(command, check=True, capture_output=True, timeout=120)
            os.replace(tmp, target)  # atomic: ranks building at once install whole files
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(target))
    lib.panel_product.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    lib.panel_product.restype = ctypes.c_int
    return PanelLibrary(lib, int(lib.panel_width()))


def _cache_root() -> Path:
    return Path(os.environ.get("DEINFER_CACHE") or Path.home() / ".cache" / "deinfer")


@functools.cache
def panel_library() -> PanelLibrary | None:
    """The library for this CPU (built on first use, then cached under ``$DEINFER_CACHE``
    or ``~/.cache/deinfer``), or None where there is no C compiler or it fails to build
    (the tuner then chooses among the torch forms). ``DEINFER_NO_NATIVE=1`` turns it off."""
    if os.environ.get("DEINFER_NO_NATIVE") or platform.system() != "Linux":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), compiler.encode()):
        key.update(part + b"\0")
    key.update(_cpu_identity().encode())
    target = _cache_root() / "native" / f"panel_product-{key.hexdigest()[:16]}.so"
    try:
        return build_library(compiler, target)
    except (OSError, subprocess.SubprocessError) as exc:
        warnings.warn(f"native decode product not built ({exc}); using torch's", stacklevel=2)
        return None
