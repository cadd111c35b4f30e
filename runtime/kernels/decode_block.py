"""The native decode block (``native/decode_block.c``): a layer's decode step as two
calls, the attention half and the MLP half, each one parallel region over panel-packed
weights (``panel``; each projection dense or low-rank, ``Projection``), built once per
machine (``native_build``); and the dense cache's write and attention alone
(``DecodeBlockLibrary.cached_attention``) for layers that make their own projections,
and a latent-cache layer's q, rotated, beside its k|v latent (``q_and_latent``), the
same followed by the cache's latent attention (``latent_attention``: the native latent
attention of ``latent_scores``, called by address, in the same call), and its W_o in the
MLP half's call (``mlp``'s ``after``). The layers use it
through ``runtime.model.decode_block``; where it did not build they run their ops one by
one."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.kernels import latent_operands, latent_scores, native_build

SOURCE = native_build.NATIVE / "decode_block.c"


class _Projection(ctypes.Structure):
    """``projection_t`` of the C file."""

    _fields_ = [
        ("down", ctypes.c_void_p),
        ("n_down", ctypes.c_int64),
        ("members", ctypes.c_int64),
        ("ups", ctypes.POINTER(ctypes.c_void_p)),
        ("ranks", ctypes.POINTER(ctypes.c_int64)),
        ("widths", ctypes.POINTER(ctypes.c_int64)),
    ]


@dataclass(frozen=True, eq=False)
class Projection:
    """One projection of a half-block, as panels (``PanelLibrary.pack``): dense, ``down``
    alone [in -> out]; or low-rank, ``down`` [in -> sum of ranks] (a column group's down
    factors side by side) and each member's up factor [rank -> width], in column order.
    Holds the C descriptor (and keeps the tensors it points to alive)."""

    down: torch.Tensor | None  # None: the input is the latent (the up factors alone)
    columns: int  # the down panels' columns
    ups: tuple[tuple[torch.Tensor, int, int], ...] = ()  # (panels, rank, width)

    @property
    def in_width(self) -> int:
        """The input's width; the up factors' ranks' sum where the input is the latent."""
        if self.down is None:
            return sum(r for _, r, _ in self.ups)
        return self.down.shape[1]  # panels [ceil(columns / width), in, width]

    @property
    def out_width(self) -> int:
        return sum(w for _, _, w in self.ups) if self.ups else self.columns

    def __post_init__(self) -> None:
        n = len(self.ups)
        arrays = (  # kept alive with the descriptor that points to them
            (ctypes.c_void_p * max(n, 1))(*[u.data_ptr() for u, _, _ in self.ups]),
            (ctypes.c_int64 * max(n, 1))(*[r for _, r, _ in self.ups]),
            (ctypes.c_int64 * max(n, 1))(*[w for _, _, w in self.ups]),
        )
        ups, ranks, widths = arrays
        down = None if self.down is None else self.down.data_ptr()
        described = _Projection(down, self.columns, n, ups, ranks, widths)
        object.__setattr__(self, "arrays", arrays)
        object.__setattr__(self, "descriptor", described)
        object.__setattr__(self, "address", ctypes.addressof(described))


def _pointers(parts: list[torch.Tensor]) -> tuple[ctypes.Array, ctypes.Array]:
    return (
        (ctypes.c_void_p * len(parts))(*[p.data_ptr() for p in parts]),
        (ctypes.c_int64 * len(parts))(*[p.stride(0) for p in parts]),
    )


def _checked_rows(x: torch.Tensor, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """x [m, h] contiguous fp32 CPU; each part [m, h] fp32, returned with unit-stride rows
    (the kernel reads a summand row by row: a transposed view — a product the tuned
    GEMM computes as (W·aᵀ)ᵀ — is copied)."""
    if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous() or x.is_cuda:
        raise ValueError(f"decode block: x must be a contiguous fp32 [m, h], found {x.shape}")
    for p in parts:
        if p.shape != x.shape or p.dtype != torch.float32:
            raise ValueError(f"decode block: summand {tuple(p.shape)} for x {tuple(x.shape)}")
    return [p if p.stride(1) == 1 else p.contiguous() for p in parts]


def _norm(norm: tuple[torch.Tensor, float] | None, parts: list) -> tuple[int | None, float]:
    """The norm's weight pointer and eps; (NULL, 0) where the input is a latent."""
    if norm is None:
        if parts:
            raise ValueError("decode block: summands for a latent input")
        return None, 0.0
    return norm[0].data_ptr(), norm[1]


@dataclass(frozen=True)
class DecodeBlockLibrary:
    lib: ctypes.CDLL

    def norm_project(
        self,
        x: torch.Tensor,
        parts: list[torch.Tensor],
        norm: tuple[torch.Tensor, float] | None,
        projection: Projection,
        after: tuple[torch.Tensor, Projection] | None = None,
    ) -> torch.Tensor:
        """``decode_norm_project``: x [m, h] += parts (in place), and the normed x times
        ``projection`` [m, its columns] (across ranks: a column group's down factors'
        shard, whose latent the ranks all-gather); norm None: x as it is (no parts).
        ``after`` = (a latent [m, k], up): x += its product with up too, in the same call
        (across ranks the previous row group's reduced latent and its up factor; not with
        ``norm`` None)."""
        if projection.in_width != x.shape[-1]:
            raise ValueError(f"decode block: projection of {projection.in_width} for x {x.shape}")
        latent, k, up = self._after(x, norm, after)
        return self._half(
            "decode_norm_project", x, parts, norm, projection.out_width, latent, k, up,
            projection.address,
        )  # fmt: skip

    @staticmethod
    def _after(
        x: torch.Tensor,
        norm: tuple[torch.Tensor, float] | None,
        after: tuple[torch.Tensor, Projection] | None,
    ) -> tuple[int | None, int, int | None]:
        """The C arguments (latent, k, its projection) of a summand the call multiplies
        itself (``norm_project``'s and ``mlp``'s ``after``): (NULL, 0, NULL) for none."""
        if after is None:
            return None, 0, None
        latent, projection = after
        m, h = x.shape
        fits = latent.shape == (m, projection.in_width) and projection.out_width == h
        if not (fits and latent.dtype == torch.float32 and latent.is_contiguous() and norm):
            raise ValueError(f"decode block: a latent {tuple(latent.shape)} to add to x {m, h}")
        return latent.data_ptr(), latent.shape[1], projection.address

    def q_and_latent(
        self,
        x: torch.Tensor,
        parts: list[torch.Tensor],
        norm: tuple[torch.Tensor, float],
        q: Projection | None,
        kv: Projection,
        rope: tuple[torch.Tensor, torch.Tensor, int, int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``decode_q_and_latent``: x [m, h] += parts (in place); (q [m, ·], the latent
        [m, kv's down columns]) from the normed x: ``q`` (dense) beside ``kv`` (dense: k's
        and v's down factors); or, ``q`` None, ``kv`` low-rank with q's latent first and
        q's up factor its one member. ``rope``: (cos, sin [m, d] or [m, 1, d], contiguous,
        head_dim d, half as in ``attention``): q's heads rotated in the same call."""
        width = self._q_and_latent_width(x, q, kv, rope)
        cos, sin, d, half = rope if rope is not None else (None, None, 1, 0)
        latent = torch.empty(x.shape[0], kv.columns)
        out = self._half(
            "decode_q_and_latent", x, parts, norm, width,
            None if q is None else q.address, kv.address,
            None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(),
            d, half, latent.data_ptr(),
        )  # fmt: skip
        return out, latent

    @staticmethod
    def _q_and_latent_width(
        x: torch.Tensor,
        q: Projection | None,
        kv: Projection,
        rope: tuple[torch.Tensor, torch.Tensor, int, int] | None,
    ) -> int:
        """q's columns, once ``q_and_latent``'s operands are checked."""
        low_rank = q is None
        if bool(kv.ups) != low_rank or kv.down is None or kv.in_width != x.shape[-1]:
            raise ValueError(f"decode block: q and a k|v latent from x {tuple(x.shape)}")
        if not low_rank and (q.ups or q.in_width != x.shape[-1]):
            raise ValueError(f"decode block: a dense q from x {tuple(x.shape)}")
        width = kv.out_width if low_rank else q.out_width
        if rope is not None:
            cos, sin, d, _ = rope
            tables = cos.numel() == sin.numel() == x.shape[0] * d and cos.is_contiguous()
            if not (tables and sin.is_contiguous() and width % d == 0):
                raise ValueError(f"decode block: RoPE tables {tuple(cos.shape)} for q of {width}")
        return width

    def latent_attention(
        self,
        x: torch.Tensor,
        parts: list[torch.Tensor],
        norm: tuple[torch.Tensor, float],
        projections: tuple[Projection | None, Projection, int],
        rope: tuple[torch.Tensor, torch.Tensor, int, int],
        attention: latent_scores.LatentAttention,
    ) -> torch.Tensor:
        """``decode_latent_attention``: ``q_and_latent`` (``projections`` = its q and kv,
        and the first of the latent's k|v columns), then ``attention``'s latent attention
        with that q and those columns as the new latents, in one call -> the heads'
        output [m, q's columns] (before W_o)."""
        q, kv, kv_first = projections
        width, (cos, sin, d, half) = self._q_and_latent_width(x, q, kv, rope), rope
        a, heads = attention, width // d
        fits = a.layer.r_k + a.layer.u_v.shape[1] + kv_first <= kv.columns
        fits = fits and x.shape[0] == a.step.slots.shape[0]
        if not (fits and latent_operands.cache_fits(a.rows, a.layer, a.step, a.tables, heads, d)):
            checks = {"k|v columns within the latent, one row per sequence": fits}
            checks |= latent_operands.cache_checks(a.rows, a.layer, a.step, a.tables, heads, d)
            latent_operands.check("latent attention", checks)
        return self._half(
            "decode_latent_attention", x, parts, norm, width,
            None if q is None else q.address, kv.address, cos.data_ptr(), sin.data_ptr(), d,
            half, a.library.attention_address, a.layer.address, a.step.address,
            a.rows.data_ptr(), a.rows.shape[0], a.rows.stride(0), kv_first,
            a.tables[0].data_ptr(), a.tables[1].data_ptr(), a.scale,
        )  # fmt: skip

    def attention(
        self,
        x: torch.Tensor,
        parts: list[torch.Tensor],
        norm: tuple[torch.Tensor, float] | None,
        qkv: Projection,
        heads: tuple[int, int, int],
        rope: tuple[torch.Tensor, torch.Tensor, int],
        cache: tuple[torch.Tensor, ...],
        scale: float,
        o: Projection,
    ) -> torch.Tensor:
        """The attention half (``decode_attention`` in the C file): x [m, h] += parts (in
        place), and the heads' output times W_o [m, o's columns]. ``norm``: (weight, eps),
        or None where x is q|k|v's gathered latent (no parts; ``qkv`` its up factors);
        ``heads``: (query heads, KV heads, head_dim) of this rank; ``rope``: (cos, sin
        [m, d] or [m, 1, d], contiguous, half); ``cache``: (k_rows, v_rows [slots, KV, d], new_slots
        [m], slots [m, L], lengths [m], int64, every slot a row of the cache); ``qkv``,
        ``o``: projections whose shapes the caller has checked."""
        m, (n_heads, kv_heads, d) = x.shape[0], heads
        cos, sin, half = rope
        k_rows, v_rows, new_slots, slots, lengths = cache
        tables = cos.numel() == sin.numel() == m * d and cos.is_contiguous() and sin.is_contiguous()
        if not tables:
            raise ValueError(f"decode block: RoPE tables {tuple(cos.shape)}, want {(m, d)}")
        want = (k_rows.shape[0], kv_heads, d)
        fits = all(t.shape == want and t.is_contiguous() for t in (k_rows, v_rows))
        indexes = all(
            t.dtype == torch.int64 and t.is_contiguous() and t.shape[0] == m
            for t in (new_slots, slots, lengths)
        )
        if not (fits and indexes):  # the slots' range: ``DenseDecodeCache`` checks it once
            raise ValueError(f"decode block: cache rows {tuple(k_rows.shape)}, want {want}")
        return self._half(
            "decode_attention", x, parts, norm, o.out_width,
            qkv.address, n_heads, kv_heads, d, cos.data_ptr(), sin.data_ptr(), half,
            k_rows.data_ptr(), v_rows.data_ptr(), new_slots.data_ptr(), slots.data_ptr(),
            slots.shape[1], lengths.data_ptr(), scale, o.address,
        )  # fmt: skip

    def mlp(
        self,
        x: torch.Tensor,
        parts: list[torch.Tensor],
        norm: tuple[torch.Tensor, float] | None,
        gate_up: Projection,
        inter: int,
        down: Projection,
        after: tuple[torch.Tensor, Projection] | None = None,
    ) -> torch.Tensor:
        """The MLP half (``decode_mlp``): x += parts (in place), and W_down's product of
        silu(gate) · up [m, down's columns]; ``inter``: this rank's MLP columns; ``norm``
        None as in ``attention``. ``after`` = (the heads' output [m, k], o): x += that
        times o first, in the same call (a latent-cache layer's attention output; not
        with ``norm`` None)."""
        heads_out, k, o = self._after(x, norm, after)
        return self._half(
            "decode_mlp", x, parts, norm, down.out_width,
            heads_out, k, o, gate_up.address, inter, down.address,
        )  # fmt: skip

    def _half(
        self,
        entry: str,
        x: torch.Tensor,
        parts: list[torch.Tensor],
        norm: tuple[torch.Tensor, float] | None,
        out_width: int,
        *arguments: object,
    ) -> torch.Tensor:
        """Call a half-block entry point (``_HALF``'s leading arguments: x, its summands,
        the norm; then ``arguments``; then the output, [m, out_width], returned)."""
        parts = _checked_rows(x, parts)
        m, h = x.shape
        out = torch.empty(m, out_width)
        pointers, strides = _pointers(parts)
        weight, eps = _norm(norm, parts)
        function = getattr(self.lib, entry)
        failed = function(
            x.data_ptr(), m, h, pointers, strides, len(parts), weight, eps, *arguments,
            out.data_ptr(),
        )  # fmt: skip
        if failed == -2:  # decode_latent_attention's: its slots are checked by the call
            raise ValueError("latent attention: need slots within the cache's rows")
        if failed:
            raise MemoryError(f"decode block: no scratch for {m} rows")
        return out

    def cached_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: tuple[torch.Tensor, ...],
        scale: float,
    ) -> torch.Tensor | None:
        """``decode_cached_attention``: q [m, heads, d], k and v [m, KV, d] (k rotated; each
        head's vectors contiguous, rows any stride) written to the cache and attended; the
        output [m, heads, d]. ``cache`` as in ``attention``. None for operands it does not
        take (not fp32 on the CPU, vectors not contiguous)."""
        k_rows, v_rows, new_slots, slots, lengths = cache
        m, heads, d = q.shape
        kv_heads = k.shape[1]
        operands = (q, k, v, k_rows, v_rows)
        fp32 = all(t.dtype == torch.float32 and t.device.type == "cpu" for t in operands)
        unit = all(t.stride(2) == 1 and t.stride(1) == d for t in (q, k, v))
        want = (k_rows.shape[0], kv_heads, d)
        fits = all(t.shape == want and t.is_contiguous() for t in (k_rows, v_rows))
        if not (fp32 and unit and fits and k.shape == v.shape == (m, kv_heads, d)):
            return None
        out = torch.empty(m, heads, d)
        failed = self.lib.decode_cached_attention(
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), m,
            heads, kv_heads, d, k_rows.data_ptr(), v_rows.data_ptr(), new_slots.data_ptr(),
            slots.data_ptr(), slots.shape[1], lengths.data_ptr(), scale, out.data_ptr(),
        )  # fmt: skip
        if failed:
            raise MemoryError(f"decode attention: no scratch for {m} rows")
        return out


def build_library(
    compiler: str, target: Path, flags: tuple[str, ...] = native_build.FLAGS
) -> DecodeBlockLibrary:
    """Compile the source to ``target`` (unless it is there) and load it."""
    return _configured(native_build.compile_and_load(compiler, SOURCE, target, flags))


# Each entry point's arguments, one letter each: p a pointer, i an int64, f a float. The
# two halves start alike: x, m, h, the summands' pointers, their strides and count, the
# norm's weight and eps.
_HALF = "piipp" + "ipf"
_SIGNATURES = {
    "decode_attention": _HALF + "piiipp" + "ipppp" + "ipfpp",
    "decode_mlp": _HALF + "pip" + "pipp",
    "decode_norm_project": _HALF + "pip" + "pp",
    "decode_q_and_latent": _HALF + "pppp" + "iipp",
    "decode_latent_attention": _HALF + "pppp" + "ii" + "ppp" + "piii" + "ppf" + "p",
    "decode_cached_attention": "pipipi" + "iiii" + "pppp" + "ipfp",
    "decode_layers": "piif" + "pi" + "iii" + "ppi" + "ppip" + "pp" + "fp",
}
_TYPES = {"p": ctypes.c_void_p, "i": ctypes.c_int64, "f": ctypes.c_float}


def _configured(lib: ctypes.CDLL) -> DecodeBlockLibrary:
    for name, letters in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes = [_TYPES[c] for c in letters]
        function.restype = ctypes.c_int
    return DecodeBlockLibrary(lib)


@functools.cache
def decode_block_library() -> DecodeBlockLibrary | None:
    """The library for this CPU (``native_build.cached_library``), or None where it did
    not build."""
    lib = native_build.cached_library(SOURCE, "decode block")
    return None if lib is None else _configured(lib)
