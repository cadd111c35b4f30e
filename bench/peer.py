"""What a user would run a small model on a CPU with instead of this engine: llama.cpp,
through ``llama-cpp-python`` where it is installed (optional: never required), on the
same weights written as an fp32 GGUF.

``write_gguf`` writes the transformers tensors of a checkpoint (``hf_reference.dense_state``)
in llama.cpp's names and layout: q and k rows reordered from transformers' rotate-half
RoPE to llama.cpp's adjacent pairs, as llama.cpp's own converter does, and a vocabulary
of type "none" (the bench feeds token ids; there is no text). ``LlamaCpp`` decodes
greedily through llama.cpp's C API, one sequence id per request, and reports the figures
of ``baseline.hf_throughput``.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.baseline import throughput_figures
from dsl.errors import UserError
from dsl.spec import Spec

# transformers' names of layer i's tensors -> llama.cpp's (``blk.{i}.`` + name)
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def available() -> bool:
    """Whether llama-cpp-python is installed here."""
    return importlib.util.find_spec("llama_cpp") is not None


def check_supported(spec: Spec) -> None:
    """The models this writer covers: Llama-family blocks with rotate-half RoPE."""
    m = spec.model
    plain = not (m.bias.qkv or m.qk_norm or m.positions.scaling) and m.mlp.kind == "glu"
    if m.family not in ("llama", "mistral") or m.positions.style != "neox" or not plain:
        raise UserError(
            f"llama.cpp peer: model.family {m.family!r} with these options is not supported "
            "(Llama blocks, neox RoPE, no biases or q/k norms)"
        )


def rope_pairs_adjacent(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q or k projection [heads * d, in] reordered per head from rotate-half
    pairs (i, i + d/2) to adjacent ones (2i, 2i + 1), the order llama.cpp rotates."""
    out, rest = weight.shape[0], weight.shape[1:]
    pairs = weight.reshape(heads, 2, out // heads // 2, *rest).transpose(1, 2)
    return pairs.reshape(weight.shape)


def write_gguf(spec: Spec, state: dict[str, torch.Tensor], path: Path) -> int:
    """``state`` (transformers names, fp32) as a llama.cpp model file at ``path``.
    Returns the bytes of weights a decode step streams: every tensor but the embedding
    table, which a step only looks rows up in (unless it is the output matrix too)."""
    import gguf

    check_supported(spec)
    m = spec.model
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(m.max_position_embeddings)
    writer.add_embedding_length(m.hidden_size)
    writer.add_block_count(m.num_layers)
    writer.add_feed_forward_length(m.intermediate_size)
    writer.add_head_count(m.num_heads)
    writer.add_head_count_kv(m.num_kv_heads)
    writer.add_key_length(m.head_dim)
    writer.add_value_length(m.head_dim)
    writer.add_rope_dimension_count(m.head_dim)
    writer.add_rope_freq_base(m.positions.theta)
    writer.add_layer_norm_rms_eps(m.norm.eps)
    writer.add_vocab_size(m.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("none")
    streamed = 0
    for name, tensor in _gguf_tensors(spec, state):
        writer.add_tensor(name, tensor.float().contiguous().numpy())
        if name != "token_embd.weight" or m.tie_word_embeddings:
            streamed += tensor.numel() * 4
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return streamed


def _gguf_tensors(spec: Spec, state: dict[str, torch.Tensor]):
    m = spec.model
    yield "token_embd.weight", state["model.embed_tokens.weight"]
    yield "output_norm.weight", state["model.norm.weight"]
    if not m.tie_word_embeddings:
        yield "output.weight", state["lm_head.weight"]
    heads = {"self_attn.q_proj.weight": m.num_heads, "self_attn.k_proj.weight": m.num_kv_heads}
    for i in range(m.num_layers):
        for ours, theirs in _LAYER_NAMES.items():
            tensor = state[f"model.layers.{i}.{ours}"]
            if ours in heads:
                tensor = rope_pairs_adjacent(tensor, heads[ours])
            yield f"blk.{i}.{theirs}", tensor


def _ignore_log(level: int, text: bytes, user_data: object) -> None:
    """llama.cpp's log goes nowhere: the bench's progress lines are its output."""


@functools.cache
def _quiet_log():
    """The C callback of ``_ignore_log``, made once and kept alive (C holds its pointer)."""
    import llama_cpp

    return llama_cpp.llama_log_callback(_ignore_log)


class LlamaCpp:
    """A llama.cpp model and context for up to ``sequences`` requests of ``context``
    tokens each, decoding with ``threads`` threads."""

    def __init__(
        self, path: Path, sequences: int, context: int, threads: int, streamed_bytes: int = 0
    ) -> None:
        import llama_cpp

        self.api = llama_cpp
        self.streamed_weight_bytes = streamed_bytes  # for the bench's floor
        llama_cpp.llama_log_set(_quiet_log(), None)
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(
            str(path).encode(), llama_cpp.llama_model_default_params()
        )
        if not self.model:
            raise UserError(f"llama.cpp peer: could not load {path}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = sequences * context
        params.n_batch = params.n_ubatch = sequences * context
        params.n_seq_max = sequences
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(sequences * context, 0, sequences)
        self.sequences = sequences

    def set_threads(self, threads: int) -> None:
        self.api.llama_set_n_threads(self.ctx, threads, threads)

    def _decode(self, tokens: list[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` of (token, position, sequence, wants logits) entries."""
        b = self.batch
        for i, (token, position, seq, wants) in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, position, 1
            b.seq_id[i][0], b.logits[i] = seq, wants
        b.n_tokens = len(tokens)
        if self.api.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama.cpp peer: llama_decode failed")

    def logits(self, index: int) -> np.ndarray:
        """The logits of the last decode's ``index``-th entry (one that asked for them)."""
        pointer = self.api.llama_get_logits_ith(self.ctx, index)
        return np.ctypeslib.as_array(
            ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(self.vocab,)
        )

    def prompt_logits(self, prompt: list[int]) -> np.ndarray:
        """[len(prompt), vocab] logits of every prompt position (sequence 0)."""
        self.reset()
        self._decode([(t, p, 0, True) for p, t in enumerate(prompt)])
        return np.stack([self.logits(i).copy() for i in range(len(prompt))])

    def reset(self) -> None:
        self.api.llama_memory_clear(self.api.llama_get_memory(self.ctx), True)

    def generate(
        self, prompts: list[list[int]], output_len: int
    ) -> tuple[list[list[int]], list[float]]:
        """Greedy tokens of every prompt at once (equal lengths) and the time each
        decode step ended (the first: the prompts')."""
        if len(prompts) > self.sequences:
            raise ValueError(f"{len(prompts)} prompts for {self.sequences} sequences")
        self.reset()
        length = len(prompts[0])
        entries = [
            (t, p, s, p == length - 1) for s, pr in enumerate(prompts) for p, t in enumerate(pr)
        ]
        self._decode(entries)
        # logits are read by the entry's place in the decoded batch: each prompt's last
        # entry, then one entry per sequence
        last = [s * length + length - 1 for s in range(len(prompts))]
        outputs: list[list[int]] = [[] for _ in prompts]
        times = []
        for step in range(output_len):
            new = [int(self.logits(i).argmax()) for i in last]
            last = list(range(len(prompts)))
            times.append(time.perf_counter())
            for out, token in zip(outputs, new, strict=True):
                out.append(token)
            if step + 1 < output_len:
                self._decode([(t, length + step, s, True) for s, t in enumerate(new)])
        return outputs, times

    def throughput(self, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
        """``generate``'s figures, as ``baseline.hf_throughput`` reports them."""
        start = time.perf_counter()
        _, times = self.generate(prompts, output_len)
        return throughput_figures(prompts, output_len, time.perf_counter() - start, times)

    def close(self) -> None:
        if self.ctx:
            self.api.llama_batch_free(self.batch)
            self.api.llama_free(self.ctx)
            self.api.llama_model_free(self.model)
            self.ctx = None
