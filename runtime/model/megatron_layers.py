"""The Megatron-style layers the paper compares against (docs/METHOD.md): naive TP of
the decomposed model (``BaseLayer``) and undecomposed TP over the products D·U
(``DenseLayer``). The shared parts are ``runtime.model.layers.DecoderLayer``'s."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.model.layers import ACTIVATIONS, Batch, DecoderLayer


class BaseLayer(DecoderLayer):
    """Naive TP: every projection is a Megatron pair followed by an all-reduce of its
    full output; every rank then computes every head."""

    def project(self, name: str, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        if self.w(f"{name}.v") is not None:
            y = self.gemm(
                self.gemm(x, self.w(f"{name}.v"), batch.n_valid), self.w(f"{name}.u"), batch.n_valid
            )
        else:
            f = self.s.plan.factor(f"{name}.weight")
            lo, hi = f.ranges[self.s.rank]
            xs = F.pad(x, (0, f.padded - x.shape[1]))[:, lo:hi].contiguous()
            y = self.gemm(xs, self.w(f"{name}.weight"), batch.n_valid)
        return self.add_bias(self.s.comm.all_reduce(y), name)

    def attention_block(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        xn = self.norm(x, "input_norm")
        q, k, v = (self.project(n, xn, batch) for n in ("q", "k", "v"))
        return self.project("o", self.attend(q, k, v, None, batch), batch)

    def mlp_block(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        xn = self.norm(x, "post_norm")
        act = ACTIVATIONS[self.s.model.mlp.activation]
        if self.s.model.mlp.kind == "glu":
            h = act(self.project("gate", xn, batch)) * self.project("up", xn, batch)
            return self.project("down", h, batch)
        return self.project("fc2", act(self.project("fc1", xn, batch)), batch)


class DenseLayer(DecoderLayer):
    """Undecomposed Megatron TP over the products D·U: 2 all-reduces of h per block."""

    def fuse_columns(self) -> None:
        self.fuse_dense_groups()

    def decode_block_allowed(self) -> bool:
        return True

    def columns(self, names: tuple[str, ...], x: torch.Tensor, batch: Batch) -> list[torch.Tensor]:
        outs = self.dense_columns(names, x, batch)
        return [self.add_bias(y, n) for y, n in zip(outs, names, strict=True)]

    def row(self, name: str, h: torch.Tensor, batch: Batch) -> torch.Tensor:
        y = self.s.comm.all_reduce(self.gemm(h, self.w(f"{name}.weight"), batch.n_valid))
        return self.add_bias(y, name)

    def attention_block(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        return self.row("o", self.attention_heads(self.norm(x, "input_norm"), batch), batch)

    def attention_heads(self, xn: torch.Tensor, batch: Batch) -> torch.Tensor:
        """This rank's heads' attention output [T, Hl·d] from the normed input."""
        q, k, v = self.columns(("q", "k", "v"), xn, batch)
        return self.attend(q, k, v, None, batch)

    def mlp_block(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        return self.row(self.mlp_row(), self.mlp_hidden(self.norm(x, "post_norm"), batch), batch)

    def mlp_row(self) -> str:
        return "down" if self.s.model.mlp.kind == "glu" else "fc2"

    def mlp_hidden(self, xn: torch.Tensor, batch: Batch) -> torch.Tensor:
        """This rank's columns of the MLP's hidden activation from the normed input."""
        act = ACTIVATIONS[self.s.model.mlp.activation]
        if self.s.model.mlp.kind == "glu":
            gate, up = self.columns(("gate", "up"), xn, batch)
            return act(gate).mul_(up)
        return act(self.columns(("fc1",), xn, batch)[0])

    def fuses_residual(self) -> bool:
        """Where the execution fuses residual adds into norms and no row projection has a
        bias to add after its all-reduce."""
        biased = self.w("o.bias") is not None or self.w(f"{self.mlp_row()}.bias") is not None
        return self.s.execution.fuses_residual_adds and not biased

    def forward_fused(
        self, x: torch.Tensor, summands: list[torch.Tensor] | None, batch: Batch
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        attended = self.attention_heads(self.add_norm(x, summands, "input_norm"), batch)
        o = self.gemm(attended, self.w("o.weight"), batch.n_valid)
        h = self.mlp_hidden(self.add_norm(x, self.summands_of(o), "post_norm"), batch)
        return x, self.summands_of(self.gemm(h, self.w(f"{self.mlp_row()}.weight"), batch.n_valid))
