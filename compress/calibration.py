"""Calibration: token sequences (from a text/JSONL file or sampled from the dense model
itself) run through a transformers model with forward hooks that stream each
projection input into ``InputStats``.

Projections that read the same tensor share one set of statistics: q/k/v read the
attention input, gate/up (or fc1) the MLP input; o and down (fc2) read their own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from compress.factorize import InputStats
from dsl.errors import UserError
from runtime.model.checkpoint import names_for

# The matrix whose input each matrix shares (the hook sits on the first of a group).
INPUT_OF = {
    "q": "q",
    "k": "q",
    "v": "q",
    "o": "o",
    "gate": "gate",
    "up": "gate",
    "down": "down",
    "fc1": "fc1",
    "fc2": "fc2",
}


@dataclass(frozen=True)
class CalibrationSource:
    """``self:N`` (N sequences sampled from the model) or a text / JSONL file."""

    file: Path | None
    self_samples: int

    @staticmethod
    def parse(text: str) -> CalibrationSource:
        if text.startswith("self:"):
            count = text.removeprefix("self:")
            if not count.isdigit() or not 1 <= int(count) <= 100_000:
                raise UserError(f"--calib {text}: expected self:N with N a positive integer")
            return CalibrationSource(None, int(count))
        path = Path(text)
        if not path.is_file():
            raise UserError(f"--calib {text}: no such file (give a text/JSONL file or self:N)")
        return CalibrationSource(path, 0)

    def describe(self) -> str:
        return f"self:{self.self_samples}" if self.file is None else str(self.file)


def file_texts(path: Path) -> list[str]:
    """Documents of a calibration/evaluation file: one per line of a ``.jsonl`` file
    (its ``text`` field), else the whole file as one text."""
    raw = path.read_bytes()
    try:
        content = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    if path.suffix != ".jsonl":
        if not content.strip():
            raise UserError(f"{path}: empty text")
        return [content]
    texts = []
    for number, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{number}: invalid JSON ({exc.msg})") from None
        if not isinstance(item, dict) or not isinstance(item.get("text"), str):
            raise UserError(f'{path}:{number}: expected an object with a "text" string')
        texts.append(item["text"])
    if not texts:
        raise UserError(f"{path}: no documents")
    return texts


def text_sequences(texts: list[str], tokenizer, length: int, count: int | None) -> list[list[int]]:
    """Consecutive windows of ``length`` tokens over the concatenated documents (the
    last, shorter one dropped unless it is the only one); at most ``count``."""
    ids: list[int] = []
    for text in texts:
        ids += tokenizer.encode(text, add_special_tokens=False)
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
    windows = [ids[i : i + length] for i in range(0, len(ids), length)]
    if len(windows) > 1 and len(windows[-1]) < length:
        windows.pop()
    windows = [w for w in windows if len(w) >= 2]
    if not windows:
        raise UserError("the text has fewer than 2 tokens")
    return windows[:count] if count else windows


@torch.inference_mode()
def sample_sequences(
    model, start_token: int, count: int, length: int, seed: int
) -> list[list[int]]:
    """``count`` sequences of ``length`` tokens sampled from ``model`` (temperature 1,
    the full distribution, end-of-text not special) after ``start_token``: data-free
    calibration and evaluation text. Deterministic for a seed on one machine; the
    global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model.generate(
            torch.full((count, 1), start_token, dtype=torch.long),
            attention_mask=torch.ones((count, 1), dtype=torch.long),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=length - 1,
            min_new_tokens=length - 1,
            eos_token_id=None,
            pad_token_id=start_token,
        )
    return out.tolist()


def calibration_sequences(
    source: CalibrationSource, model, tokenizer, length: int, seed: int
) -> list[list[int]]:
    if source.file is None:
        start = tokenizer.bos_token_id if tokenizer is not None else None
        if start is None:
            start = model.config.bos_token_id if model.config.bos_token_id is not None else 0
        return sample_sequences(model, start, source.self_samples, length, seed)
    if tokenizer is None:
        raise UserError("--calib FILE needs a tokenizer in the model folder (or use self:N)")
    return text_sequences(file_texts(source.file), tokenizer, length, None)


def by_length(sequences: list[list[int]]) -> list[list[list[int]]]:
    """The sequences in groups of one length (each group runs as one batch), in the
    order each length first appears."""
    groups: dict[int, list[list[int]]] = {}
    for seq in sequences:
        groups.setdefault(len(seq), []).append(seq)
    return list(groups.values())


@torch.inference_mode()  # statistics only: no autograd graph through the calibration
def collect_input_stats(
    model, spec_model, sequences: list[list[int]], gram: bool = True, progress: bool = True
) -> dict[tuple[int, str], InputStats]:
    """{(layer, input name): InputStats} for every projection input of ``model`` (a
    transformers model of ``spec_model``'s architecture) over ``sequences``."""
    names = names_for(spec_model)
    inputs = sorted({INPUT_OF[m] for m in spec_model.matrices}, key=list(INPUT_OF).index)
    stats: dict[tuple[int, str], InputStats] = {}
    handles = []
    for layer in range(spec_model.num_layers):
        for name in inputs:
            module = model.get_submodule(names.layer(layer, name))
            width = module.in_features
            entry = stats[(layer, name)] = InputStats(width, gram=gram)
            handles.append(module.register_forward_pre_hook(_hook(entry)))
    try:
        for seq in tqdm(sequences, desc="calibrate", unit="seq", disable=not progress):
            model(input_ids=torch.tensor([seq]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return stats


def _hook(entry: InputStats):
    def hook(module, args):
        entry.add(args[0])

    return hook
