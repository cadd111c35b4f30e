"""Host memory pages: tensors in memory that Linux is asked to back with 2 MiB pages
(transparent huge pages in ``madvise`` mode, the common default), for weights streamed
on every step, and freed heap pages given back (``return_freed_heap``).

A decode step streams every weight once: with 4 KiB pages that is a TLB miss every 4 KiB,
and in a VM each miss walks the host's tables too. On this project's Xeon VM, the
panels of a 576 x 3072 matrix at 16 rows took 0.454 ms on huge pages against 0.577 on
4 KiB pages, and the 576 x 49152 LM head at one row 4.0 against 5.8 ms (medians of 7
passes over 256 MB of distinct matrices, interleaved). The advice is a hint: where it is
refused, or the kernel has no huge page free, the memory is ordinary.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import platform
from collections.abc import Callable

import torch

HUGE_PAGE = 2 << 20
_MADV_DONTNEED = 4  # <sys/mman.h> on Linux
_MADV_HUGEPAGE = 14


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    if platform.system() != "Linux":
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor whose whole 2 MiB pages are advised huge
    before anything touches them (a view into a buffer one page larger, for alignment).

    The allocator may hand back memory freed a moment ago and already backed by 4 KiB
    pages (the tuner's timing samples, just before the copies are made), which the
    advice alone would leave as they are: on this VM the first engine built in a process
    had 31 MB of its 538 MB of panels on huge pages, and its decode step took 1.07x the
    step of a second, identical engine. So those pages are dropped first (the tensor is
    uninitialised: nothing in it is lost), and the next touch faults in huge ones."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -(-raw.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    madvise = _madvise()
    if madvise is not None and nbytes >= HUGE_PAGE:
        whole = nbytes // HUGE_PAGE * HUGE_PAGE
        madvise(start, whole, _MADV_HUGEPAGE)
        madvise(start, whole, _MADV_DONTNEED)
    offset = start - raw.data_ptr()
    return raw[offset : offset + nbytes].view(dtype).view(shape)


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t (same shape and dtype) in memory advised huge."""
    return empty_on_huge_pages(tuple(t.shape), t.dtype).copy_(t)


def return_freed_heap() -> None:
    """Give the pages of freed host tensors back to the system. glibc keeps freed heap
    memory mapped: the checkpoint's slices and their copies in the eager layout left a
    cpu-demo rank at tp 1 (1.25 GB of weights) holding 2.6 GB of anonymous memory, 1.43 GB
    after ``malloc_trim`` — eight engines of the cpu-target bench did not fit in 24 GB
    before. Elsewhere than glibc, nothing to do."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
