"""Building the native CPU kernels (``native/*.c``): each source compiled once per machine
with the system's C compiler for the CPU it runs on, cached, and loaded with ctypes.

A library links the OpenMP runtime torch has already loaded (one ``libgomp.so.1`` in
the process), so its threads are torch's intra-op threads: ``torch.set_num_threads``
sizes both, and neither waits on the other's spinning workers.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

NATIVE = Path(__file__).with_name("native")
# -march=native: the vector width is the build machine's, so a library is cached per CPU
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


def cpu_identity() -> str:
    """What -march=native compiles for, and what a timing on this CPU depends on: the
    CPU's model and feature flags (one model name covers VMs with and without AVX-512)."""
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(
            sorted({ln for ln in lines if ln.startswith(("model name", "flags", "Features"))})
        )
    return platform.processor() or platform.machine()


def compile_and_load(
    compiler: str, source: Path, target: Path, flags: tuple[str, ...] = FLAGS
) -> ctypes.CDLL:
    """Compile ``source`` to ``target`` (unless it is there) and load it."""
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            command = [compiler, *flags, str(source), "-o", tmp]
            subprocess.run(command, check=True, capture_output=True, timeout=120)
            os.replace(tmp, target)  # atomic: ranks building at once install whole files
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return ctypes.CDLL(str(target))


def _cache_root() -> Path:
    return Path(os.environ.get("DEINFER_CACHE") or Path.home() / ".cache" / "deinfer")


def cached_library(source: Path, what: str) -> ctypes.CDLL | None:
    """``source`` built for this CPU (on first use, then cached under ``$DEINFER_CACHE``
    or ``~/.cache/deinfer``), or None where there is no C compiler or it fails to build
    (``what``, the kernel's name, is then in a warning, and the caller uses torch's).
    ``DEINFER_NO_NATIVE=1`` turns every native kernel off."""
    if os.environ.get("DEINFER_NO_NATIVE") or platform.system() != "Linux":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None
    key = hashlib.sha256()
    headers = b"".join(h.read_bytes() for h in sorted(NATIVE.glob("*.h")))  # what it includes
    for part in (source.read_bytes(), headers, " ".join(FLAGS).encode(), compiler.encode()):
        key.update(part + b"\0")
    key.update(cpu_identity().encode())
    target = _cache_root() / "native" / f"{source.stem}-{key.hexdigest()[:16]}.so"
    try:
        return compile_and_load(compiler, source, target)
    except (OSError, subprocess.SubprocessError) as exc:
        warnings.warn(f"native {what} not built ({exc}); using torch's", stacklevel=3)
        return None
