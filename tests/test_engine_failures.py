"""A request that makes a step raise ends alone, with one clear error; the engine (and the
server's engine thread) keeps serving. Sampling fields are bounded where they are made,
and the logit adjustments and prompt log-probabilities equal a hand computation."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from dsl.errors import UserError
from runtime.engine.llm import LLM
from runtime.engine.sampling import adjusted, prompt_token_logprobs, sample
from runtime.engine.sequence import SamplingParams
from runtime.serve.engine_loop import EngineLoop, Finished, TokenEvent
from runtime.serve.metrics import ServerMetrics
from tests.hardening import hardening_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return hardening_model(tmp_path_factory.mktemp("failures"))


def _breaking_params() -> SamplingParams:
    """Parameters that pass every check and then make the ranks' sampling raise, as any
    bug inside a step would (a top_p that is not a number)."""
    params = SamplingParams(temperature=1.0, max_tokens=3)
    object.__setattr__(params, "top_p", "not a number")
    return params


@pytest.mark.parametrize("tp", [1, 2])
def test_a_step_that_raises_ends_its_requests_and_the_engine_goes_on(model, tp, caplog):
    with LLM(*model, tp=tp) as llm:
        free = len(llm.blocks.free)
        outs = llm.generate([[1, 2], [3, 4]], [_breaking_params(), SamplingParams(max_tokens=3)])
        reasons = {o.finish_reason for o in outs}
        assert len(reasons) == 1
        (reason,) = reasons
        assert reason.startswith("error: the step failed: ") and "\n" not in reason
        assert "not a number" in reason or "dimensions" in reason
        assert not llm.scheduler.has_work() and len(llm.blocks.free) == free
        assert sum("the step failed" in r.getMessage() for r in caplog.records) == 1
        (out,) = llm.generate([[1, 2]], SamplingParams(max_tokens=3))
        assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_the_servers_engine_thread_survives_a_failing_request(model):
    """Through ``EngineLoop`` (the server's engine thread): the failing request gets its
    error, the load stays alive, the next request is served."""

    async def scenario(llm: LLM) -> tuple[list, list, bool]:
        loop = EngineLoop(llm, ServerMetrics(), max_in_flight=8)
        loop.start()
        try:
            bad = loop.submit([1, 2], _breaking_params())
            bad_events = [await asyncio.wait_for(bad.events.get(), 60)]
            good = loop.submit([1, 2], SamplingParams(max_tokens=2))
            good_events = []
            while not good_events or not isinstance(good_events[-1], Finished):
                good_events.append(await asyncio.wait_for(good.events.get(), 60))
            return bad_events, good_events, loop.load.alive
        finally:
            loop.stop()

    with LLM(*model, tp=1) as llm:
        bad_events, good_events, alive = asyncio.run(scenario(llm))
    (finished,) = bad_events
    assert isinstance(finished, Finished) and finished.reason.startswith("error: the step failed")
    assert alive
    assert [type(e) for e in good_events] == [TokenEvent, TokenEvent, Finished]
    assert good_events[-1].reason == "length"


@pytest.mark.parametrize(
    "params,words",
    [
        ({"temperature": 1e-40}, "temperature must be 0 (greedy) or"),
        ({"temperature": 1e-46}, "temperature must be 0 (greedy) or"),
        ({"top_k": 2**64}, "top_k must be 0 (off) to"),
        ({"frequency_penalty": 2.5}, "frequency_penalty must be in [-2, 2]"),
        ({"presence_penalty": math.nan}, "presence_penalty must be in [-2, 2]"),
        ({"logit_bias": ((3, 101.0),)}, "logit_bias[3] must be in [-100, 100]"),
        ({"logit_bias": ((-1, 1.0),)}, "token ids are integers >= 0"),
        ({"logit_bias": ((True, 1.0),)}, "token ids are integers >= 0"),
        ({"prompt_logprobs": 21}, "prompt_logprobs must be 0 to 20"),
    ],
)
def test_sampling_fields_are_bounded_where_they_are_made(params, words):
    with pytest.raises(UserError) as err:
        SamplingParams(**params)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_temperature_at_the_minimum_samples_the_greedy_token():
    logits = torch.tensor([[0.0, 30.0, 29.9, -5.0]])
    params = SamplingParams(temperature=1e-5)
    gen = torch.Generator().manual_seed(0)
    assert all(sample(logits, [params], [gen]) == [1] for _ in range(20))


def test_the_engine_refuses_ids_beyond_its_vocabulary(model):
    with LLM(*model, tp=1) as llm:
        for params, words in (
            (SamplingParams(top_k=49), "top_k is 49; the vocabulary has 48 tokens"),
            (SamplingParams(logit_bias=((48, 1.0),)), "logit_bias names token 48"),
        ):
            with pytest.raises(UserError, match=words):
                llm.generate([[1, 2]], params)
            assert not llm.scheduler.has_work()


def test_logit_adjustments_equal_a_hand_computation():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.5, 0.5, 0.5, 0.5]])
    biased = SamplingParams(logit_bias=((0, 10.0), (3, -1.5)))
    penalised = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    out = adjusted(logits, [biased, penalised], [None, {2: 3, 1: 1}])
    want = torch.tensor([[11.0, 2.0, 3.0, 2.5], [0.5, 0.5 - 0.5 - 1.0, 0.5 - 1.5 - 1.0, 0.5]])
    torch.testing.assert_close(out, want)
    assert adjusted(logits, [SamplingParams()] * 2, [None, None]) is logits  # untouched


def test_prompt_log_probabilities_equal_a_hand_computation():
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(1))
    targets = [4, 0, 6]
    got = prompt_token_logprobs(logits, targets, 2)
    logp = torch.log_softmax(logits, dim=-1)
    for row, (lp, target) in enumerate(zip(got, targets, strict=True)):
        assert math.isclose(lp.logprob, float(logp[row, target]), abs_tol=1e-6)
        best = logp[row].topk(2)
        assert [t for t, _ in lp.top] == best.indices.tolist()
        values = [v for _, v in lp.top]
        torch.testing.assert_close(torch.tensor(values), best.values, atol=1e-6, rtol=0)
    assert all(lp.top == () for lp in prompt_token_logprobs(logits, targets, 0))


def test_prompt_log_probabilities_equal_score_across_prefill_chunks(model):
    """Computed in the prefill, chunk by chunk (a chunk of 4 tokens splits the prompt)."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    with LLM(*model, tp=1, prefill_chunk=4) as llm:
        (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1))
        score = llm.score(prompt)
    seq_logprobs = out.prompt_logprobs
    assert seq_logprobs[0] is None and len(seq_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        assert math.isclose(seq_logprobs[i].logprob, float(score[i - 1, prompt[i]]), abs_tol=1e-4)
