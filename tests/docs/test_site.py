"""The documentation site builds with `mkdocs build --strict`: a broken link, a missing anchor,
a page left out of the navigation or a missing page is an error. The README's links to the
docs resolve too (MkDocs does not read the README)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .docs_blocks import REPO


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    try:
        import material  # noqa: F401
        import mkdocs  # noqa: F401
    except ImportError:
        pytest.fail("mkdocs and mkdocs-material are missing: install the docs extra (scripts/bootstrap does: "
                    "pip install -e '.[docs]')")
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for page in ("index.html", "getting-started/index.html", "guides/slurm/index.html", "reference/cli/index.html",
                 "reference/options/index.html", "own-checkpoints/index.html", "ARCHITECTURE/index.html"):
        assert (site / page).is_file(), page


def test_every_link_of_the_readme_resolves() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert links, "the README links to the docs"
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue
        path = link.split("#", 1)[0]
        assert (REPO / path).exists(), f"README.md links to {link}, which does not exist"


def test_the_readme_stays_short_and_starts_with_the_two_commands() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move the detail into docs/"
    first = next(i for i, line in enumerate(lines) if line.startswith("```"))
    assert first < 12 and lines[first + 1].startswith("scripts/demo") and lines[first + 2].startswith("scripts/test")
