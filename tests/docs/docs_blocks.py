"""The code blocks of the documentation, as the tests read them."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
FENCE = re.compile(r"^(?:<!-- (run|example): (\S+) -->\n)?```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    text: str
    mark: str | None  # "run" or "example"
    name: str | None  # the run block's name, or the example's file

    def __str__(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]


def blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    return [Block(page, text.count("\n", 0, m.start()) + 1, m.group(3), m.group(4), m.group(1), m.group(2))
            for m in FENCE.finditer(text)]


def shell_commands(text: str) -> list[list[str]]:
    """The simple commands of a shell block: continuation lines joined, comments dropped, split
    at `;`, `&&`, `||`, `|` and `&`; each as its words (quotes removed, nothing expanded)."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out: list[list[str]] = []
    for line in joined.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>()")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words: list[str] = []
        try:
            tokens = list(lexer)
        except ValueError:  # an unbalanced quote: not a command we can read
            continue
        redirect = False
        for tok in tokens + [";"]:
            if redirect:  # the target of a redirection is no word of the command
                redirect = False
            elif tok and set(tok) <= set("<>"):
                redirect = True
            elif tok and set(tok) <= set(";&|()"):
                if words:
                    out.append(words)
                words = []
            else:
                words.append(tok)
    return out
