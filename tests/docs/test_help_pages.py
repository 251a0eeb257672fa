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


def test_help_lists_the_users_verbs_first_then_the_admin_and_developer_groups() -> None:
    text = build_parser().format_help()
    sections = [line for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert [s.split(" (")[0].rstrip(":") for s in sections] == [
        "verbs", "node and admin verbs", "developer verbs", "options"], sections

    def listed(title: str) -> list[str]:
        block = text.split(title, 1)[1].split("\n\n", 1)[0]
        return [line.split()[0] for line in block.splitlines()[1:] if line.startswith("  ") and line[2] != " "]

    assert listed("\nnode and admin verbs") == ["prolog", "epilog", "scavenge"]
    assert listed("\ndeveloper verbs") == ["bench", "demo", "cuda"]
    users = listed("\nverbs:")
    assert {"requeue", "run", "ls", "history", "template"} <= set(users)
    assert not {"prolog", "epilog", "scavenge", "bench", "demo", "cuda"} & set(users)
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert {"prolog", "epilog", "scavenge", "bench", "demo", "cuda"} <= set(sub.choices)  # still top-level verbs
