"""Reading the checkpoint root: list, verify, pick the newest good one, prune."""
from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ..errors import CheckpointCorrupt, NoCheckpoint
from .commit import LATEST, TMP_MARK, read_latest, read_manifest, verify_files
from . import torchfile
from .hdf5 import TensorEntry, verify_tensors

STEP_RE = re.compile(r"^step-(\d+)$")
STEP_TMP_RE = re.compile(r"^step-(\d+)\.tmp-")
STALE_TMP_AGE_S = 600.0


def step_name(step: int) -> str:
    return f"step-{step}"


@dataclass
class CheckpointInfo:
    step: int
    status: str  # committed | incomplete | corrupt
    path: Path
    bytes: int
    problems: list[str] = field(default_factory=list)
    manifest: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"step": self.step, "status": self.status, "path": str(self.path), "bytes": self.bytes}
        if self.problems:
            d["problems"] = self.problems
        if self.manifest:
            d["engine"] = self.manifest.get("engine")
            d["world_size"] = self.manifest.get("world_size")
            d["created"] = self.manifest.get("created")
        return d


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def rank_entries(manifest: dict[str, Any], rank: int) -> tuple[str, dict[str, TensorEntry]]:
    rec = manifest["ranks"][str(rank)]
    return rec["file"], {n: TensorEntry.from_json(n, e) for n, e in rec.get("tensors", {}).items()}


def check(path: Path, *, full: bool) -> tuple[dict[str, Any] | None, list[str]]:
    """(manifest, problems) for one step directory.

    Cheap mode checks the manifest's own checksum and file sizes; full mode also
    re-reads every byte (whole-file and per-tensor crc32c).
    """
    try:
        manifest = read_manifest(path)
    except CheckpointCorrupt as exc:
        return None, [str(exc)]
    problems = verify_files(path, full=full)
    if full:
        for rank in range(int(manifest.get("world_size", 1))):
            rec = manifest.get("ranks", {}).get(str(rank))
            if rec is None:
                problems.append(f"{path}: manifest has no record for rank {rank}")
                continue
            if not (path / rec["file"]).exists():
                continue  # already reported as missing
            if rec.get("format") == "hdf5":
                fname, entries = rank_entries(manifest, rank)
                problems += verify_tensors(path / fname, entries)
            elif rec.get("format") == "torch":
                problems += torchfile.verify(path / rec["file"], rec)
    return manifest, problems


def scan(root: Path, *, full: bool = False) -> list[CheckpointInfo]:
    """Every step directory under ``root`` (committed, incomplete or corrupt), oldest first."""
    out: list[CheckpointInfo] = []
    if not root.is_dir():
        return out
    for p in root.iterdir():
        if not p.is_dir():
            continue
        if m := STEP_RE.match(p.name):
            manifest, problems = check(p, full=full)
            if manifest is None and not (p / "manifest.json").exists():
                status = "incomplete"
            else:
                status = "corrupt" if problems else "committed"
            out.append(CheckpointInfo(int(m.group(1)), status, p, _dir_bytes(p), problems, manifest))
        elif m := STEP_TMP_RE.match(p.name):
            out.append(CheckpointInfo(int(m.group(1)), "incomplete", p, _dir_bytes(p),
                                      [f"{p}: temporary directory of a save that never committed"]))
    out.sort(key=lambda c: (c.step, c.status != "committed"))
    return out


def committed_newest_first(root: Path) -> Iterator[CheckpointInfo]:
    """Committed (cheaply verified) checkpoints, newest step first."""
    for info in reversed(scan(root)):
        if info.status == "committed":
            yield info


def find(root: Path, step: int | None) -> CheckpointInfo:
    infos = [i for i in scan(root) if i.status != "incomplete" or step is not None]
    if step is None:
        committed = [i for i in infos if i.status == "committed"]
        if not committed:
            raise NoCheckpoint(f"no committed checkpoint under {root}" + (
                f" ({len(infos)} corrupt)" if infos else ""))
        return committed[-1]
    for i in infos:
        if i.step == step and STEP_RE.match(i.path.name):
            return i
    have = ", ".join(str(i.step) for i in infos) or "none"
    raise NoCheckpoint(f"no checkpoint for step {step} under {root} (steps present: {have})")


def prune(root: Path, keep: int, *, protect: set[Path] | None = None) -> list[Path]:
    """Delete old checkpoints beyond the newest ``keep`` committed ones; call under the writer lock.

    The newest checkpoint that verifies (manifest checksum and file sizes; the
    bytes were checksummed as they were written) is never deleted, nor are corrupt
    ones newer than it (evidence for a human); stale temporary directories go too.
    """
    removed: list[Path] = []
    infos = scan(root)
    committed = [i for i in infos if i.status == "committed"]
    newest_good = committed[-1] if committed else None
    keepers = {i.path for i in committed[-keep:]} | (protect or set())
    latest = read_latest(root)
    for info in infos:
        if info.path in keepers or info.path.name == latest:
            continue
        if info.status == "corrupt" and (newest_good is None or info.step > newest_good.step):
            continue
        if info.status == "incomplete" and TMP_MARK in info.path.name:
            if time.time() - info.path.stat().st_mtime < STALE_TMP_AGE_S:
                continue  # may belong to a save still in flight (here or in a racing instance)
        shutil.rmtree(info.path, ignore_errors=True)
        removed.append(info.path)
    return removed


__all__ = ["CheckpointInfo", "scan", "check", "find", "prune", "committed_newest_first",
           "rank_entries", "step_name", "LATEST"]
