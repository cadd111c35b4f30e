"""The README and docs/ stay true: the README is short, its blocks marked runnable run,
every link in it and in docs/ reaches a file (and a heading, for an anchor), and every
`deinfer` command written in them parses with today's options."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import deinfer_parser, gen_parser, tune_parser
from tests.conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
RUNNABLE = re.compile(r"<!-- runnable -->\n```bash\n(.*?)^```", re.S | re.M)
PARSERS = {"deinfer": deinfer_parser, "deinfer-gen": gen_parser, "deinfer-tune": tune_parser}


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def _links(path: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(FENCE.sub("", path.read_text()))]


def test_the_readme_fits_on_a_few_screens():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_resolves(doc):
    links = _links(doc)
    for link in links:
        assert not link.startswith(("http://", "https://")), f"{doc.name}: {link} leaves the repo"
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        assert path.is_relative_to(REPO) and path.exists(), f"{doc.name}: {link} is missing"
        if anchor:
            assert anchor in _anchors(path), f"{doc.name}: {link} names no heading"


def test_the_link_checker_sees_a_broken_link(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("[a](missing.md) and ![b](here.png)\n```\n[not](a-link.md)\n```\n")
    assert _links(doc) == ["missing.md", "here.png"]
    assert _slug("Serving benchmark (HTTP)") == "serving-benchmark-http"


def _commands(text: str) -> tuple[list[str], list[str]]:
    """The `deinfer`, `deinfer-gen` and `deinfer-tune` command lines written in code:
    those of fenced blocks (a `$ ` prompt and backslash continuations allowed), which
    are whole, and inline spans, which may be fragments (`deinfer run --tp 2`)."""
    whole = []
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.removeprefix("$ ").split("#")[0].split("&&")[-1].strip()
            whole.append(line)
    spans = re.findall(r"`([^`\n]+)`", FENCE.sub("", text))
    return [c for c in whole if _command(c)], [c for c in spans if _command(c)]


def _command(text: str) -> bool:
    """A command, not a synopsis (options in brackets, alternatives, an ellipsis, a
    PLACEHOLDER)."""
    words = text.split()
    return (
        len(words) > 1
        and words[0] in PARSERS
        and not any(mark in text for mark in ("[", "|", "...", "…", "<"))
        and not any(re.fullmatch(r"[A-Z][A-Z_]*", w) for w in words)
    )


def _parse_error(command: str) -> str | None:
    """argparse's complaint about ``command``, or None when it parses."""
    words = shlex.split(command)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            PARSERS[words[0]]().parse_args(words[1:])
    except SystemExit:
        return stderr.getvalue().strip() or "exit"
    return None


def _options(command: str) -> set[str]:
    """The option strings the command's (sub)parser knows."""
    words = shlex.split(command)
    parser = PARSERS[words[0]]()
    for action in parser._actions:  # the subcommand's own parser, where there is one
        if isinstance(action, argparse._SubParsersAction) and words[1] in action.choices:
            parser = action.choices[words[1]]
    return {o for action in parser._actions for o in action.option_strings}


def test_every_written_command_parses():
    """Whole commands parse; a fragment may leave out required arguments but names no
    option that does not exist."""
    found = [_commands(doc.read_text()) for doc in DOCS]
    whole = [c for w, _ in found for c in w]
    fragments = [c for _, f in found for c in f]
    assert len(whole) > 20 and len(fragments) > 20  # the docs' commands were found
    failed = [f"{c}: {_parse_error(c)}" for c in whole if _parse_error(c)]
    for command in fragments:
        error = _parse_error(command)
        if error and "are required" not in error:
            failed.append(f"{command}: {error}")
        flags = {w.split("=")[0] for w in shlex.split(command) if w.startswith("--")}
        if flags - _options(command):
            failed.append(f"{command}: no option {', '.join(sorted(flags - _options(command)))}")
    assert not failed, "\n".join(failed)


def test_the_readme_runnable_blocks_run(tmp_path):
    blocks = RUNNABLE.findall((REPO / "README.md").read_text())
    assert blocks, "no block of the README is marked runnable"
    script = "\n".join(blocks).replace("/tmp/demo", str(tmp_path / "demo"))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    tokens = re.search(r"^\[1, 2, 3, 4\] -> ([\d ]+)$", proc.stdout, re.M)
    assert tokens and len(tokens.group(1).split()) == 8, proc.stdout[-2000:]
    assert "comm units" in proc.stdout or "collectives" in proc.stdout  # the plan printed
