"""The package's one durable write (``fsio.atomic_write``, ``fsio.replacing``): whole or not at
all, and nothing left beside the file when it fails."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from hpcckpt.fsio import TMP_MARK, atomic_write, replacing
from hpcckpt.lifecycle.budget import BUDGET_FILE, charge


def _left(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if TMP_MARK in p.name)


def test_atomic_write_replaces_whole_and_leaves_nothing_when_it_fails(tmp_path: Path) -> None:
    target = tmp_path / "doc.json"
    atomic_write(target, b"old")
    atomic_write(target, '{"text": "\u00e9"}')  # text is written as UTF-8
    assert target.read_bytes() == '{"text": "\u00e9"}'.encode()
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "inside").write_text("x")
    with pytest.raises(OSError):  # a non-empty directory cannot be replaced by a file
        atomic_write(tmp_path / "taken", b"new")
    assert _left(tmp_path) == []


def test_replacing_publishes_only_a_finished_file(tmp_path: Path) -> None:
    target = tmp_path / "model.pt"
    target.write_bytes(b"before")
    with pytest.raises(RuntimeError), replacing(target, mode=0o666) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("the writer failed")
    assert target.read_bytes() == b"before" and _left(tmp_path) == []
    umask = os.umask(0)
    os.umask(umask)
    with replacing(target, mode=0o666) as tmp:
        tmp.write_bytes(b"after")
    assert target.read_bytes() == b"after" and _left(tmp_path) == []
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask


def test_the_requeue_budget_is_written_through_the_one_helper(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import hpcckpt.lifecycle.budget as budget
    written: list[Path] = []
    real = budget.atomic_write
    monkeypatch.setattr(budget, "atomic_write", lambda path, data, **kw: (written.append(path), real(path, data, **kw)))
    assert charge(tmp_path, "signal", attempt="7:0").allowed
    assert written == [tmp_path / BUDGET_FILE]
    assert json.loads((tmp_path / BUDGET_FILE).read_text())["counts"] == {"signal": 1}
    assert stat.S_IMODE((tmp_path / BUDGET_FILE).stat().st_mode) == 0o600 and _left(tmp_path) == []
