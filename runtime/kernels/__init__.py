"""The kernel registry that generated code fills in, and backend selection.

Every generated kernel (a module, or the entry of one shape in a module that serves a
family's shapes: down_proj, latent_up, kv_copy) exposes three implementations with one
signature:
its launcher (the Triton kernel), ``torch_reference`` (plain torch, graph-safe at the
static shapes: the test oracle) and ``torch_eager`` (plain torch that reads counts on the
host and works on the real rows only: the CPU path); ``backend`` picks one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from dsl.buckets import nearest_bucket

BACKENDS = ("triton", "torch", "eager")
IMPLEMENTATIONS = {"torch": "torch_reference", "eager": "torch_eager"}


def pick_config(configs: dict[int, dict[str, int]], rows: int) -> dict[str, int]:
    """The meta-parameters of the bucket nearest ``rows``."""
    return configs[nearest_bucket(configs, rows)]


# The launcher name inside each kernel family's module.
LAUNCHERS = {
    "down_proj": "down_proj",
    "latent_up": "latent_up_chunk",
    "gemm": "gemm_fixed",
    "rope": "rope_inplace",
    "paged_attention": "paged_decode_attention",
    "kv_copy": "kv_block_copy",
}


# A generated module, or one shape's entry of a module that serves several.
Kernel = ModuleType | Any


@dataclass(frozen=True)
class KernelRegistry:
    down_proj: dict[tuple[str, str], Kernel] = field(default_factory=dict)
    latent_up: dict[tuple[str, str], Kernel] = field(default_factory=dict)
    gemm: dict[tuple[int, int], Kernel] = field(default_factory=dict)
    rope: dict[int, Kernel] = field(default_factory=dict)
    paged_attention: dict[tuple[int, int], Kernel] = field(default_factory=dict)
    kv_copy: dict[int, Kernel] = field(default_factory=dict)

    def module(self, family: str, key) -> Kernel:
        table = getattr(self, family)
        if key not in table:
            raise KeyError(f"no generated {family} kernel for {key}; regenerate with deinfer-gen")
        return table[key]

    def get(self, family: str, key, backend: str) -> Callable:
        """The launcher (``triton``), its plain-torch reference (``torch``) or the
        real-shape torch version (``eager``)."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, found {backend!r}")
        mod = self.module(family, key)
        if backend == "triton":
            return getattr(mod, LAUNCHERS[family])
        return getattr(mod, IMPLEMENTATIONS[backend])
