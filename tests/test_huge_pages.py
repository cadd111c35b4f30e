"""``runtime.kernels.huge_pages``: the copy is exact, contiguous and starts on a 2 MiB
boundary, and the kernel has the huge-page advice for its whole pages (the VmFlags of
the mapping that holds it say ``hg``); small tensors are ordinary copies."""

from __future__ import annotations

from pathlib import Path

import torch

from runtime.kernels.huge_pages import HUGE_PAGE, empty_on_huge_pages, on_huge_pages


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_large_copy_is_exact_aligned_and_advised_huge():
    t = torch.randn(3 * HUGE_PAGE // 4 + 5)  # 3 whole pages and a bit
    copy = on_huge_pages(t.view(-1, 1).t())  # a non-contiguous view as input
    assert copy.shape == (1, t.numel()) and copy.is_contiguous()
    assert torch.equal(copy[0], t)
    assert copy.data_ptr() % HUGE_PAGE == 0
    assert "hg" in _vm_flags(copy.data_ptr())


def test_small_and_other_dtypes_are_plain_copies():
    t = torch.arange(12, dtype=torch.bfloat16).view(3, 4)
    copy = on_huge_pages(t)
    assert copy.dtype == torch.bfloat16 and torch.equal(copy, t)
    empty = empty_on_huge_pages((0, 7), torch.float32)
    assert empty.shape == (0, 7)
