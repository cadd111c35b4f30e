"""What the hardening tests share: a small model with room for long generations, and
the one-line check of an error message."""

from __future__ import annotations

from pathlib import Path

from tests.hf_models import TINY_LLAMA, TINY_RANKS, make_decomposed, tiny_runtime

# Positions for long generations (disconnects, signals mid-run); 48 words in the vocabulary.
CONFIG = {**TINY_LLAMA, "vocab_size": 48, "max_position_embeddings": 512, "initializer_range": 0.15}
RUNTIME = tiny_runtime(max_seq_len=480, max_batch_size=4)


def one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1, text
    return lines[0]


def hardening_model(tmp: Path) -> tuple[Path, Path]:
    """(spec, checkpoint) of the decomposed tiny Llama at tp 2."""
    spec, ckpt, _ref, _ = make_decomposed(tmp, "llama", CONFIG, TINY_RANKS, 2, RUNTIME)
    return spec, ckpt
