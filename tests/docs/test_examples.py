"""The examples of the documentation cannot rot:

- a page's copy of an example (`<!-- example: examples/F -->` above the block) is the file;
- the blocks marked `<!-- run: NAME -->` (getting started, integration, own checkpoints, CRIU mode) run as
  they are, in a fresh directory with `examples/` in it and the venv's commands first on PATH
  (those named `*-slurm` on the test's local Slurm cluster: tests/integration/test_docs_slurm.py);
- every `hpcckpt ...` command line in the README and the docs parses with the real parser (a
  renamed verb or option fails here), and the `scripts/`, `slurm/` and `examples/` files the
  blocks name exist;
- the `python` blocks compile.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .docs_blocks import REPO, Block, blocks, pages, shell_commands

ALL = [b for page in pages() for b in blocks(page)]
RUN = [b for b in ALL if b.mark == "run" and not (b.name or "").endswith("-slurm")]
SLURM_RUN = [b for b in ALL if b.mark == "run" and (b.name or "").endswith("-slurm")]


def test_the_pages_have_examples_and_run_blocks() -> None:
    names = {b.name for b in RUN}
    assert {"getting-started-laptop", "getting-started-check", "integrate-local", "own-checkpoints-local",
            "criu-local"} <= names, names
    assert {b.name for b in SLURM_RUN} >= {"getting-started-slurm", "own-checkpoints-slurm", "criu-slurm"}
    assert {b.name for b in ALL if b.mark == "example"} >= {"examples/train.py", "examples/own_train.py",
                                                            "examples/plain_train.py"}


@pytest.mark.parametrize("block", [b for b in ALL if b.mark == "example"], ids=str)
def test_a_pages_copy_of_an_example_is_the_file(block: Block) -> None:
    assert block.name is not None
    assert block.text.rstrip("\n") == (REPO / block.name).read_text(encoding="utf-8").rstrip("\n"), (
        f"{block}: the block differs from {block.name}; copy the file into the page")


@pytest.mark.parametrize("block", [b for b in ALL if b.lang == "python" and "reference" not in b.page.parts], ids=str)
def test_python_blocks_compile(block: Block) -> None:
    try:
        compile(block.text, str(block), "exec")  # `...` stands for the script's own code: an expression
    except SyntaxError as exc:
        if "outside function" in str(exc) or "outside loop" in str(exc) or "unexpected indent" in str(exc):
            return  # a fragment of a loop or function body, shown in its place
        raise


def _hpcckpt_lines() -> list[tuple[Block, list[str]]]:
    out = []
    for b in ALL:
        if b.lang not in ("bash", "sh"):
            continue
        for words in shell_commands(b.text):
            while words and "=" in words[0] and not words[0].startswith(("-", "'")):
                words = words[1:]  # VAR=value before the command
            if words and words[0] == "hpcckpt":
                out.append((b, words))
    return out


@pytest.mark.parametrize(("block", "words"), _hpcckpt_lines(), ids=lambda v: str(v) if isinstance(v, Block) else " ".join(v))
def test_every_documented_hpcckpt_command_parses(block: Block, words: list[str]) -> None:
    from hpcckpt.cli.main import build_parser
    try:
        build_parser().parse_args(words[1:])
    except SystemExit as exc:
        pytest.fail(f"{block}: `{' '.join(words)}` does not parse (exit {exc.code})")


def test_the_files_the_blocks_name_exist() -> None:
    missing = []
    for b in ALL:
        if b.lang not in ("bash", "sh"):
            continue
        for words in shell_commands(b.text):
            for word in words:
                if word.startswith(("scripts/", "slurm/", "examples/", "jobscripts/")):
                    if not (REPO / word).exists():
                        missing.append(f"{b}: {word}")
    assert not missing, missing


def _requirements(name: str) -> list[pytest.MarkDecorator]:
    return [pytest.mark.criu, pytest.mark.slow] if name.startswith("criu") else [pytest.mark.slow]


@pytest.mark.parametrize("block", [pytest.param(b, marks=_requirements(b.name or ""), id=b.name) for b in RUN])
def test_a_run_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    if (block.name or "").startswith("criu"):
        if os.geteuid() != 0:
            pytest.skip("CRIU dumps need root")
        from hpcckpt.criu import find_criu
        from hpcckpt.errors import CriuError
        try:
            find_criu()
        except CriuError as exc:
            pytest.skip(f"no criu: {exc}")
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    bindir = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCCKPT_", "SLURM_"))}
    env.update(PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block.text], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, f"{block} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    if block.name == "getting-started-laptop":
        assert (tmp_path / "run" / "history.png").stat().st_size > 0
        assert "2 interruption(s), 0 lost step(s), finished" in proc.stdout
    if block.name == "getting-started-check":
        assert "hpcckpt check: identical" in proc.stdout
    if block.name == "own-checkpoints-local":
        assert "exit 75" in proc.stdout and "resumed at step" in proc.stdout
    if block.name == "criu-local":
        assert "1 interruption(s)" in proc.stdout and "finished" in proc.stdout
