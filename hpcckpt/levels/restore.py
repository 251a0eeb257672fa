"""Restart from the fastest level: the newest step that is complete on the node-local level
of some set of nodes, unless the shared level holds a newer one.

Every rank calls ``prepare`` (collective) before the restore:

1. each node's leader lists its node-local steps: which of each manifest's files it holds
   whole (by size; the checksums are checked by the read that follows);
2. the coordinator picks the newest step whose every file some node holds, when it is at
   least as new as the shared level's newest committed step, and plans a transfer of each
   file a node lacks (the manifest included) from a node that has it: a node whose
   directory was lost gets its ranks' state from the partner copies;
3. the transfers run rank to rank (``Ranks.exchange_files``), into a temporary directory
   renamed into place for a node that had no copy of the step at all.

Then every rank restores that step from its own node's directory, through the one restore
path (``resume.load_newest(only_step=...)``). If that read fails, ``prepare(verify=step)``
checks every byte of each node's copy of the step and replaces what is damaged from the
copies that check (the partner copies); only if that fails too, the shared level.

A node-local step is listed only when it is a real directory of this user carrying the shared
directory's run lineage (``Levels.lineage``): a step another user or another lineage left
there is never restored.
"""
from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from ..ranks import Ranks
from ..store import catalog
from ..store import manifest as manifests
from ..store.commit import MANIFEST, TMP_MARK, discard, fsync_path, read_manifest, verify_files
from ..store.names import partial
from . import Levels, step_lineage

log = logging.getLogger("hpcckpt.levels")

NODE_LOCAL, PARTNER, SHARED = "node-local", "partner", "shared"


def node_view(local: Path, lineage: str | None = None, *, verify: int | None = None) -> dict[str, dict[str, Any]]:
    """{step: {"files": {rel: bytes}, "have": [rel, ...]}} of the committed node-local steps:
    the manifest's file table (manifest.json itself included) and the files held whole.

    ``lineage``: only steps that carry it (others are logged and left out). ``verify``: that
    step only, each file held only if every byte checks (whole-file and per-tensor crc32c);
    otherwise by size (the read that follows checks the checksums)."""
    view: dict[str, dict[str, Any]] = {}
    me = os.geteuid()
    for entry in catalog.entries(local):
        if entry.tmp or (verify is not None and entry.step != verify):
            continue
        path = local / entry.name
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != me:
                log.warning("hpcckpt: not restoring node-local step %d: %s is not a directory of yours", entry.step,
                            path)
                continue
            doc = read_manifest(path)
            manifests.validate(doc, step=entry.step)
            if lineage is not None and step_lineage(doc) != lineage:
                log.warning("hpcckpt: not restoring node-local step %d in %s: it belongs to another run lineage "
                            "(%s; the checkpoint directory's is %s)", entry.step, local, step_lineage(doc) or "none",
                            lineage)
                continue
            table = {rel: int(info["bytes"]) for rel, info in doc["files"].items()}
            table[MANIFEST] = os.lstat(path / MANIFEST).st_size
        except Exception:  # noqa: BLE001 - a damaged node-local step is simply not held
            continue
        have = []
        for rel, size in table.items():
            try:
                st = os.lstat(path / rel)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_size == size and (verify is None or _intact(path, doc, rel)):
                have.append(rel)
        view[str(entry.step)] = {"files": table, "have": have}
    return view


def _intact(path: Path, doc: dict[str, Any], rel: str) -> bool:
    """Whether the file ``rel`` of the step directory ``path`` reads back as its manifest says
    (its whole-file crc32c, and each tensor's for the ranks it holds)."""
    if rel == MANIFEST:
        return True  # read and checked (its own seal) by node_view
    try:
        info = doc["files"][rel]
        if verify_files(path, full=True, manifest={"files": {rel: info}}):
            return False
        return not any(catalog.verify_rank(path, doc, int(r)) for r, rec in doc["ranks"].items()
                       if isinstance(rec, dict) and rec.get("file") == rel)
    except Exception:  # noqa: BLE001 - unreadable is not intact
        return False


def _plan(views: list[dict[str, Any] | None], leaders: list[int], shared_step: int | None) -> dict[str, Any] | None:
    """The coordinator's choice: {"step", "transfers": [[src, dst, rel, bytes], ...]} or None."""
    held: dict[int, dict[int, dict[str, Any]]] = {}  # step -> leader rank -> its view of the step
    for rank, view in enumerate(views):
        for key, v in (view or {}).items():
            held.setdefault(int(key), {})[rank] = v
    for step in sorted(held, reverse=True):
        if shared_step is not None and step < shared_step:
            return None
        tables = {tuple(sorted(v["files"].items())) for v in held[step].values()}
        if len(tables) != 1:
            continue  # nodes disagree on what the step holds: not one checkpoint
        table = dict(next(iter(tables)))
        holders = {rel: [r for r, v in held[step].items() if rel in v["have"]] for rel in table}
        if not all(holders.values()):
            continue
        transfers = [[holders[rel][0], dst, rel, size] for dst in leaders for rel, size in sorted(table.items())
                     if rel not in (held[step].get(dst) or {"have": []})["have"]]
        return {"step": step, "transfers": transfers}
    return None


def prepare(levels: Levels, ranks: Ranks, *, verify: int | None = None) -> tuple[int, str] | None:
    """(step, level) to restore from this node's node-local directory, or None for the shared
    level. Collective.

    ``verify``: the step whose read failed: every node checks every byte of its copy of it
    (``node_view(verify=...)``) and what is damaged is replaced from a copy that checks (a
    partner copy); (that step, PARTNER) when every file of it is then whole somewhere, else None."""
    topo = levels.topo
    view = node_view(levels.local, levels.lineage, verify=verify) if topo.is_leader else None
    views = ranks.gather_json(view)
    plan = None
    if ranks.is_coordinator:
        newest, _ = catalog.newest_committed(levels.shared)
        shared = next((i.step for i in newest if i.status == "committed"), None)
        # A shared step written by a newer hpcckpt: the shared load refuses it (resume) rather
        # than rewinding to an older node-local step.
        newer = catalog.written_by_newer(newest) is not None
        plan = None if newer else _plan(views, topo.leaders, shared)
        if plan is not None and verify is not None and (plan["step"] != verify or not plan["transfers"]):
            plan = None  # nothing to mend from another copy: the same read would fail again
    plan = ranks.broadcast_json(plan)
    if plan is None:
        return None
    step = int(plan["step"])
    name = catalog.step_name(step)
    mine = [t for t in plan["transfers"] if topo.rank in (t[0], t[1])]
    problem = None
    target = levels.local / name
    held = view is not None and str(step) in view  # this node lists the step (its manifest reads and checks)
    try:
        incoming = [t for t in mine if t[1] == topo.rank]
        if incoming and not held:
            target = levels.local / f"{name}{TMP_MARK}restore-{secrets.token_hex(4)}"
            target.mkdir(mode=0o700)
        sends = [(int(t[1]), str(levels.local / name / t[2]), int(t[3])) for t in mine if t[0] == topo.rank]
        recvs = [(int(t[0]), str(target / partial(t[2])), int(t[3])) for t in incoming]
        ranks.exchange_files(sends, recvs)
        for t in incoming:
            os.replace(target / partial(t[2]), target / t[2])
        if incoming:
            fsync_path(target)
            if target.name != name:
                if os.path.lexists(levels.local / name):  # a copy whose manifest is damaged: aside first
                    discard(levels.local, [levels.local / name])
                os.rename(target, levels.local / name)
            fsync_path(levels.local)
    except Exception as exc:  # noqa: BLE001 - every rank learns it below
        problem = f"{type(exc).__name__}: {exc}"
        if target.name != name:
            discard(levels.local, [target])
    problems = [p for p in ranks.gather_json(problem) if p]
    if problems:
        log.warning("hpcckpt: completing node-local step %d from the other nodes failed (%s); restoring from "
                    "the shared level", step, problems[0])
        return None
    if verify is not None:
        log.warning("hpcckpt: node-local step %d failed its read; its damaged files were replaced from the "
                    "copies of the other nodes (%d file(s) sent)", step, len(plan["transfers"]))
    level = PARTNER if plan["transfers"] else NODE_LOCAL
    return step, level
