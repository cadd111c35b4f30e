"""How one rank computes, chosen once when the rank starts: the products, norms, RoPE and
per-forward inputs the layers use. The layers ask their ``Execution``; they never test
which path they are on.

- ``StaticExecution`` (the static path: fixed shapes, CUDA graphs on a GPU) runs the
  generated kernels of the registry, as Triton or as their torch references, each told
  how many rows of its fixed-size input are real.
- ``DynamicExecution`` (the dynamic path: every shape follows the batch, the CPU's
  default) multiplies through the eager products — the rank's tuned ``CpuGemm`` once it
  is measured — norms and adds residuals in fused native passes, and rotates with RoPE
  tables made once per forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from dsl.spec import ModelConfig
from runtime.dist.comm import Comm
from runtime.kernels import KernelRegistry, eager
from runtime.kernels.reference import apply_norm
from runtime.model.paged_cache import DecodeCache

# attention(layer index, q [T, Hl, d], k [T, KVl, d], v [T, KVl, d], latent [T, r_k + r_v] or
# None) -> [T, Hl, d]. Rotary embedding has already been applied to q and k.
AttentionFn = Callable[
    [int, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    torch.Tensor,
]


@dataclass
class Batch:
    """What every layer of one forward reads (made by ``Execution.batch``)."""

    positions: torch.Tensor  # int32 [T]
    n_valid: torch.Tensor  # int32 [1]: rows of the activations that are real tokens
    attention: AttentionFn
    decode: bool = False  # one new token per sequence, the rest in the cache
    # The dynamic path's RoPE tables of the positions, [T, 1, head_dim] each (broadcast
    # over heads), made once per forward instead of in every layer.
    rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None
    # A decode step's layer caches by index as the native decode block reads them
    # (``runtime.model.decode_block``; None for a cache it does not read); None: not offered.
    decode_cache: Callable[[int], DecodeCache | None] | None = None


class Execution:
    """What the layers call; one per rank (see the module)."""

    # Whether a layer may hand its last product on unreduced for the next norm to add
    # (``runtime.kernels.eager.add_and_normalize``).
    fuses_residual_adds = False

    def __init__(self, model: ModelConfig, kernels: KernelRegistry) -> None:
        self.model, self.kernels = model, kernels

    def batch(
        self,
        positions: torch.Tensor,
        n_valid: torch.Tensor,
        attention: AttentionFn,
        inv_freq: torch.Tensor | None,
        decode: bool = False,
        decode_cache: Callable[[int], DecodeCache | None] | None = None,
    ) -> Batch:
        """``decode_cache``: a decode step's layer caches, which only the dynamic path's
        native decode block reads."""
        return Batch(positions, n_valid, attention, decode)

    def norm(self, x: torch.Tensor, weight, bias, kind: str) -> torch.Tensor:
        """Norm in fp32, result in x's dtype."""
        return apply_norm(x, weight, bias, norm=kind, eps=self.model.norm.eps).to(x.dtype)

    def gemm(self, a: torch.Tensor, b: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
        kernel = self.kernels.get("gemm", tuple(b.shape), self.backend)
        return kernel(a, b, a.new_empty((a.shape[0], b.shape[1])), n_valid)

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """A product outside the layers (the LM head): every row real."""
        return torch.matmul(a, b)

    def kernel(self, family: str, key) -> Callable:
        """The generated kernel of ``family`` (down_proj, latent_up) for ``key``."""
        return self.kernels.get(family, key, self.backend)

    def module(self, family: str, key):
        return self.kernels.module(family, key)

    def rope(self, x: torch.Tensor, batch: Batch, inv_freq: torch.Tensor | None) -> torch.Tensor:
        """x [T, heads, head_dim] rotated (contiguous; attention without RoPE gets it as is)."""
        x = x.contiguous()
        if inv_freq is None:
            return x
        kernel = self.kernels.get("rope", x.shape[1], self.backend)
        return kernel(x, batch.positions, inv_freq, batch.n_valid)

    def gathers_whole(self, comm: Comm, z: torch.Tensor) -> bool:
        """Whether a latent arrives in one all-gather, to be multiplied by each whole up
        factor, instead of chunk by chunk through the ring with the fixed-shape kernel."""
        return False

    def reads_cached_keys(self, batch: Batch) -> bool:
        """Whether a latent-cache layer's attention rebuilds its keys from the cache alone
        (so the layer need not compute its new token's k and v)."""
        return False


class StaticExecution(Execution):
    def __init__(self, model: ModelConfig, kernels: KernelRegistry, backend: str) -> None:
        super().__init__(model, kernels)
        self.backend = backend  # "triton" | "torch"


class DynamicExecution(Execution):
    backend = "eager"
    fuses_residual_adds = True

    def __init__(self, model: ModelConfig, kernels: KernelRegistry) -> None:
        super().__init__(model, kernels)
        # The products: eager's, until the rank has measured its tuned ones (``use``).
        self.product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = eager.matmul

    def use(self, product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """Multiply through ``product`` (the rank's tuned ``CpuGemm``) from now on."""
        self.product = product

    def batch(
        self, positions, n_valid, attention, inv_freq, decode=False, decode_cache=None
    ) -> Batch:
        tables = None
        if inv_freq is not None:
            cos, sin = eager.rope_tables(positions, inv_freq, self.model.positions.style)
            tables = cos[:, None, :], sin[:, None, :]
        return Batch(positions, n_valid, attention, decode, tables, decode_cache)

    def norm(self, x: torch.Tensor, weight, bias, kind: str) -> torch.Tensor:
        """One fused native pass."""
        return eager.normalize(x, weight, bias, norm=kind, eps=self.model.norm.eps)

    def gemm(self, a: torch.Tensor, b: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
        return self.product(a, b)  # every row is real: the product is the output

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.product(a, b)

    def kernel(self, family: str, key) -> Callable:
        """The generated kernel's eager form, its products through this rank's."""
        return partial(self.kernels.get(family, key, self.backend), gemm=self.product)

    def rope(self, x: torch.Tensor, batch: Batch, inv_freq: torch.Tensor | None) -> torch.Tensor:
        """The tables rotate a view as it is."""
        if batch.rope_tables is None:
            return x.contiguous()
        cos, sin = batch.rope_tables
        return eager.rotate(x, cos, sin, self.model.positions.style)

    def gathers_whole(self, comm: Comm, z: torch.Tensor) -> bool:
        return not comm.rings(z)

    def reads_cached_keys(self, batch: Batch) -> bool:
        return batch.decode


def execution_for(model: ModelConfig, kernels: KernelRegistry, backend: str) -> Execution:
    """``backend`` "eager": the dynamic path's; "triton" or "torch": the static path's."""
    if backend == "eager":
        return DynamicExecution(model, kernels)
    return StaticExecution(model, kernels, backend)
