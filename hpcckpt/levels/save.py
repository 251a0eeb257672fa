"""The engines' commit when levels are on: node-local on every node, a partner copy, and the
shared level drained from the node-local copy when it is due.

Sequence (every rank, collective over ``ranks``; the engine's background group for the
concurrent engine)::

    gather records          every rank wrote its file into its node's temporary directory
    partner copies          each rank sends its file to its partner, receives its wards' (fsynced)
    node-local commit       each node's leader commits its directory: the full manifest, the
                            files of its ranks and wards; older node-local steps pruned
    drain (when due)        each rank copies its own file from the node-local step to the shared
                            level's temporary directory, fsyncs it and reads it back: the checksum
                            must be the source's; the coordinator commits it with the same manifest

A failure before the node-local commit fails the save on every rank (each node's previous
node-local checkpoint stays). A failed drain of a periodic save is a warning (the node-local
level holds the step; the shared level keeps its previous one); of a final save, a failure.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from ..errors import CheckpointFailed
from ..ranks import Ranks
from ..store import catalog
from ..store.commit import Transaction, discard
from ..store.copy import copy_verified
from ..store.manifest import build as build_manifest
from ..store.publish import commit_and_prune, gather_records, record_failures
from . import Levels

log = logging.getLogger("hpcckpt.levels")


def commit(levels: Levels, ranks: Ranks, *, engine: str, job: dict[str, Any], user: dict[str, Any],
           step: int, tmp: Path, record: dict[str, Any] | None, error: BaseException | None,
           final: bool) -> tuple[Path, list[str]]:
    """Commit ``step`` at the node-local level (and the shared one when due): (path, warnings).

    ``path`` is the shared step directory when the step was drained there, else this node's."""
    topo = levels.topo
    size = None
    if error is None and record is not None:
        try:
            size = os.stat(tmp / record["file"]).st_size
        except OSError as exc:
            error = exc
    mine = {"ok": error is None, "record": record, "step": step, "bytes": size, "now": time.time(),
            "error": f"{type(error).__name__}: {error}" if error else None}
    everyone = gather_records(ranks, mine)
    failed = record_failures(everyone, step)
    if not failed and levels.with_partner:
        problem = _partner_copies(levels, ranks, tmp, everyone)
        for r, p in enumerate(ranks.gather_json(problem)):
            if p:
                failed[r] = p
    name = catalog.step_name(step)
    outcome: dict[str, Any] = {"ok": not failed}
    warnings: list[str] = []
    path = levels.local / name
    manifest: dict[str, Any] | None = None  # built once (the build strips planning fields off the records)
    if not failed and (topo.is_leader or ranks.is_coordinator):
        try:
            manifest = build_manifest(step=step, engine=engine, job=job, user=user,
                                      records=[m["record"] for m in everyone], created=everyone[0]["now"])
        except Exception as exc:  # noqa: BLE001 - e.g. ranks that planned other tensors; reported below
            outcome = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    if manifest is not None and topo.is_leader:
        try:
            path, warnings, removed = commit_and_prune(Transaction(levels.local, name, temp=tmp), manifest,
                                                       keep=levels.local_keep)
            for p in removed:
                log.info("hpcckpt: node-local retention removed %s", p)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            outcome = {"ok": False, "error": f"node-local commit on {topo.node_of[topo.rank]} failed: "
                                             f"{type(exc).__name__}: {exc}"}
    for r, o in enumerate(ranks.gather_json(outcome)):
        if not o["ok"] and "error" in o:
            failed[r] = o["error"]
    if failed:
        if topo.is_leader:
            discard(levels.local, [tmp])
        raise CheckpointFailed(f"checkpoint of step {step} at the node-local level ({levels.local}) failed; "
                               "the previous checkpoints are untouched", failed)
    if levels.shared_due(step, final):
        try:
            path, more = drain(levels, ranks, step, everyone[levels.topo.rank]["record"]["file"], manifest)
            warnings += more
        except CheckpointFailed as exc:
            if final:
                raise
            warnings.append(f"{exc} (step {step} is committed at the node-local level)")
    return path, warnings


def _partner_copies(levels: Levels, ranks: Ranks, tmp: Path, everyone: list[dict[str, Any]]) -> str | None:
    """Send this rank's file to its partner, receive its wards' into this node's directory."""
    topo, me = levels.topo, levels.topo.rank
    partner = topo.partner(me)
    assert partner is not None
    try:
        own = everyone[me]["record"]["file"]
        sends = [(partner, str(tmp / own), int(everyone[me]["bytes"]))]
        recvs = [(w, str(tmp / everyone[w]["record"]["file"]), int(everyone[w]["bytes"])) for w in topo.wards(me)]
        ranks.exchange_files(sends, recvs)
        return None
    except Exception as exc:  # noqa: BLE001 - every rank learns it in the exchange that follows
        return f"partner copy failed: {type(exc).__name__}: {exc}"


def drain(levels: Levels, ranks: Ranks, step: int, rel: str, manifest: dict[str, Any] | None
          ) -> tuple[Path, list[str]]:
    """Copy node-local ``step`` to the shared level, each rank its own file ``rel``, and commit
    it there with ``manifest`` (the coordinator's) once every copy reads back with its source's
    checksum. Collective."""
    name = catalog.step_name(step)
    token = ranks.token()
    shared_tmp = Transaction.temp_path(levels.shared, name, token)
    problem = None
    try:
        shared_tmp.mkdir(mode=0o700, parents=True, exist_ok=True)
        copy_verified(levels.local / name / rel, shared_tmp / rel)
    except Exception as exc:  # noqa: BLE001 - every rank learns it below
        problem = f"{type(exc).__name__}: {exc}"
    problems = {r: p for r, p in enumerate(ranks.gather_json(problem)) if p}
    outcome: dict[str, Any] = {"ok": not problems}
    if ranks.is_coordinator:
        if problems:
            discard(levels.shared, [shared_tmp])
        else:
            assert manifest is not None
            try:
                path, warnings, removed = commit_and_prune(Transaction(levels.shared, name, temp=shared_tmp),
                                                           manifest, keep=levels.keep)
                outcome = {"ok": True, "path": str(path), "warnings": warnings}
                for p in removed:
                    log.info("hpcckpt: retention removed %s", p)
            except Exception as exc:  # noqa: BLE001
                discard(levels.shared, [shared_tmp])
                outcome = {"ok": False, "problems": {0: f"commit failed: {type(exc).__name__}: {exc}"}}
        if problems:
            outcome["problems"] = problems
    outcome = ranks.broadcast_json(outcome)
    if not outcome["ok"]:
        raise CheckpointFailed(f"drain of step {step} to the shared level {levels.shared} failed; its previous "
                               "checkpoint is untouched", {int(r): p for r, p in outcome["problems"].items()})
    log.info("hpcckpt: drained step %d to %s", step, outcome["path"])
    return Path(outcome["path"]), list(outcome.get("warnings") or [])
