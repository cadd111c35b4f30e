"""The parsed spec: frozen dataclasses. Raw YAML never leaves ``dsl.load`` (and
``dsl.dump`` writes it back only as canonical text)."""

from __future__ import annotations

from dataclasses import dataclass

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "opt")
GLU_MATRICES = ("q", "k", "v", "o", "gate", "up", "down")
PLAIN_MATRICES = ("q", "k", "v", "o", "fc1", "fc2")
DTYPES = ("float32", "float16", "bfloat16")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
KV_CACHE_KINDS = ("dense", "latent", "auto")
ROPE_STYLES = ("neox", "gptj")
ROPE_SCALING_TYPES = ("linear", "llama3")
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")


@dataclass(frozen=True)
class RopeScaling:
    type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0


@dataclass(frozen=True)
class Positions:
    """Rotary (``kind='rope'``) or learned absolute positions (``kind='learned'``)."""

    kind: str
    theta: float = 10000.0
    style: str = "neox"
    scaling: RopeScaling | None = None
    offset: int = 0  # learned positions: OPT stores position p at row p + 2

    @property
    def rope_style(self) -> str:
        """How RoPE pairs a head's dims (neox | gptj), or "none" without RoPE."""
        return self.style if self.kind == "rope" else "none"


@dataclass(frozen=True)
class Norm:
    kind: str  # "rms" | "layer"
    eps: float


@dataclass(frozen=True)
class Mlp:
    kind: str  # "glu" | "plain"
    activation: str


@dataclass(frozen=True)
class Bias:
    qkv: bool
    o: bool
    mlp: bool


@dataclass(frozen=True)
class ModelConfig:
    family: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    positions: Positions
    norm: Norm
    mlp: Mlp
    bias: Bias
    qk_norm: bool
    tie_word_embeddings: bool

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def matrices(self) -> tuple[str, ...]:
        return GLU_MATRICES if self.mlp.kind == "glu" else PLAIN_MATRICES

    def matrix_shape(self, name: str) -> tuple[int, int]:
        """(in, out) of projection ``name`` in y = x·W."""
        h, m = self.hidden_size, self.intermediate_size
        return {
            "q": (h, self.q_width),
            "k": (h, self.kv_width),
            "v": (h, self.kv_width),
            "o": (self.q_width, h),
            "gate": (h, m),
            "up": (h, m),
            "down": (m, h),
            "fc1": (h, m),
            "fc2": (m, h),
        }[name]


@dataclass(frozen=True)
class LayerRanks:
    """Rank of each projection of one layer; ``None`` means the matrix stays dense."""

    ranks: tuple[tuple[str, int | None], ...]

    def rank(self, name: str) -> int | None:
        return dict(self.ranks)[name]

    def is_decomposed(self, name: str) -> bool:
        return self.rank(name) is not None

    def as_dict(self) -> dict[str, int | None]:
        return dict(self.ranks)

    def key(self) -> str:
        """Short stable identifier of this layer shape, e.g. ``q4916_k614_..._odense``."""
        return "_".join(f"{n}{'dense' if r is None else r}" for n, r in self.ranks)


@dataclass(frozen=True)
class Decomposition:
    rule: str | None  # how default ranks were derived, for the record
    ratio: float | None
    layers: tuple[LayerRanks, ...]  # one entry per transformer layer


@dataclass(frozen=True)
class Parallel:
    tp: int


@dataclass(frozen=True)
class RuntimeConfig:
    dtype: str
    block_size: int
    max_batch_size: int
    max_seq_len: int
    kv_cache: str
    cuda_graph_batch_sizes: tuple[int, ...]


@dataclass(frozen=True)
class Spec:
    name: str
    model: ModelConfig
    decomposition: Decomposition
    parallel: Parallel
    runtime: RuntimeConfig

    # Validated replacements (``dsl.variants``; imported here on use: it needs the loader,
    # which needs these classes).
    def layer_shapes(self) -> tuple[LayerRanks, ...]:
        """Distinct layer shapes in first-appearance order (equal ranks share code)."""
        seen: dict[LayerRanks, None] = {}
        for layer in self.decomposition.layers:
            seen.setdefault(layer, None)
        return tuple(seen)

    def layers_of_shape(self, shape: LayerRanks) -> tuple[int, ...]:
        return tuple(i for i, lr in enumerate(self.decomposition.layers) if lr == shape)
