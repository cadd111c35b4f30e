"""DeInfer's decoder layer (docs/METHOD.md): concat-split down factors, the latent
all-gathered, local heads only, row-parallel o/down down factors with an all-reduce of
width r, then their up factors replicated or split by columns; each matrix merged or
latent as the plan says. The shared parts are ``runtime.model.layers.DecoderLayer``'s."""

from __future__ import annotations

import torch

from runtime.dist.comm import Comm
from runtime.kernels import eager
from runtime.kernels.cpu_gemm import ReleasedMatrix
from runtime.kernels.decode_block import Projection
from runtime.model.decode_block import ROWS, LatentAttentionHalf, held_as_panels, matrices_of
from runtime.model.layers import ACTIVATIONS, Batch, DecoderLayer, LayerSetup
from runtime.model.pending_up import PendingUp, Summand, summed


class DeinferLayer(DecoderLayer):
    """Concat-split down factors, latent all-gather overlapped with the up GEMM, local
    heads only, row-parallel o/down down-factors with an all-reduce of width r, then the
    o/down up factors replicated or split by columns (``ModePlan.up_layout``)."""

    def __init__(self, setup: LayerSetup, index: int, weights: dict[str, torch.Tensor]) -> None:
        super().__init__(setup, index, weights)
        # Row groups whose up factor is split by columns, and the real width their
        # all-gathered output is cut back to: fixed by the plan, looked up once.
        self.gathered_widths = {f.matrix: f.length for f in setup.plan.split_row_ups()}
        # Across ranks, the row groups whose up product the next half's call makes: their
        # up factors' panels by group (``prepare_decode_block``).
        self.pending_ups: dict[str, Projection] = {}

    def fuse_columns(self) -> None:
        """A column group whose matrices all run merged is one GEMM, as in dense mode."""
        self.fuse_dense_groups()

    def fuses_residual(self) -> bool:
        """Each block's output is whole (its row group reduced the latent), so the
        residual adds fuse into the norms as in the dense layer (the native decode block
        hands on its row products' latents instead: ``row_summands``)."""
        return self.s.execution.fuses_residual_adds

    def decode_block_allowed(self) -> bool:
        """With each concatenated group's members in the block's column order (the MLP's
        alone where the cache holds latents: the block's MLP half alone runs)."""
        orders = {"mlp": ("gate", "up")}
        if not self.s.latent_cache:
            orders["attn"] = ("q", "k", "v")
        for group, order in orders.items():
            cat = self.s.plan.concat(group)
            if cat is not None and tuple(n for n, _ in cat.members) != order:
                return False
        return True

    def decode_block_names(self) -> list[str]:
        """Across ranks also the up factors of the low-rank row groups that every rank
        holds whole: as panels, the next half's call multiplies them (``PendingUp``)."""
        names = super().decode_block_names()
        return names and names + self.held_row_ups()

    def held_row_ups(self) -> list[str]:
        """The up factors, across ranks, of the block's low-rank row groups that are not
        split by columns (a latent-cache layer's: the MLP's alone, its attention runs op
        by op)."""
        if self.s.comm.world == 1:
            return []
        rows = ("down",) if self.s.latent_cache else ROWS
        return [
            f"{n}.u" for n in rows if self.w(f"{n}.v") is not None and n not in self.gathered_widths
        ]

    def prepare_decode_block(self) -> None:
        super().prepare_decode_block()
        self.pending_ups = {}
        for name in self.held_row_ups() if self.decode_block_names() else []:
            up = held_as_panels({name: self.w(name)}, name)
            if up is not None:
                self.pending_ups[name.removesuffix(".u")] = Projection(up.copy, up.shape[1])

    def latent_attention_names(self) -> list[str]:
        """On one rank: the group's concatenated down factors, q's matrix (merged) or up
        factor (its latent first in the group's), and o's matrices
        (``LatentAttentionHalf``)."""
        cat = self.s.plan.concat("attn")
        if not self.s.latent_cache or self.s.comm.world > 1 or cat is None:
            return []
        if self.w("q.weight") is not None:
            q = "q.weight"
        elif cat.members[0][0] == "q" and self.w("q.u") is not None:
            q = "q.u"
        else:
            return []
        o = matrices_of({name: self.w(name) for name in self.names}, False, ("o",))
        return [] if o is None else ["attn.cat", q, *o]

    def latent_attention_half(self, weights: dict[str, object]) -> LatentAttentionHalf | None:
        if not self.latent_attention_names():
            return None
        kv = (self.s.plan.concat("attn").member_offset("k"), self.s.plan.kv_latent_per_rank)
        return LatentAttentionHalf.of(self.s.model, weights, kv)

    def row_summands(self, name: str, pending: torch.Tensor, batch: Batch) -> list[Summand]:
        """On one rank the block's output is whole; across ranks a merged row's is a
        Megatron shard's partial sum, a low-rank row's its latent's (width r): reduced,
        then multiplied by the up factor — by the next half's call where every rank holds
        it as panels (``PendingUp``), else here (``row_up``)."""
        if self.s.comm.world == 1:
            if self.s.comm.count:
                self.count_skipped(name, pending)
            return [pending]
        if self.w(f"{name}.v") is None:
            return self.summands_of(pending)
        latent = self.s.comm.all_reduce(pending)
        up = self.pending_ups.get(name)
        return [self.row_up(name, latent, batch) if up is None else PendingUp(latent, up)]

    def count_skipped(self, name: str, pending: torch.Tensor) -> None:
        """A rank alone: the half's latents stayed in the native call's scratch; its
        skipped collectives counted as the plan (and the op-by-op path) count them."""
        rows, cat = pending.shape[0], self.s.plan.concat("attn" if name == "o" else "mlp")
        if cat is not None and not cat.whole:
            self.s.comm.skipped("all_gather", rows * cat.width)
        down = self.w(f"{name}.v")
        width = pending.shape[1] if down is None else down.shape[1]
        self.s.comm.skipped("all_reduce", rows * width)

    def forward_fused(
        self, x: torch.Tensor, summands: list[Summand] | None, batch: Batch
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if summands is not None:
            eager.add_summands(x, summed(summands))
        x.add_(self.attention_block(x, batch))
        return x, [self.mlp_block(x, batch)]

    def gemm_only(self) -> set[str]:
        """Not the up factors of a split concat group across ranks (the ring multiplies
        row slices of them, whenever a latent goes round it) unless the native decode block
        (or its MLP half) multiplies them (the layer then gathers its latents whole), nor
        a latent cache's k and v up factors (its decode reads them:
        ``runtime.model.eager_attention``)."""
        kept = set()
        if self.s.comm.world > 1:
            native = set(self.decode_block_names())
            for group in ("attn", "mlp"):
                cat = self.s.plan.concat(group)
                if cat is None or cat.whole:
                    continue
                ups = {f"{n}.u" for n, _ in cat.members}
                if not ups <= native:
                    kept |= ups
        if self.s.latent_cache:
            kept |= {"k.u", "v.u"}
        return super().gemm_only() - kept

    def column_group(
        self,
        group: str,
        names: tuple[str, ...],
        x: torch.Tensor,
        norm: str,
        batch: Batch,
        keep_latent: bool = False,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """The group's outputs by name, and (``keep_latent``) the gathered latent
        [T, padded]; None where no factor of the group is decomposed."""
        outs: dict[str, torch.Tensor] = {}
        latent = None
        cat = self.s.plan.concat(group)
        if cat is not None:
            key = (group, self.s.plan.shape_id)
            down = self.s.execution.kernel("down_proj", key)
            z = down(
                x,
                self.w(f"{group}.cat"),
                x.new_empty((x.shape[0], cat.width)),
                self.w(f"{norm}.weight"),
                self.w(f"{norm}.bias"),
            )
            if cat.whole:  # every rank computed the whole latent
                latent = z
                outs = self.whole_latent_up(cat, latent, names, batch)
            elif self.s.execution.gathers_whole(self.s.comm, z) or self.ups_released(cat):
                latent = self.s.comm.all_gather_columns(z)
                outs = self.whole_latent_up(cat, latent, names, batch)
            else:
                outs, gathered = self.latent_up_by_chunks(cat, key, z)
                latent = Comm.columns(gathered) if keep_latent else None
        dense = tuple(n for n in names if n not in outs)
        if dense:
            xn = self.norm(x, norm)
            outs.update(zip(dense, self.dense_columns(dense, xn, batch), strict=True))
        return {n: self.add_bias(outs[n], n) for n in names}, latent

    def ups_released(self, cat) -> bool:
        """Whether the tuned products hold the group's up factors alone (the native
        decode block's panels): then no ring can take row slices of them."""
        return any(isinstance(self.w(f"{n}.u"), ReleasedMatrix) for n, _ in cat.members)

    def latent_up_by_chunks(self, cat, key, z: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """The generated kernel: each all-gather chunk multiplied as it arrives, split-K
        into fp32 accumulators (the ring overlap; the static path's fixed shapes).
        Returns the outputs by name and the gathered chunks [world, T, width]."""
        members = [n for n, _ in cat.members]
        ups = tuple(self.w(f"{n}.u") for n in members)
        accs = tuple(
            torch.zeros((z.shape[0], u.shape[1]), dtype=torch.float32, device=z.device) for u in ups
        )
        gathered = z.new_empty((self.s.comm.world, *z.shape))
        module = self.s.execution.module("latent_up", key)
        chunk_fn = self.s.execution.kernel("latent_up", key)
        module.latent_up(self.s.comm, z, gathered, ups, accs, chunk_fn=chunk_fn)
        return {n: acc.to(z.dtype) for n, acc in zip(members, accs, strict=True)}, gathered

    def whole_latent_up(
        self, cat, latent: torch.Tensor, names: tuple[str, ...], batch: Batch
    ) -> dict[str, torch.Tensor]:
        """Dynamic path, latent gathered at once (shared memory, or no ring): one
        product per up factor of ``names`` over its columns of the latent — the whole
        factor, which the tuned products cover, instead of row slices of it per chunk."""
        outs = {}
        for name, rank in cat.members:
            if name not in names:
                continue
            start = cat.member_offset(name)
            outs[name] = self.gemm(
                latent[:, start : start + rank], self.w(f"{name}.u"), batch.n_valid
            )
        return outs

    def row_group(self, name: str, h: torch.Tensor, batch: Batch) -> torch.Tensor:
        if self.w(f"{name}.v") is None:
            y = self.s.comm.all_reduce(self.gemm(h, self.w(f"{name}.weight"), batch.n_valid))
            return self.add_bias(y, name)
        p = self.gemm(h, self.w(f"{name}.v"), batch.n_valid)
        self.s.comm.all_reduce(p)  # width r, not h
        return self.row_up(name, p, batch)

    def row_up(self, name: str, p: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The row group's output from its reduced latent p: times the up factor (split
        by columns: each rank's columns, all-gathered)."""
        y = self.add_bias(self.gemm(p, self.w(f"{name}.u"), batch.n_valid), name)
        width = self.gathered_widths.get(name)
        if width is None:  # replicated: every rank already holds the whole output
            return y
        return self.s.comm.all_gather_columns(y)[:, :width]

    def attention_block(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        # None where this layer's cache holds dense K and V
        width = self.s.plan.kv_latent_per_rank if self.s.latent_cache else None
        # a latent layer's decode on the dynamic path reads its keys from the cache: its
        # k and v up products would go unused (without them a latent step of cpu-135m at
        # 40%, batch 8, context 256, is 3.6% shorter: 42 alternated steps)
        skip_kv = width is not None and self.s.execution.reads_cached_keys(batch)
        qkv = ("q",) if skip_kv else ("q", "k", "v")
        out, gathered = self.column_group("attn", qkv, x, "input_norm", batch, width is not None)
        latent = None
        if gathered is not None and width is not None:
            start = self.s.plan.concat("attn").member_offset("k")
            latent = gathered[:, start : start + width]
        attn = self.attend(out["q"], out.get("k"), out.get("v"), latent, batch)
        return self.row_group("o", attn, batch)

    def mlp_block(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        act = ACTIVATIONS[self.s.model.mlp.activation]
        if self.s.model.mlp.kind == "glu":
            out, _ = self.column_group("mlp", ("gate", "up"), x, "post_norm", batch)
            return self.row_group("down", act(out["gate"]) * out["up"], batch)
        out, _ = self.column_group("mlp", ("fc1",), x, "post_norm", batch)
        return self.row_group("fc2", act(out["fc1"]), batch)
