"""End to end: the engine's greedy generation equals transformers' generate token for
token on a random tiny decomposed model (fp32), at tp 1 and 2, in modes deinfer (dense
and latent KV cache), base and dense, on both execution paths (static: the graph-safe
GPU path; dynamic: the CPU path), so the paths also agree with each other; also with
chunked prefill, with preemption and with requests arriving late."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dsl.errors import UserError
from runtime.engine.llm import LLM
from runtime.engine.sequence import SamplingParams
from tests.conftest import REPO
from tests.hf_models import TINY_RANKS, make_decomposed
from tests.test_emulated_link import needs_netns

CONFIG = {
    "vocab_size": 48,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 24,
    "max_position_embeddings": 64,
    "initializer_range": 0.15,
}
RUNTIME = {
    "dtype": "float32",
    "block_size": 4,
    "max_batch_size": 8,
    "max_seq_len": 40,
    "cuda_graph_batch_sizes": [1, 2, 4, 8],
}
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22]]
MAX_TOKENS = 7


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine")
    spec_path, ckpt, ref, _spec = make_decomposed(tmp, "llama", CONFIG, TINY_RANKS, 1, RUNTIME)
    ref.generation_config.eos_token_id = None  # compare full lengths
    want = []
    with torch.no_grad():
        for p in PROMPTS:
            out = ref.generate(
                torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
            )
            want.append(out[0, len(p) :].tolist())
    return spec_path, ckpt, want


@pytest.mark.parametrize("path", ["static", "dynamic"])
@pytest.mark.parametrize(
    "tp,mode,kv,up,layout",
    [
        (1, "deinfer", "dense", "auto", "paper"),
        (1, "deinfer", "latent", "auto", "paper"),
        (1, "base", "dense", "auto", "paper"),
        (1, "dense", "dense", "auto", "paper"),
        # auto: o/down up factors split by columns (the ranks share memory here)
        (2, "deinfer", "dense", "auto", "paper"),
        (2, "deinfer", "latent", "auto", "paper"),
        (2, "deinfer", "dense", "replicated", "paper"),  # the paper's layout
        (2, "base", "dense", "auto", "paper"),
        (2, "dense", "dense", "auto", "paper"),
        # optimized: on this tiny model every matrix merged (dense KV), or some beside
        # the latent cache's k and v
        (1, "deinfer", "dense", "auto", "optimized"),
        (2, "deinfer", "dense", "auto", "optimized"),
        (2, "deinfer", "latent", "auto", "optimized"),
    ],
)
def test_greedy_equals_transformers(model, tp, mode, kv, up, layout, path):
    spec_path, ckpt, want = model
    backend = "triton" if (tp, kv) == (2, "latent") else "torch"
    options = {"kv_cache": kv, "backend": backend, "path": path, "up_layout": up}
    with LLM(spec_path, ckpt, tp=tp, mode=mode, layout=layout, **options) as llm:
        merged = {n for names in llm.facts.merges.values() for n in names}
        if layout == "paper" or mode != "deinfer":
            assert merged == set()
        elif kv == "dense":  # the cost model's choice (profile cpu-here): all merged
            assert merged == set(TINY_RANKS)
        else:  # a latent cache keeps k and v latent; others merged beside them
            assert merged and not merged & {"k", "v"}
        want_layout = "sharded" if (tp, mode, up) == (2, "deinfer", "auto") else "replicated"
        assert llm.workers.call("plan_up_layout") == [want_layout] * tp
        # r_k = 5 over 2 KV heads of 8: 2 RoPE pairs copied, shared out over the ranks
        want_copies = {i: (4 // tp, 16 // tp) for i in range(2)} if kv == "latent" else {}
        assert llm.workers.call("latent_key_copies") == [want_copies] * tp
        # on the CPU path, layers with a dense cache decode through the native block
        # (panels, one call per half-block, cut at the latent's collectives across
        # ranks): dense and deinfer ones at any tp (not Base's)
        native = mode != "base" and kv == "dense" and path == "dynamic"
        blocks = CONFIG["num_hidden_layers"] if native else 0
        assert llm.workers.call("decode_block_layers") == [blocks] * tp
        # on one rank a step's layers run in one native call where each has native halves
        # (the block, or a latent cache's two halves); across ranks each half is cut at
        # its collectives
        layers = CONFIG["num_hidden_layers"]
        both = [llm.workers.call(f"{h}_half_layers")[0] for h in ("mlp", "latent")]
        native_halves = blocks == layers or min(both) == layers
        stacked = layers if tp == 1 and native_halves else 0
        assert llm.workers.call("decode_stack_layers") == [stacked] * tp
        # across ranks the low-rank rows' up factors held whole (replicated) are multiplied
        # by the next half's call: o's and down's with a dense cache, down's with a latent
        rows = 0
        if mode == "deinfer" and tp > 1 and path == "dynamic" and want_layout == "replicated":
            latent_rows = {"o", "down"} - merged if kv == "dense" else {"down"} - merged
            rows = len(latent_rows) * CONFIG["num_hidden_layers"]
        assert llm.workers.call("pending_up_groups") == [rows] * tp
        # a latent cache's layers: the MLP half alone, where gate and up are both merged or
        # both latent
        mlp_whole = len(merged & {"gate", "up"}) in (0, 2)
        half = mode == "deinfer" and kv == "latent" and path == "dynamic" and mlp_whole
        halves = CONFIG["num_hidden_layers"] if half else 0
        assert llm.workers.call("mlp_half_layers") == [halves] * tp
        # and on one rank the attention's projections (q merged beside the k|v latent, or
        # q's latent first in it)
        attn_halves = halves if tp == 1 else 0
        assert llm.workers.call("latent_half_layers") == [attn_halves] * tp
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outs] == want
    assert all(o.finish_reason == "length" and len(o.token_times) == MAX_TOKENS for o in outs)


@pytest.mark.parametrize(
    "merged,native,down",
    [
        ({"q", "k", "v", "o"}, True, "sharded"),  # attention merged, the MLP latent
        ({"q", "k", "v", "o"}, True, "replicated"),  # ... its down factors whole
        ({"o", "down"}, True, "sharded"),  # the rows merged (Megatron shards), columns latent
        ({"q", "gate"}, False, "sharded"),  # column groups part merged: no native block
        ({"q", "gate"}, False, "replicated"),
    ],
)
def test_native_block_across_ranks_in_mixed_layouts(model, monkeypatch, merged, native, down):
    """The decode block across ranks with merged and latent matrices side by side (the
    driver's layout choice replaced by a fixed one), the column groups' down factors
    split or whole: same greedy tokens, and the layers it covers."""
    from runtime.engine import config

    spec_path, ckpt, want = model

    def fixed(options, spec, kv, up_layout, link, down_layout, path):
        return {shape: frozenset(merged) for shape in spec.layer_shapes()}

    monkeypatch.setattr(config, "planned_merges", fixed)
    options = {"kv_cache": "dense", "path": "dynamic", "down_layout": down}
    with LLM(spec_path, ckpt, tp=2, mode="deinfer", layout="optimized", **options) as llm:
        assert {n for names in llm.facts.merges.values() for n in names} == merged
        blocks = CONFIG["num_hidden_layers"] if native else 0
        assert llm.workers.call("decode_block_layers") == [blocks] * 2
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outs] == want


@pytest.mark.parametrize("up", ["replicated", "sharded"])
@pytest.mark.parametrize("kv", ["dense", "latent"])
def test_whole_down_factors_need_no_latent_all_gather(model, kv, up):
    """The column groups' down factors whole on every rank (``down_layout``
    replicated): each rank computes the whole latent, no all-gather of it; same greedy
    tokens, and the native block covers the dense-cache layers in one call per half."""
    spec_path, ckpt, want = model
    options = {"kv_cache": kv, "path": "dynamic", "up_layout": up, "layout": "paper"}
    with LLM(spec_path, ckpt, tp=2, down_layout="replicated", **options) as llm:
        assert llm.facts.down_layout == "replicated" and all(
            c.whole for c in llm.plan.layer_plans[0].concats
        )
        blocks = CONFIG["num_hidden_layers"] if kv == "dense" else 0
        assert llm.workers.call("decode_block_layers") == [blocks] * 2
        halves = CONFIG["num_hidden_layers"] - blocks  # a latent cache: the MLP half alone
        assert llm.workers.call("mlp_half_layers") == [halves] * 2
        # up factors held whole: o's and down's products (down's alone beside a latent
        # cache) made by the next half's call, in it or just before it where it is one call
        rows = (2 if kv == "dense" else 1) * CONFIG["num_hidden_layers"]
        assert llm.workers.call("pending_up_groups") == [rows if up == "replicated" else 0] * 2
        llm.workers.call("set_comm_stats", "count")
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
        stats = llm.workers.call("take_comm_stats")[0]
    assert [o.token_ids for o in outs] == want
    # block collectives: the two all-reduces in r, and the up factors' output gathers
    # where they are split; no latent all-gather
    layers, steps = CONFIG["num_hidden_layers"], stats["all_reduce"][0]
    assert steps % (2 * layers) == 0
    gathers = stats.get("all_gather", (0,))[0]
    assert gathers == (steps if up == "sharded" else 0), stats


@pytest.mark.parametrize("kv", ["dense", "latent"])
def test_a_rank_alone_counts_the_collectives_the_plan_counts(model, kv):
    """At tp 1 the native block (dense cache) and its MLP half (latent cache) keep the
    latents in their calls' scratch; each skipped collective is still counted as the
    plan counts it, so the bench's measured = plan check holds for every path."""
    from bench.variants import planned_elements
    from dsl import load_spec

    spec_path, ckpt, want = model
    with LLM(spec_path, ckpt, tp=1, kv_cache=kv, path="dynamic", layout="paper") as llm:
        natively = (
            llm.workers.call("decode_block_layers")[0] + llm.workers.call("mlp_half_layers")[0]
        )
        assert natively == CONFIG["num_hidden_layers"]
        latent_halves = CONFIG["num_hidden_layers"] if kv == "latent" else 0
        assert llm.workers.call("latent_half_layers") == [latent_halves]
        llm.workers.call("set_comm_stats", "count")
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
        stats = llm.workers.call("take_comm_stats")[0]
    assert [o.token_ids for o in outs] == want
    plan = planned_elements(load_spec(spec_path), "deinfer")
    blocks = {kind: stats[kind][1] / per_token for kind, per_token in plan.items()}
    # every kind moved plan's elements per token and block over the same token count
    assert blocks["all_gather"] == pytest.approx(blocks["all_reduce"], rel=1e-9), stats


def test_whole_down_factors_need_the_dynamic_path(model):
    spec_path, ckpt, _ = model
    with pytest.raises(UserError, match="down_layout replicated needs the dynamic path"):
        LLM(spec_path, ckpt, tp=2, path="static", down_layout="replicated")


@pytest.mark.parametrize("path", ["static", "dynamic"])
@pytest.mark.parametrize("kv", ["dense", "latent"])
def test_chunked_prefill(model, kv, path):
    """Prompts split over forwards of 3 tokens (a chunk attends to the cached part of its
    prompt, from a dense or a latent cache) give the same tokens."""
    spec_path, ckpt, want = model
    with LLM(spec_path, ckpt, tp=1, kv_cache=kv, path=path, prefill_chunk=3) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outs] == want


@pytest.mark.parametrize("tp", [1, 2])
def test_preemption_when_the_pool_is_too_small(model, tp):
    spec_path, ckpt, want = model
    # 6 blocks of 4 tokens cannot hold four sequences of up to 16 tokens at once.
    with LLM(spec_path, ckpt, tp=tp, kv_cache="latent", num_blocks=6) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outs] == want
    assert sum(o.num_preemptions for o in outs) > 0


def test_requests_arriving_while_others_decode(model):
    """(Also the gloo-only all-reduce: the shared-memory one is off here.)"""
    spec_path, ckpt, want = model
    with LLM(spec_path, ckpt, tp=2, kv_cache="dense", shm_collectives=False) as llm:
        params = SamplingParams(max_tokens=MAX_TOKENS)
        seqs = [llm.add_request(PROMPTS[0], params), llm.add_request(PROMPTS[1], params)]
        for _ in range(3):
            llm.step()
        seqs += [llm.add_request(p, params) for p in PROMPTS[2:]]
        too_long = llm.add_request(list(range(39)), params)
        while llm.scheduler.has_work():
            llm.step()
    assert [s.output for s in seqs] == want
    assert too_long.finish_reason.startswith("error:") and "max_seq_len" in too_long.finish_reason


@needs_netns
def test_greedy_behind_an_emulated_link_and_after_reshaping_it(model):
    """Ranks in their own namespaces behind a shaped link give the same tokens, before
    and after the rate changes in place."""
    spec_path, ckpt, want = model
    with LLM(spec_path, ckpt, tp=2, mode="base", link="400mbit") as llm:
        assert "emulated link 400 Mbit/s" in llm.describe_path()
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
        assert llm.set_link("100mbit")["bytes_per_s"] > 0
        again = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outs] == want
    assert [o.token_ids for o in again] == want


@needs_netns
def test_greedy_across_emulated_hosts_of_two_ranks(model):
    """tp 4 on two emulated machines (two ranks each, the link between them) gives
    transformers' tokens; link_hosts without a link, or not dividing tp, is one line."""
    spec_path, ckpt, want = model
    with LLM(spec_path, ckpt, tp=4, link="400mbit", link_hosts=2) as llm:
        assert "between 2 hosts of 2 ranks" in llm.describe_path()
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outs] == want
    with pytest.raises(UserError, match=r"link_hosts spreads the ranks .* needs a link"):
        LLM(spec_path, ckpt, tp=4, link_hosts=2)
    with pytest.raises(UserError, match="link_hosts must divide tp 4 into at least 2"):
        LLM(spec_path, ckpt, tp=4, link="400mbit", link_hosts=3)


def test_seeded_sampling_is_deterministic_and_streams(model):
    spec_path, ckpt, _ = model
    params = SamplingParams(max_tokens=5, temperature=0.8, top_p=0.9, top_k=20, seed=11)
    with LLM(spec_path, ckpt, tp=1) as llm:
        first = [o.token_ids for o in llm.generate(PROMPTS[:2], params)]
        second = [o.token_ids for o in llm.generate(PROMPTS[:2], params)]
        events = list(llm.stream(PROMPTS[:2], params))
    assert first == second
    assert [e.token_id for e in events if e.request == 0] == first[0]
    for request in (0, 1):  # each request's events end with its one "finished" event
        mine = [e for e in events if e.request == request]
        assert [e.finished for e in mine] == [False] * (len(mine) - 1) + [True]
        assert [e.token_id for e in mine] == first[request]
    with LLM(spec_path, ckpt, tp=2) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS[:2], params)] == first


def test_deinfer_run_cli_at_tp2(model):
    spec_path, ckpt, want = model
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli.main",
            "run",
            "--spec",
            str(spec_path),
            "--checkpoint",
            str(ckpt),
            "--tp",
            "2",
            "--prompt",
            "1,2,3,4,5",
            "--max-tokens",
            str(MAX_TOKENS),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert " ".join(map(str, want[0])) in proc.stdout


def test_deinfer_run_under_torchrun(model):
    """Rank 0 drives and prints the tokens; rank 1 follows its calls."""
    spec_path, ckpt, want = model
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "cli.main",
            "run",
            "--spec",
            str(spec_path),
            "--checkpoint",
            str(ckpt),
            "--tp",
            "2",
            "--prompt",
            "1,2,3,4,5",
            "--max-tokens",
            str(MAX_TOKENS),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "->" in line]
    assert lines == [f"[1, 2, 3, 4, 5] -> {' '.join(map(str, want[0]))}"]


def test_text_prompts_with_a_tokenizer(model, tmp_path):
    """A checkpoint with tokenizer files takes and returns text."""
    import shutil

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    spec_path, ckpt, want = model
    with_tok = tmp_path / "ckpt"
    shutil.copytree(ckpt, with_tok)
    words = Tokenizer(WordLevel({f"t{i}": i for i in range(48)}, unk_token="t0"))
    words.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(with_tok)
    with LLM(spec_path, with_tok, tp=1) as llm:
        (out,) = llm.generate(["t1 t2 t3 t4 t5"], SamplingParams(max_tokens=MAX_TOKENS))
    assert out.prompt_token_ids == [1, 2, 3, 4, 5] and out.token_ids == want[0]
    assert out.text.split() == [f"t{i}" for i in want[0]]
