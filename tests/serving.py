"""What the server tests share: a tiny decomposed checkpoint with a word-level tokenizer
and a chat template, and ``deinfer serve`` on it as a subprocess (127.0.0.1, a free
port) with what the tests ask of it."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai

from bench.serve import ServerProcess
from tests.hf_models import TINY_LLAMA, TINY_RANKS, make_decomposed, tiny_runtime

VOCAB = 48
# Positions for long generations (disconnects, signals mid-run); 48 words in the vocabulary.
CONFIG = {**TINY_LLAMA, "vocab_size": 48, "max_position_embeddings": 512, "initializer_range": 0.15}
RUNTIME = tiny_runtime(max_seq_len=480, max_batch_size=8)
MODEL = "tiny-hf"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}t47"
PROMPT = "t1 t2 t3 t4 t5"
MAX_TOKENS = 9


def _words(tokens: list[int]) -> str:
    return " ".join(f"t{t}" for t in tokens)


def words(tokens: list[int]) -> str:
    return " ".join(f"t{t}" for t in tokens)


def serving_checkpoint(tmp: Path) -> tuple[Path, Path]:
    """(spec, checkpoint with tokenizer and chat template)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    spec, ckpt, _ref, _ = make_decomposed(tmp, "llama", CONFIG, TINY_RANKS, 1, RUNTIME)
    vocabulary = Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    vocabulary.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=vocabulary)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(ckpt)
    return spec, ckpt


class Server(ServerProcess):
    """``deinfer serve`` on the tiny checkpoint, with what the tests ask of it."""

    def __init__(self, spec: Path, ckpt: Path, tp: int, log: Path, *extra: str) -> None:
        args = ["--spec", str(spec), "--checkpoint", str(ckpt), "--tp", str(tp), *extra]
        super().__init__(args, log, timeout_s=180)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        values = [line.split()[-1] for line in text.splitlines() if line.startswith(name)]
        return float(values[0]) if values else 0.0

    def children(self) -> list[int]:
        out = []
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                lines = status.read_text().splitlines()
            except OSError:
                continue
            ppid = next((line.split()[1] for line in lines if line.startswith("PPid:")), "0")
            if int(ppid) == self.proc.pid:
                out.append(int(status.parent.name))
        return out


def not_zombie(pid: int) -> bool:
    try:
        return " Z " not in Path(f"/proc/{pid}/stat").read_text().split(")", 1)[1][:4]
    except OSError:
        return False
