"""Commit a written checkpoint, then prune the old ones: one routine for every mode that saves steps.

Used by the engines (``engines/base.py``) and the JIT writer (``jit/writer.py``). Both
write and fsync their rank files before the commit, so the commit re-reads sizes only
(the crcs come from the writers) and fsyncs nothing but the manifest and directories.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import catalog
from .commit import Transaction, fsync_path, trashed_name
from .lock import CommitLock, writer_lock
from .manifest import record_in, record_out

if TYPE_CHECKING:
    from ..ranks import Ranks


def gather_records(ranks: Ranks, mine: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``mine`` (``{"ok", "record", "step", ...}``), on every rank: the commit
    exchange. The rank record crosses as JSON carries it (``manifest.record_out``: its tensor
    table as columns) and comes back as the code reads it (``record_in``). A single rank's
    record is its own, already as the code reads it: a shallow copy of it is returned."""
    out = dict(mine)
    if ranks.world == 1:  # nothing crosses: the record stays as the code reads it (no table round trip),
        if out.get("record"):  # a copy all the same (the manifest's build pops planning fields off it)
            out["record"] = dict(out["record"])
        return [out]
    if out.get("record"):
        out["record"] = record_out(out["record"])
    everyone = ranks.gather_json(out)
    for m in everyone:
        if m.get("record"):
            record_in(m["record"])
    return everyone


def record_failures(everyone: list[dict[str, Any]], step: int) -> dict[int, str]:
    """Which ranks cannot take part in the commit of ``step``, and why, from every rank's
    exchanged ``{"ok", "error", "step", ...}``: a rank that failed to write its part, or one
    committing another step (ranks out of step in their saves: a bug to report loudly)."""
    failed = {r: str(m["error"]) for r, m in enumerate(everyone) if not m["ok"]}
    failed.update({r: f"rank {r} was committing step {m['step']}, not step {step}"
                   for r, m in enumerate(everyone) if m["step"] != step})
    return failed


def commit_and_prune(txn: Transaction, manifest: dict[str, Any], *, keep: int | None,
                     lock_timeout_s: float = -1, precheck: Callable[[], None] | None = None,
                     trash: list[Path] | None = None, lock: CommitLock | None = None,
                     unsynced: list[Path] | None = None) -> tuple[Path, list[str], list[Path]]:
    """Under the writer lock: commit ``txn`` with ``manifest``, then keep the newest ``keep``.

    Returns ``(path, warnings, removed)``. Faults after the rename (root fsync, LATEST,
    pruning) are ``warnings``, never an exception: the step is committed, and a failed
    save would be a lie. ``lock_timeout_s``: how long to wait for the lock (-1: for ever).
    ``keep=None``: no retention (nothing is removed). ``precheck``: runs under the lock
    before the commit; what it raises leaves the lock and commits nothing (the scavenge
    checks there that no other node committed the step first). ``trash``: pruned trees are
    renamed aside here and appended there for the caller to delete later (``catalog.prune``).
    ``lock``: the caller's ``CommitLock`` on ``txn.root`` (a writer that commits often),
    instead of a ``writer_lock`` made for this commit.

    With ``trash`` and ``keep`` >= 2 the commit fsyncs the root once (``_prune_first``);
    otherwise (and for a step committed again, which replaces its earlier copy) the rename
    is made durable before retention renames anything aside.

    ``unsynced`` (with ``trash``): retention after the rename (``keep`` < 2) renames aside
    without an fsync of its own; the trees wait in ``unsynced`` for the next fsync of the
    root (the next commit's, or the engine's ``settle_trash`` at close), which moves them to ``trash``.
    Until then nothing deletes or reuses them, so a crash leaves the pruned checkpoint
    whole under its name or as an invisible leftover, never its name over other bytes. One
    fsync of the root per commit instead of two: with ``keep=1`` and a save at every step,
    each fsync was a few milliseconds of this machine's two cores.
    """
    warnings: list[str] = []
    with (lock(lock_timeout_s) if lock is not None else writer_lock(txn.root, timeout_s=lock_timeout_s)):
        if precheck is not None:
            precheck()
        if trash is not None and keep is not None and keep >= 2 and not os.path.lexists(txn.final):
            # (a step committed again replaces its copy: below)
            return _prune_first(txn, manifest, keep, trash, unsynced)
        path = txn.commit(manifest, checksum=False, fsync_files=False)
        warnings += txn.warnings
        if trash is not None:
            _covered(txn, unsynced, trash)
        if keep is None:
            return path, warnings, []
        try:
            # LATEST names the step just committed, unless setting it failed (a warning)
            latest = None if txn.warnings else txn.name
            if unsynced is not None and trash is not None:
                removed = catalog.prune(txn.root, keep, protect={path}, trash=unsynced, durable=False,
                                        tracked=trash, latest=latest)
            else:
                removed = catalog.prune(txn.root, keep, protect={path}, trash=trash, latest=latest)
        except OSError as exc:
            warnings.append(f"{txn.name} is committed, but retention could not prune older checkpoints: {exc}")
            removed = []
    return path, warnings, removed


def _prune_first(txn: Transaction, manifest: dict[str, Any], keep: int, trash: list[Path],
                 unsynced: list[Path] | None = None) -> tuple[Path, list[str], list[Path]]:
    """Retention before the rename, one fsync of the root for all of it.

    Every checkpoint already in the root is durably committed (each commit ended with an
    fsync of the root), so keeping the newest ``keep - 1`` of them (at least one) and
    then committing this one leaves ``keep``, and a crash at any instant before the fsync
    leaves the newest of them whatever the file system made durable: the renames aside
    and the commit's rename then share one fsync of the root instead of one each (at a
    save every step, each fsync waited behind the next save's data writes). The pruned
    trees are deleted by the caller, after this returns, so never before that fsync. A
    commit that fails before its rename puts them back: a failed save costs no checkpoint.
    """
    warnings: list[str] = []
    before = len(trash)
    try:
        removed = catalog.prune(txn.root, keep - 1, protect={txn.path}, trash=trash, durable=False,
                                tracked=unsynced)
    except OSError as exc:
        warnings.append(f"retention could not prune older checkpoints before committing {txn.name}: {exc}")
        removed = []
    try:
        path = txn.commit(manifest, checksum=False, fsync_files=False, fsync_root=False)
    except BaseException:
        _put_back(txn.root, removed, trash, before)
        raise
    txn.make_durable()
    _covered(txn, unsynced, trash)
    catalog.learn_committed(path)  # the next prune lists it without reading it
    return path, warnings + txn.warnings, removed


def _covered(txn: Transaction, unsynced: list[Path] | None, trash: list[Path]) -> None:
    """The commit's fsync of the root made the renames aside in ``unsynced`` durable: they
    move to ``trash`` (to be deleted or reused). Not when it reported a fault after the
    rename (the fsync may have failed): they wait for the next one."""
    if unsynced and not txn.warnings:
        trash += unsynced
        unsynced.clear()


def _put_back(root: Path, removed: list[Path], trash: list[Path], before: int) -> None:
    """Rename the trees ``_prune_first`` just moved aside back to their names (the commit
    failed); best effort, durable before the failure is reported."""
    names = {p.name for p in removed}
    back = []
    for tree in trash[before:]:
        name = trashed_name(tree.name)
        if name in names:
            try:
                os.rename(tree, root / name)
            except OSError:
                continue
            back.append(tree)
    if back:
        trash[before:] = [t for t in trash[before:] if t not in back]
        try:
            fsync_path(root)
        except OSError:
            pass
