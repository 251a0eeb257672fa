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

Every node-local step carries the shared directory's run lineage (``job.lineage`` of its
manifest, ``Levels.lineage``): the restore trusts no other.

Degrade, never fail together: a failure of the node-local part on any node (a rank's write
into its node's directory, a partner copy, a node-local commit: ENOSPC, EROFS, EACCES...)
makes the levels *degraded* on every rank (``Levels.degrade``), with one warning. That
checkpoint goes to the shared level from the files the ranks wrote, when every rank wrote its
own; every later one is written straight to the shared level (``Levels.write_root``, the
engines' ``write_root``) and committed there (``_direct``): a full or read-only node-local disk
on one node costs the node-local level, never the shared level's periodic and final checkpoints.
A failed save of a rank's own file fails that save on every rank (the Checkpointer tries a
failed final save once more: straight to the shared level by then). A failed drain of a
periodic save is a warning (the node-local level holds the step; the shared level keeps its
previous one); of a final save, a failure.
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

    ``path`` is the shared step directory when the step was drained there (or written there:
    degraded), else this node's. ``tmp``: where this rank wrote, under ``levels.local``, or
    under ``levels.shared`` when the levels were degraded as its save began."""
    everyone = _exchange(levels, ranks, step, tmp, record, error)
    failed = record_failures(everyone, step)
    manifest, built = _manifest(levels, ranks, failed, step=step, engine=engine, job=job, user=user,
                                everyone=everyone)
    if levels.degraded is not None or any(m.get("direct") for m in everyone):
        return _direct(levels, ranks, step, tmp, everyone, failed, manifest, built)
    written = not failed  # every rank's own file is whole in its node's directory
    if not failed and levels.with_partner:
        problem = _partner_copies(levels, ranks, tmp, everyone)
        for r, p in enumerate(ranks.gather_json(problem)):
            if p:
                failed[r] = p
    path, warnings, outcomes = _commit_local(levels, ranks, step, tmp, manifest, failed, built)
    for r, o in enumerate(outcomes):
        if not o["ok"] and "error" in o:
            failed[r] = o["error"]
    if failed:
        return _fall_back(levels, ranks, step, tmp, everyone, failed, outcomes, manifest,
                          written and not any(o.get("unbuilt") for o in outcomes))
    if levels.shared_due(step, final):
        try:
            path, more = drain(levels, ranks, step, everyone[levels.topo.rank]["record"]["file"], manifest)
            warnings += more
        except CheckpointFailed as exc:
            if final:
                raise
            warnings.append(f"{exc} (step {step} is committed at the node-local level)")
    return path, warnings


def _exchange(levels: Levels, ranks: Ranks, step: int, tmp: Path, record: dict[str, Any] | None,
              error: BaseException | None) -> list[dict[str, Any]]:
    """Every rank's outcome of its write (its record, its file's size, whether it wrote to the
    shared level directly), gathered on every rank."""
    size = None
    if error is None and record is not None:
        try:
            size = os.stat(tmp / record["file"]).st_size
        except OSError as exc:
            error = exc
    mine = {"ok": error is None, "record": record, "step": step, "bytes": size, "now": time.time(),
            "error": f"{type(error).__name__}: {error}" if error else None, "direct": tmp.parent == levels.shared}
    return gather_records(ranks, mine)


def _manifest(levels: Levels, ranks: Ranks, failed: dict[int, str], *, step: int, engine: str,
              job: dict[str, Any], user: dict[str, Any], everyone: list[dict[str, Any]]
              ) -> tuple[dict[str, Any] | None, str | None]:
    """(the step's manifest, None) on the ranks that commit (node leaders, the coordinator), built
    once (the build strips planning fields off the records); (None, why) when it cannot be built."""
    if failed or not (levels.topo.is_leader or ranks.is_coordinator):
        return None, None
    try:
        return build_manifest(step=step, engine=engine, job={**job, "lineage": levels.lineage}, user=user,
                              records=[m["record"] for m in everyone], created=everyone[0]["now"]), None
    except Exception as exc:  # noqa: BLE001 - e.g. ranks that planned other tensors; reported by the caller
        return None, f"{type(exc).__name__}: {exc}"


def _commit_local(levels: Levels, ranks: Ranks, step: int, tmp: Path, manifest: dict[str, Any] | None,
                  failed: dict[int, str], built: str | None) -> tuple[Path, list[str], list[dict[str, Any]]]:
    """Each node leader commits the step in its node-local root: (this node's step directory, the
    commit's warnings, every rank's outcome)."""
    topo = levels.topo
    name = catalog.step_name(step)
    outcome: dict[str, Any] = {"ok": not failed and built is None}
    if built is not None:
        outcome.update(error=built, unbuilt=True)
    warnings: list[str] = []
    path = levels.local / name
    if not failed and manifest is not None and topo.is_leader:
        try:
            path, warnings, removed = commit_and_prune(Transaction(levels.local, name, temp=tmp), manifest,
                                                       keep=levels.local_keep)
            outcome["committed"] = True
            for p in removed:
                log.info("hpcckpt: node-local retention removed %s", p)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            outcome = {"ok": False, "error": f"node-local commit on {topo.node_of[topo.rank]} failed: "
                                             f"{type(exc).__name__}: {exc}"}
    return path, warnings, ranks.gather_json(outcome)


def _fall_back(levels: Levels, ranks: Ranks, step: int, tmp: Path, everyone: list[dict[str, Any]],
               failed: dict[int, str], outcomes: list[dict[str, Any]], manifest: dict[str, Any] | None,
               written: bool) -> tuple[Path, list[str]]:
    """The node-local part of ``step`` failed somewhere (``failed``): give up the node-local
    level (one warning), and put the step on the shared level from the files the ranks wrote
    when every rank wrote its own (from its node's committed step, else its temporary
    directory); otherwise the save fails. Collective."""
    topo = levels.topo
    r, why = min(failed.items())
    if levels.degrade(f"rank {r} on {topo.node_of[r]}: {why}"):
        log.warning("hpcckpt: the node-local level failed at step %d (rank %d on %s: %s); every checkpoint "
                    "of this run now goes straight to the shared level %s", step, r, topo.node_of[r], why,
                    levels.shared)
    name = catalog.step_name(step)
    try:
        if not written:
            raise CheckpointFailed(f"checkpoint of step {step} at the node-local level ({levels.local}) failed; "
                                   "the previous checkpoints are untouched", failed)
        rel = everyone[topo.rank]["record"]["file"]
        committed = bool(outcomes[topo.leader(topo.rank)].get("committed"))
        src = (levels.local / name if committed else tmp) / rel
        path, warnings = _to_shared(levels, ranks, step, rel, manifest, src=src, shared_tmp=levels.shared / tmp.name)
        log.warning("hpcckpt: step %d written to the shared level directly (%s)", step, path)
        return path, warnings
    finally:
        if topo.is_leader:
            try:
                discard(levels.local, [tmp])
            except OSError:
                pass  # read-only or gone: an invisible leftover, never listed


def _direct(levels: Levels, ranks: Ranks, step: int, tmp: Path, everyone: list[dict[str, Any]],
            failed: dict[int, str], manifest: dict[str, Any] | None, built: str | None) -> tuple[Path, list[str]]:
    """Degraded: commit ``step`` at the shared level, where the ranks wrote it (``tmp`` under
    ``levels.shared``); a rank that began this save before the levels were degraded (the
    concurrent engine's next save, on another thread) copies its file there from its node.
    Collective."""
    shared_tmp = levels.shared / tmp.name  # the same token, so the same name, on every rank
    if failed or built is not None:
        if ranks.is_coordinator:
            discard(levels.shared, [shared_tmp])
        if tmp != shared_tmp and levels.topo.is_leader:
            try:
                discard(levels.local, [tmp])
            except OSError:
                pass
        raise CheckpointFailed(f"checkpoint of step {step} at the shared level {levels.shared} (the node-local level "
                               "was given up) failed; its previous checkpoint is untouched",
                               failed or {0: str(built)})
    rel = everyone[levels.topo.rank]["record"]["file"]
    try:
        return _to_shared(levels, ranks, step, rel, manifest, src=None if tmp == shared_tmp else tmp / rel,
                          shared_tmp=shared_tmp)
    finally:
        if tmp != shared_tmp and levels.topo.is_leader:
            try:
                discard(levels.local, [tmp])
            except OSError:
                pass


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
    return _to_shared(levels, ranks, step, rel, manifest, src=levels.local / name / rel,
                      shared_tmp=Transaction.temp_path(levels.shared, name, ranks.token()))


def _to_shared(levels: Levels, ranks: Ranks, step: int, rel: str, manifest: dict[str, Any] | None, *,
               src: Path | None, shared_tmp: Path) -> tuple[Path, list[str]]:
    """Each rank copies ``src`` (its file ``rel``; None: already written into ``shared_tmp``)
    into ``shared_tmp`` under the shared level; the coordinator commits it there with
    ``manifest`` once every copy reads back with its source's checksum. Collective."""
    name = catalog.step_name(step)
    problem = None
    try:
        if src is not None:
            shared_tmp.mkdir(mode=0o700, parents=True, exist_ok=True)
            copy_verified(src, shared_tmp / rel)
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
        raise CheckpointFailed(f"checkpoint of step {step} to the shared level {levels.shared} failed; its previous "
                               "checkpoint is untouched", {int(r): p for r, p in outcome["problems"].items()})
    log.info("hpcckpt: committed step %d to %s", step, outcome["path"])
    return Path(outcome["path"]), list(outcome.get("warnings") or [])
