"""How the survivors agree without the dead rank: plain files on the shared file system.

The job's TCP store may have died with rank 0 and the process groups are broken, so
the survivors meet in ``<root>/.jit-<session>/`` (the checkpoint directory is on a
file system every rank sees):

1. each survivor writes ``local-<r>.pt`` (its rank-local state at its last boundary)
   and then ``alive-<r>.json`` (its step, optimizer step counts and fingerprint);
2. once every rank not known to be dead has reported, or a grace period has passed,
   a survivor links ``decision.json`` into place (``os.link`` fails if it exists: the
   first decision wins and every rank reads the same one). It names the roster, the
   agreed step (the highest step whose holders all have the same fingerprint), the
   writer (the lowest rank at that step) and each rank's source of local state;
3. the writer bumps ``beat`` while it saves, then writes ``outcome.json``; the others
   wait for it, and judge the writer dead when ``beat`` stops changing, or give up after an
   overall deadline (a writer stuck in a hung commit still beats).
"""
from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

from ..store.commit import atomic_write, read_regular

DECISION, OUTCOME, BEAT = "decision.json", "outcome.json", "beat"
_POLL_S = 0.05


def session_dir(root: Path, token: str) -> Path:
    return Path(root) / f".jit-{token}"


def write_json(path: Path, doc: Any) -> None:
    atomic_write(path, json.dumps(doc, sort_keys=True).encode())


def read_json(path: Path) -> Any:
    try:
        return json.loads(read_regular(path, 64 << 20))
    except (OSError, ValueError):
        return None


def alive_docs(d: Path) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    try:
        names = os.listdir(d)
    except OSError:
        return out
    for n in names:
        if n.startswith("alive-") and n.endswith(".json"):
            doc = read_json(d / n)
            if isinstance(doc, dict) and isinstance(doc.get("rank"), int):
                out[doc["rank"]] = doc
    return out


def decide(docs: dict[int, dict[str, Any]], world: int) -> dict[str, Any]:
    """The decision from the survivors' reports (pure; see the module docstring)."""
    roster = sorted(docs)
    failed = [r for r in range(world) if r not in docs]
    base: dict[str, Any] = {"roster": roster, "failed": failed, "time": time.time()}
    candidates = [d for d in docs.values() if d.get("ok")]
    if not candidates:
        return {**base, "ok": False, "reason": "no survivor holds a consistent state (each was mid-step)"}
    top = max(int(d["step"]) for d in candidates)
    holders = sorted((d for d in candidates if int(d["step"]) == top), key=lambda d: d["rank"])
    prints = {d["fp"] for d in holders}
    if len(prints) != 1:
        detail = "; ".join(f"rank {d['rank']}: {d['fp']}" for d in holders)
        return {**base, "ok": False, "step": top,
                "reason": f"the survivors at step {top} hold different states ({detail}); not saving"}
    writer = holders[0]["rank"]
    at_step = [d["rank"] for d in holders]
    source_of = {str(r): (r if r in at_step else writer) for r in range(world)}
    return {**base, "ok": True, "step": top, "writer": writer, "holders": at_step, "source_of": source_of,
            "fingerprint": holders[0]["fp"]}


def publish_decision(d: Path, decision: dict[str, Any]) -> dict[str, Any]:
    """Link ``decision`` into place unless one is there already; return the one in force."""
    tmp = d / f".decision-{secrets.token_hex(6)}"
    write_json(tmp, decision)
    try:
        os.link(tmp, d / DECISION)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    doc = read_json(d / DECISION)
    if not isinstance(doc, dict):  # pragma: no cover - linked files are complete
        raise OSError(f"{d / DECISION} cannot be read back")
    return doc


def await_decision(d: Path, world: int, known_failed: set[int], grace_s: float) -> dict[str, Any]:
    """Wait for the roster (or the grace period) and return the decision every rank reads."""
    first_seen = time.monotonic()
    while True:
        doc = read_json(d / DECISION)
        if isinstance(doc, dict):
            return doc
        docs = alive_docs(d)
        failed = set(known_failed)
        for x in docs.values():
            failed.update(int(r) for r in x.get("known_failed", []))
        expected = set(range(world)) - failed
        if expected <= set(docs) or time.monotonic() - first_seen >= grace_s:
            return publish_decision(d, decide({r: x for r, x in docs.items() if r not in failed}, world))
        time.sleep(_POLL_S)


def await_outcome(d: Path, dead_after_s: float, deadline_s: float | None = None) -> tuple[dict[str, Any] | None, str]:
    """``(the writer's outcome, "")``, or ``(None, why)`` once its ``beat`` has not changed for
    ``dead_after_s`` or ``deadline_s`` has passed in all (a writer stuck in a hung commit still beats)."""
    last: bytes | None = None
    start = changed = time.monotonic()
    while True:
        doc = read_json(d / OUTCOME)
        if isinstance(doc, dict):
            return doc, ""
        try:
            beat = read_regular(d / BEAT, 64)
        except OSError:
            beat = b""
        now = time.monotonic()
        if beat != last:
            last, changed = beat, now
        elif now - changed >= dead_after_s:
            return None, f"its heartbeat file stopped changing for {dead_after_s:.0f}s (the writer is dead or stopped)"
        if deadline_s is not None and now - start >= deadline_s:
            return None, f"no outcome within {deadline_s:.0f}s although it still beats (a hung save)"
        time.sleep(_POLL_S * 4)
