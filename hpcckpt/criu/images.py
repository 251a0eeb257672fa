"""Where CRIU images live: ``<run dir>/criu/image-<seq>/``, committed like checkpoints.

An image directory becomes visible only through ``hpcckpt.store.commit.Transaction``
(checksummed files, temp dir + rename + fsync, ``LATEST``). Only the newest image is
ever restored automatically: after an older image was taken the job went on writing
its files, and CRIU either refuses such an image or would rewind state the job has
already published. Older images are kept (``keep``) for inspection and manual use.
"""
from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointCorrupt, NoCheckpoint
from ..store.commit import MANIFEST, TMP_MARK, atomic_write, discard, read_latest, read_manifest, verify_files

CRIU_SUBDIR = "criu"
IMAGE_PREFIX = "image-"
KIND = "criu-image"
_NAME_RE = re.compile(rf"^{IMAGE_PREFIX}(\d+)$")
_CORE_RE = re.compile(r"^core-(\d+)\.img$")


@dataclass(frozen=True, kw_only=True)
class Image:
    path: Path
    seq: int

    @property
    def name(self) -> str:
        return self.path.name

    def manifest(self) -> dict[str, Any]:
        return read_manifest(self.path)

    def bytes_total(self) -> int:
        return sum(int(f["bytes"]) for f in self.manifest().get("files", {}).values())


def criu_root(run_dir: Path) -> Path:
    return Path(run_dir) / CRIU_SUBDIR


def image_name(seq: int) -> str:
    return f"{IMAGE_PREFIX}{seq:06d}"


def committed(root: Path) -> list[Image]:
    """Committed image directories (those with a manifest), oldest first."""
    if not root.is_dir():
        return []
    out = []
    for entry in root.iterdir():
        m = _NAME_RE.match(entry.name)
        if m and entry.is_dir() and (entry / MANIFEST).exists():
            out.append(Image(path=entry, seq=int(m.group(1))))
    return sorted(out, key=lambda im: im.seq)


def next_seq(root: Path) -> int:
    seqs = [im.seq for im in committed(root)]
    return (max(seqs) + 1) if seqs else 1


def seq_of(name: str) -> int | None:
    m = _NAME_RE.match(name)
    return int(m.group(1)) if m else None


# Names the newest image when a dump ended the job but could not be committed: that
# image and every older one are behind the job's real progress (it ran on past them),
# so restoring one would rewind; the next run falls back per --on-restore-failure.
STALE = "STALE"


def stale(root: Path, image: Image) -> bool:
    """Whether ``image`` is at or below the STALE mark (see STALE)."""
    try:
        mark = seq_of((Path(root) / STALE).read_text().strip())
    except FileNotFoundError:
        return False
    return mark is not None and image.seq <= mark


CONSUMED = "CONSUMED"  # names the newest image of a run that finished: not to be restored
OWN_SAVE = "OWN-SAVE"  # names the image the job's own save is ahead of (it exited 75 after it)


def mark(root: Path, marker: str) -> str | None:
    """Name the newest image in ``marker`` (``CONSUMED``, ``OWN_SAVE``, ``STALE``); its name,
    None when there is none."""
    try:
        latest = newest(root)
    except NoCheckpoint:
        return None
    atomic_write(Path(root) / marker, (latest.name + "\n").encode())
    return latest.name


def marked(root: Path, marker: str) -> str | None:
    """The image ``marker`` names, None when there is no such mark."""
    try:
        return (Path(root) / marker).read_text().strip() or None
    except FileNotFoundError:
        return None


def newest(root: Path) -> Image:
    """The committed image with the highest sequence; NoCheckpoint if none.

    Not ``LATEST``: a commit can rename image N into place and then fail to rewrite
    LATEST, which would still name N-1, an image the job had already run past.
    """
    images = committed(root)
    if not images:
        raise NoCheckpoint(f"no committed CRIU image under {root}")
    return images[-1]


def max_task_id(image_dir: Path) -> int:
    """The highest ID criu must recreate: every PID/TID (one ``core-<tid>.img`` per
    thread) and every session and process-group ID (pstree.img), since criu restores a
    session or group whose leader is gone with a helper task holding that very ID."""
    ids = [int(m.group(1)) for p in Path(image_dir).iterdir() if (m := _CORE_RE.match(p.name))]
    if not ids:
        raise CheckpointCorrupt(f"{image_dir} holds no core-*.img: not a criu image")
    return max(ids + pstree_ids(Path(image_dir) / "pstree.img"))


_PSTREE_MAGIC = (0x54564319, 0x50273030)  # criu's "common" image magic, then pstree's


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _entry_ids(msg: bytes) -> list[int]:
    """pid (1), ppid (2), pgid (3), sid (4), threads (5, plain or packed) of one PstreeEntry."""
    ids, pos = [], 0
    while pos < len(msg):
        key, pos = _varint(msg, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(msg, pos)
            if field in (1, 2, 3, 4, 5):
                ids.append(value)
        elif wire == 2:
            size, pos = _varint(msg, pos)
            body, pos = msg[pos:pos + size], pos + size
            sub = 0
            while field == 5 and sub < len(body):
                value, sub = _varint(body, sub)
                ids.append(value)
        else:
            raise ValueError(f"unexpected wire type {wire}")
    return ids


def pstree_ids(path: Path) -> list[int]:
    """Every ID named in criu's pstree.img ([] when absent); CheckpointCorrupt when unreadable."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    try:
        if len(raw) < 8 or struct.unpack_from("<II", raw) != _PSTREE_MAGIC:
            raise ValueError("not a pstree image (magic)")
        ids, pos = [], 8
        while pos < len(raw):
            (size,) = struct.unpack_from("<I", raw, pos)
            if pos + 4 + size > len(raw):
                raise ValueError("truncated entry")
            ids += _entry_ids(raw[pos + 4:pos + 4 + size])
            pos += 4 + size
    except (ValueError, struct.error) as exc:
        raise CheckpointCorrupt(f"{path} cannot be read ({exc}): not a criu process tree image") from None
    return ids


def verify(image: Image) -> dict[str, Any]:
    """Check the manifest and every file's size and crc32c; return the manifest.

    Raises CheckpointCorrupt listing every problem, so a flipped byte is caught
    before criu ever reads the image.
    """
    problems = verify_files(image.path, full=True)
    if problems:
        raise CheckpointCorrupt(f"CRIU image {image.path} fails verification: " + "; ".join(problems)
                                + ". It will not be restored; remove it to silence this message")
    manifest = image.manifest()
    if manifest.get("kind") != KIND:
        raise CheckpointCorrupt(f"{image.path} is not a CRIU image (kind={manifest.get('kind')!r})")
    return manifest


PARENT = "parent"  # criu's link from an image to the one holding its unchanged pages


def parent(image: Image) -> Image | None:
    """The image ``image`` takes unchanged pages from (criu's ``parent`` link), if any.

    CheckpointCorrupt when the link names anything but a sibling image directory."""
    link = image.path / PARENT
    if not link.is_symlink():
        return None
    name = Path(os.readlink(link)).name
    seq = seq_of(name)
    target = image.path.parent / name
    if seq is None or seq >= image.seq or not target.is_dir():
        raise CheckpointCorrupt(f"{image.path} takes pages from {os.readlink(link)!r}, which is not an older "
                                f"image beside it (missing or moved); it cannot be restored")
    return Image(path=target, seq=seq)


def chain(image: Image) -> list[Image]:
    """``image`` and every image it takes pages from, newest first."""
    out = [image]
    while (up := parent(out[-1])) is not None:
        out.append(up)
    return out


def prune(root: Path, *, keep: int) -> list[Path]:
    """Keep the newest ``keep`` images and every image they take pages from (never the one
    LATEST names); drop stale temp dirs.

    Call under ``writer_lock(root)``: then no temp directory can belong to a live writer.
    """
    removed: list[Path] = []
    images = committed(root)
    latest = read_latest(root)
    needed = set()
    for im in images[-max(keep, 1):]:
        try:
            needed |= {up.name for up in chain(im)}
        except CheckpointCorrupt:
            needed.add(im.name)
    for im in images[: max(0, len(images) - max(keep, 1))]:
        if im.name != latest and im.name not in needed:
            removed.append(im.path)
    for entry in root.iterdir() if root.is_dir() else []:
        if entry.name.startswith(IMAGE_PREFIX) and TMP_MARK in entry.name and entry.is_dir():
            removed.append(entry)
    # The store's retention: renamed aside first, so no image is ever seen half-deleted.
    discard(root, removed)
    return removed
