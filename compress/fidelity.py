"""How close a decomposed checkpoint is to its dense model, measured through our engine
(any mode, any tp): perplexity on held-out text, mean KL divergence of the next-token
distributions against the dense model, top-1 agreement, greedy continuations.

Held-out text is either a file or sequences sampled from the dense model itself with a
seed of their own (data-free; calibration uses another seed, so they are held out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from compress.calibration import file_texts, sample_sequences, text_sequences
from dsl.errors import UserError
from runtime.model.checkpoint import has_tokenizer

DEFAULT_PROMPTS = ("The capital of France is",)


@dataclass(frozen=True)
class EvalConfig:
    self_samples: int = 8  # held-out sequences sampled from the dense model (0: none)
    length: int = 96  # tokens per held-out sequence
    seed: int = 1234  # differs from calibration's seed 0: held-out, not seen
    text: Path | None = None  # perplexity on this file too
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    max_new_tokens: int = 8


@dataclass
class Reference:
    """The dense model's side of the comparison, computed once."""

    sampled: list[list[int]]
    sampled_logprobs: list[torch.Tensor]  # [L, vocab] per sampled sequence
    text: list[list[int]]
    text_logprobs: list[torch.Tensor]
    prompts: list[list[int]]
    continuations: list[list[int]]
    metrics: dict[str, Any] = field(default_factory=dict)


@torch.inference_mode()
def dense_reference(model_dir: str | Path, cfg: EvalConfig) -> Reference:
    """Evaluation sequences and the dense transformers model's answers on them."""
    import transformers

    tokenizer = None
    if has_tokenizer(Path(model_dir)):
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    elif cfg.text or cfg.prompts not in ((), DEFAULT_PROMPTS):
        raise UserError(f"{model_dir}: no tokenizer, so no --text or --prompt (use --self N)")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32
    ).eval()
    start = tokenizer.bos_token_id if tokenizer is not None else None
    if start is None:
        start = model.config.bos_token_id or 0
    sampled = (
        sample_sequences(model, start, cfg.self_samples, cfg.length, cfg.seed)
        if cfg.self_samples
        else []
    )
    text = text_sequences(file_texts(cfg.text), tokenizer, cfg.length, None) if cfg.text else []

    def logprobs(seq: list[int]) -> torch.Tensor:
        logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)

    prompts = [list(tokenizer.encode(p)) for p in cfg.prompts] if tokenizer else []
    continuations = []
    for ids in prompts:
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=cfg.max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=start,
        )
        continuations.append(out[0, len(ids) :].tolist())
    ref = Reference(
        sampled=sampled,
        sampled_logprobs=[logprobs(s) for s in sampled],
        text=text,
        text_logprobs=[logprobs(s) for s in text],
        prompts=prompts,
        continuations=continuations,
    )
    ref.metrics = {
        "ppl_sampled": perplexity(ref.sampled, ref.sampled_logprobs),
        "ppl_text": perplexity(ref.text, ref.text_logprobs),
        "continuations": [tokenizer.decode(c) if tokenizer else c for c in continuations],
    }
    return ref


def perplexity(sequences: list[list[int]], logprobs: list[torch.Tensor]) -> float | None:
    """exp of the mean negative log-likelihood of each token after the first."""
    if not sequences:
        return None
    nll, count = 0.0, 0
    for seq, lp in zip(sequences, logprobs, strict=True):
        targets = torch.tensor(seq[1:])
        nll -= float(lp[:-1].gather(1, targets[:, None]).sum())
        count += len(targets)
    return math.exp(nll / count)


def divergence(reference: list[torch.Tensor], model: list[torch.Tensor]) -> tuple[float, float]:
    """(mean KL(dense ‖ model) in nats, top-1 agreement) over every position."""
    kl, agree, count = 0.0, 0, 0
    for p, q in zip(reference, model, strict=True):
        kl += float((p.exp() * (p - q)).sum())
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        count += p.shape[0]
    return kl / count, agree / count


def evaluate(llm, ref: Reference, cfg: EvalConfig) -> dict[str, Any]:
    """Metrics of the engine ``llm`` (an ``LLM``) against the dense reference."""
    from runtime.engine.sequence import SamplingParams

    sampled = [llm.score(s) for s in ref.sampled]
    text = [llm.score(s) for s in ref.text]
    vocab = ref.sampled_logprobs[0].shape[-1] if ref.sampled_logprobs else None
    if vocab is not None and sampled and sampled[0].shape[-1] != vocab:
        raise UserError(
            f"vocabulary differs: dense model {vocab}, checkpoint {sampled[0].shape[-1]}"
        )
    out: dict[str, Any] = {
        "ppl_sampled": perplexity(ref.sampled, sampled),
        "ppl_text": perplexity(ref.text, text),
    }
    if sampled:
        out["kl"], out["top1"] = divergence(ref.sampled_logprobs, sampled)
    params = SamplingParams(max_tokens=cfg.max_new_tokens)
    outputs = llm.generate(ref.prompts, params)
    out["continuations"] = [
        llm.tokenizer.decode(o.token_ids) if llm.tokenizer else o.token_ids for o in outputs
    ]
    out["greedy_equal_dense"] = [
        o.token_ids == c for o, c in zip(outputs, ref.continuations, strict=True)
    ]
    return out
