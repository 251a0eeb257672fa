"""docs/reference/ is generated from the code by scripts/gen-reference: the committed pages must
be what the script writes now, so that they cannot fall behind a verb, an option or a docstring."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .docs_blocks import REPO


def test_the_committed_reference_is_what_the_code_generates(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gen-reference"), "--check"], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr


def test_the_reference_names_every_verb_option_and_public_name() -> None:
    import hpcckpt
    import hpcckpt.own
    from hpcckpt.cli.main import build_parser
    from hpcckpt.config import TUNABLES

    cli = (REPO / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    parser = build_parser()
    verbs = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, sub in verbs.choices.items():
        assert f"## `hpcckpt {name}`" in cli, name
        for action in sub._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in cli, (name, flag)
    options = (REPO / "docs" / "reference" / "options.md").read_text(encoding="utf-8")
    assert all(f"`{t.env}`" in options for t in TUNABLES.values())
    python = (REPO / "docs" / "reference" / "python.md").read_text(encoding="utf-8")
    for name in hpcckpt.__all__:
        if name != "RequeueExit":
            assert f"`hpcckpt.{name}`" in python, name
    assert all(f"`hpcckpt.own.{n}`" in python for n in hpcckpt.own.__all__)
