"""From an OpenAI request body to what the engine runs: for each prompt × ``n``, a choice
with its prompt token ids (the chat template applied), sampling parameters and text
stream with its stop strings — or a ``BadRequest`` that says, in one line, what is wrong.

Tokenizing runs off the event loop (``encode_prompts``, called in the server's tokenizer
thread); everything here is checked before any choice reaches the engine, so a request
runs whole or not at all."""

from __future__ import annotations

from dataclasses import dataclass, replace

from runtime.engine.llm import LLM
from runtime.engine.sequence import SamplingParams
from runtime.serve.body import BadRequest
from runtime.serve.protocol import ChatCompletionRequest, CompletionRequest, _Request
from runtime.serve.text import TextStream

OPENAI_DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str  # what ``echo`` sends back: the prompt as given, or its ids decoded


@dataclass(frozen=True)
class Choice:
    index: int  # prompt index × n + sample index, as OpenAI numbers choices
    prompt: Prompt
    params: SamplingParams
    text: TextStream
    echo: bool = False  # send the prompt (and its log-probabilities, if asked) first
    drop_output: bool = False  # max_tokens 0: the one token the engine makes is not sent


def encode_prompts(req: CompletionRequest, llm: LLM) -> list[Prompt]:
    """Each prompt's token ids (and text, for echo); runs in the tokenizer thread."""
    tokenizer = llm.tokenizer
    out = []
    for i, prompt in enumerate(req.prompt):
        field = "prompt" if len(req.prompt) == 1 else f"prompt[{i}]"
        if isinstance(prompt, str):
            if tokenizer is None:
                raise BadRequest(
                    "text prompts need a tokenizer in the checkpoint; send token ids",
                    param="prompt",
                )
            out.append(Prompt(list(tokenizer.encode(prompt)), prompt))
        else:
            ids = check_token_ids(prompt, llm.spec.model.vocab_size, field)
            text = tokenizer.decode(ids) if tokenizer is not None and req.echo else ""
            out.append(Prompt(ids, text))
    return out


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


def _check_vocabulary(req: _Request, vocab: int) -> None:
    if req.top_k > vocab:
        raise BadRequest(f"top_k is {req.top_k}; the vocabulary has {vocab} tokens", param="top_k")
    for token, _ in req.bias_pairs():
        if token >= vocab:
            raise BadRequest(
                f"logit_bias names token {token}; the vocabulary has ids 0 to {vocab - 1}",
                param="logit_bias",
            )


def _max_tokens(req: _Request, prompt_len: int, limit: int) -> int:
    if isinstance(req, ChatCompletionRequest):
        return req.max_completion_tokens or req.max_tokens or max(1, limit - prompt_len)
    return OPENAI_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens


def _base_params(req: _Request, llm: LLM, logprobs: int | None) -> SamplingParams:
    vocab = llm.spec.model.vocab_size
    _check_vocabulary(req, vocab)
    stop_ids = set(check_token_ids(list(req.stop_token_ids or []), vocab, "stop_token_ids"))
    eos = getattr(llm.tokenizer, "eos_token_id", None)
    if eos is not None and not req.ignore_eos:
        stop_ids.add(int(eos))
    echo = isinstance(req, CompletionRequest) and req.echo
    return SamplingParams(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=max(0, req.top_k),
        seed=req.seed,
        stop_token_ids=tuple(sorted(stop_ids)),
        logprobs=logprobs,
        prompt_logprobs=logprobs if echo else None,
        logit_bias=req.bias_pairs(),
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
    )


def admit(req: _Request, prompts: list[Prompt], llm: LLM, logprobs: int | None) -> list[Choice]:
    """One choice per prompt × ``n``; refuses the whole request if any cannot run.
    With a seed, sample j of a prompt uses seed + j (n equal seeds would give n equal
    samples)."""
    base = _base_params(req, llm, logprobs)
    echo = isinstance(req, CompletionRequest) and req.echo
    limit = llm.spec.runtime.max_seq_len
    choices = []
    for i, prompt in enumerate(prompts):
        field = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if not prompt.ids:
            raise BadRequest(f"{field} is empty", param="prompt")
        wanted = _max_tokens(req, len(prompt.ids), limit)
        max_tokens = max(1, wanted)  # 0 (echo): the engine makes one token, not sent
        reason = llm.unfit_reason(len(prompt.ids), max_tokens)
        if reason is not None:
            raise BadRequest(reason, param="max_tokens" if len(prompt.ids) < limit else "prompt")
        hidden = frozenset(base.stop_token_ids)
        for j in range(req.n):
            seed = None if req.seed is None else (req.seed + j) % 2**64
            params = replace(base, max_tokens=max_tokens, seed=seed)
            text = TextStream(llm.tokenizer, req.stop_strings(), hidden)
            choices.append(Choice(i * req.n + j, prompt, params, text, echo, wanted == 0))
    return choices
