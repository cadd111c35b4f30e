"""The decode step is graph-safe by construction: two steps with different sequence
lengths (same bucket) run the identical aten op/shape trace, with no host sync. And it
goes one way: from ``ModelRunner.step`` to its first matrix product in at most eight
calls on either path (docs/ARCHITECTURE.md traces them)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from codegen.generate import generate, write_atomically
from dsl import build_plan, parse_spec
from runtime.engine.config import EngineOptions, RunnerConfig, resolve
from runtime.engine.model_runner import ModelRunner, SeqInput
from runtime.engine.sequence import SamplingParams
from runtime.kernels.decode_block import decode_block_library
from tests.hf_models import TINY_LLAMA, TINY_RANKS, make_decomposed

HOST_SYNC = {
    "_local_scalar_dense",
    "item",
    "nonzero",
    "nonzero_static",
    "masked_select",
    "unique",
    "_unique2",
    "repeat_interleave",
}
RUNTIME = {
    "dtype": "float32",
    "block_size": 4,
    "max_batch_size": 4,
    "max_seq_len": 32,
    "cuda_graph_batch_sizes": [1, 2, 4],
}


class Trace(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args)
        self.ops.append((func.__name__, shapes))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def runner_factory(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("graph")
    spec_path, ckpt, _, _ = make_decomposed(tmp, "llama", TINY_LLAMA, TINY_RANKS, 1, RUNTIME)
    spec = parse_spec(spec_path.read_text(), "tiny-hf")
    write_atomically(generate(spec).files, tmp / "gen")

    def make(kv: str, backend: str | None, path: str = "static") -> ModelRunner:
        options = EngineOptions(path=path, backend=backend, kv_cache=kv, cuda_graphs=False)
        facts = resolve(options, spec)
        plan = build_plan(spec, modes=("deinfer",), up_layout=facts.up_layout).modes["deinfer"]
        config = RunnerConfig(spec, plan, str(tmp / "gen"), str(ckpt), 16, options, facts)
        return ModelRunner(0, 1, config)

    return make


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kv", ["latent", "dense"])
def test_decode_step_trace_is_static_and_sync_free(runner_factory, kv, backend):
    """The step a CUDA graph captures: the torch references and the Triton launchers
    (here in Triton's interpreter) run the same ops on the same shapes whatever the
    sequences' lengths, and nothing reads a device value on the host."""
    runner = runner_factory(kv, backend)
    params = SamplingParams(max_tokens=8)
    a = SeqInput(0, [1, 2, 3, 4, 5], 5, [3, 7], params)
    b = SeqInput(1, [6, 7], 2, [0], params)
    runner.step([a, b], True)
    traces = []
    for step_seqs in (
        [SeqInput(0, [9], 6, [3, 7], params), SeqInput(1, [9], 3, [0], params)],
        [SeqInput(0, [9], 9, [3, 7, 9], params), SeqInput(1, [9], 4, [0], params)],
    ):
        static = runner.static
        bucket = static.bucket_for(len(step_seqs))
        static.prepare(step_seqs, bucket, runner.attention.slot)  # host side, outside the graph
        with Trace() as trace:
            static.step(bucket)
        traces.append(trace.ops)
    assert traces[0] == traces[1], "decode step trace depends on sequence lengths"
    names = {name.split(".")[0] for name, _ in traces[0]}
    assert not names & HOST_SYNC, names & HOST_SYNC
    assert len(traces[0]) > 50  # the whole model ran under the recorder


PRODUCTS = {"mm", "addmm", "bmm", "matmul", "linear", "_linear_pointwise"}
REPO = Path(__file__).resolve().parents[1]


class FirstProduct(TorchDispatchMode):
    """Records the project's calls, outermost first, that led to the first matrix
    product after ``ModelRunner.step`` (torch's own frames left out)."""

    def __init__(self, generated: str):
        super().__init__()
        self.roots = (str(REPO), generated)
        self.chain: list[str] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.chain is None and func.__name__.split(".")[0] in PRODUCTS:
            chain, frame = [], sys._getframe(1)
            while frame is not None and frame.f_code is not ModelRunner.step.__code__:
                name = frame.f_code.co_filename
                ours = name.startswith(self.roots) and "site-packages" not in name
                if ours and "/tests/" not in name:  # not a venv inside the checkout (CI's)
                    chain.append(f"{Path(name).stem}.{frame.f_code.co_name}")
                frame = frame.f_back
            assert frame is not None, "the product was not reached from ModelRunner.step"
            self.chain = chain[::-1]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("path", "backend"), [("dynamic", None), ("static", "torch")])
def test_decode_step_reaches_its_first_product_in_eight_calls(runner_factory, path, backend):
    runner = runner_factory("latent", backend, path)
    params = SamplingParams(max_tokens=8)
    runner.step([SeqInput(0, [1, 2, 3], 3, [0], params)], True)
    recorder = FirstProduct(runner.config.generated)
    with recorder:
        runner.step([SeqInput(0, [4], 4, [0], params)], False)
    chain = recorder.chain
    assert chain is not None and chain[0] == "model_runner.decode", chain
    # the static path's first product is a layer's; on the dynamic path the layers
    # multiply in native calls (their halves over panels), so the first torch product
    # is the LM head's
    native = path == "dynamic" and decode_block_library() is not None
    first = "transformer.logits" if native else "deinfer_layers.column_group"
    assert first in chain, chain
    assert len(chain) <= 8, " -> ".join(chain)
