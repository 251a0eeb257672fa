"""A run's ``start`` and ``stop`` records: one schema, which every mode writes through.

Every run of every mode (in-process, CRIU, own checkpoints) opens with one ``start`` and ends
with one ``stop`` in the ledger; ``lifecycle.history`` splits the ledger into runs at the
openers and reads why each ended from its ``stop``. Both carry:

- ``mode``: the way in (``MODES``);
- ``start``: ``resumed_from``, what the run resumed from (a step, an image's name; None: from
  the beginning), and ``process_start``, when its process started (for the goodput's restore
  and queue times) where the mode knows it;
- ``stop``: ``reason``, why it ended (a cause of ``lifecycle.causes``, or ``done``, ``error``,
  ``after_run``, ``rank_failure``), and ``step``, the step it reached (None: the mode has none).

The mode's own figures follow as further fields. The functions return the fields, so that a
path that must not wait on the ledger's lock (the JIT path's bounded append) writes the same.
"""
from __future__ import annotations

from typing import Any, Protocol

MODES = frozenset({"inprocess", "criu", "own"})


class Appends(Protocol):
    def append(self, event: str, **fields: Any) -> Any: ...


def start_fields(*, mode: str, resumed_from: Any, **fields: Any) -> dict[str, Any]:
    """The ``start`` record's fields (see the module)."""
    _check_mode(mode)
    return {"mode": mode, "resumed_from": resumed_from, **fields}


def stop_fields(*, mode: str, reason: str, step: int | None, **fields: Any) -> dict[str, Any]:
    """The ``stop`` record's fields (see the module)."""
    _check_mode(mode)
    if not isinstance(reason, str) or not reason:
        raise ValueError(f"a stop record needs its reason (a cause, done, error, ...), got {reason!r}")
    return {"reason": reason, "mode": mode, "step": step, **fields}


def record_start(ledger: Appends, *, mode: str, resumed_from: Any, **fields: Any) -> None:
    ledger.append("start", **start_fields(mode=mode, resumed_from=resumed_from, **fields))


def record_stop(ledger: Appends, *, mode: str, reason: str, step: int | None, **fields: Any) -> None:
    ledger.append("stop", **stop_fields(mode=mode, reason=reason, step=step, **fields))


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} in a run record; modes: {', '.join(sorted(MODES))}")
