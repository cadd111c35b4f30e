"""From an OpenAI request body to what the engine runs: prompt token ids (the chat
template applied), sampling parameters, the text stream with its stop strings — or a
``BadRequest`` that says, in one line, what is wrong."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runtime.engine.llm import LLM
from runtime.engine.sequence import SamplingParams
from runtime.serve.protocol import ChatCompletionRequest, CompletionRequest, _Request
from runtime.serve.text import TextStream


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


@dataclass(frozen=True)
class Admitted:
    prompt: list[int]
    params: SamplingParams
    text: TextStream


def completion_prompt(req: CompletionRequest, llm: LLM) -> list[int]:
    prompt: Any = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise BadRequest("one prompt per request (batched prompts are not supported)")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if llm.tokenizer is None:
            raise BadRequest(
                "text prompts need a tokenizer in the checkpoint; send token ids", param="prompt"
            )
        return list(llm.tokenizer.encode(prompt))
    return check_token_ids(list(prompt), llm.spec.model.vocab_size, "prompt")


def chat_prompt(req: ChatCompletionRequest, llm: LLM) -> list[int]:
    tokenizer = llm.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise BadRequest(
            "this checkpoint has no chat template (tokenizer_config.json); use /v1/completions",
            param="messages",
        )
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # the template's own error (e.g. roles it does not allow)
        raise BadRequest(f"chat template failed: {exc}", param="messages") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def check_token_ids(ids: list[int], vocab: int, field: str) -> list[int]:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise BadRequest(
                f"{field}[{i}] is token id {t}, the vocabulary has ids 0 to {vocab - 1}",
                param=field,
            )
    return ids


def admit(req: _Request, prompt: list[int], llm: LLM, logprobs: int | None) -> Admitted:
    """Sampling parameters and the text stream for ``prompt``; refuses what cannot run."""
    if req.n != 1:
        raise BadRequest(f"n must be 1 (found {req.n}); send separate requests", param="n")
    if not prompt:
        raise BadRequest("the prompt is empty", param="prompt")
    limit = llm.spec.runtime.max_seq_len
    max_tokens = req.max_tokens
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens or max_tokens or max(1, limit - len(prompt))
    elif max_tokens is None:
        max_tokens = 16  # the OpenAI completions default
    reason = llm.unfit_reason(len(prompt), max_tokens)
    if reason is not None:
        raise BadRequest(reason, param="max_tokens" if len(prompt) < limit else "prompt")
    vocab = llm.spec.model.vocab_size
    stop_ids = set(check_token_ids(list(req.stop_token_ids or []), vocab, "stop_token_ids"))
    eos = getattr(llm.tokenizer, "eos_token_id", None)
    if eos is not None and not req.ignore_eos:
        stop_ids.add(int(eos))
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=max(0, req.top_k),
        seed=req.seed,
        stop_token_ids=tuple(sorted(stop_ids)),
        logprobs=logprobs,
    )
    text = TextStream(llm.tokenizer, req.stop_strings(), frozenset(stop_ids))
    return Admitted(prompt, params, text)
