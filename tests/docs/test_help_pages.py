"""Every verb's --help ends with the docs page to read next, and that page exists."""
from __future__ import annotations

import argparse
from pathlib import Path

from hpcckpt.cli.main import DOCS, build_parser

REPO = Path(__file__).resolve().parents[2]


def test_every_verb_names_an_existing_page() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for verb, verb_parser in sub.choices.items():
        text = verb_parser.format_help()
        page = DOCS.get(verb, "docs/reference/cli.md")
        assert text.rstrip().endswith(f"Read next: {page} (and docs/reference/cli.md#{verb}).".split()[-1]), verb
        assert f"Read next: {page}" in " ".join(text.split()), verb
        assert (REPO / page).is_file(), page
