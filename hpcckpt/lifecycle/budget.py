"""Per-cause requeue budgets, persisted across restarts in ``state_dir/requeue-budget.json``.

A job may be requeued a bounded number of times per cause (time limit, preemption,
failure...). The one no-progress guard lives here too, in the same file (``without_progress``): it
counts, by kind, the allocations in a row that ended without progress. Failures whose
committed step did not advance since the previous failure (``charge``): after
``max_failures_without_progress`` the job stops requeueing instead of crash-looping
through the queue forever. In-process runs that reached their deadline without committing
past the step they started at (``no_progress``, from ``lifecycle.stop``): at the second in
a row the run is refused, not requeued.

Nothing here may hold up a stopping job: the lock is waited for at most
``LOCK_WAIT_S`` and the file is read only when it is a regular file of bounded size;
otherwise the requeue is decided without the budget, and said so.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from hpcckpt.cluster.base import Cause
from hpcckpt.config import env_value
from hpcckpt.errors import ConfigError
from hpcckpt.fsio import atomic_write
from hpcckpt.lifecycle.ledger import LedgerBusy, _flock_bounded, _open_regular

BUDGET_FILE = "requeue-budget.json"
LOCK_WAIT_S = 2.0
MAX_BUDGET_BYTES = 1 << 20  # the file keeps 50 attempts and 200 decisions: far below this

# Causes that share a budget: maintenance and node failure are the site's doing,
# like preemption; a bare signal (scancel --signal) is the user asking for a stop.
_BUDGET_KEY = {
    Cause.TIME_LIMIT: "time_limit",
    Cause.PREEMPTION: "preemption",
    Cause.MAINTENANCE: "preemption",
    Cause.NODE_FAILURE: "preemption",
    Cause.OPERATOR_REQUEUE: "preemption",
    Cause.SUPERSEDED: "signal",
    Cause.RANK_FAILURE: "rank_failure",
    Cause.SIGNAL: "signal",
    Cause.USER_CANCEL: "signal",
    Cause.FAILURE: "failure",
    Cause.UNKNOWN: "signal",
    Cause.DONE: "signal",
}


@dataclass(frozen=True, kw_only=True)
class BudgetOptions:
    """Maximum requeues per cause; each has an ``HPCCKPT_REQUEUE_MAX_<KEY>`` override."""

    max_time_limit: int = 100
    max_preemption: int = 100
    max_signal: int = 100
    max_failure: int = 5
    max_rank_failure: int = 20  # JIT saves after a rank died or hung (hardware, or a bug that repeats)
    max_failures_without_progress: int = 2

    @classmethod
    def from_env(cls) -> BudgetOptions:
        base = cls()
        return cls(**{name: env_value(f"requeue_{name}", getattr(base, name))
                      for name in ("max_time_limit", "max_preemption", "max_signal", "max_failure", "max_rank_failure",
                                   "max_failures_without_progress")})

    def limit(self, key: str) -> int:
        return int(getattr(self, f"max_{key}"))


@dataclass(frozen=True, kw_only=True)
class BudgetDecision:
    allowed: bool
    key: str
    used: int
    limit: int
    reason: str


# What the no-progress guard counts (``without_progress``): "failure", a failure whose committed
# step is the previous failure's; "deadline", an allocation that reached its deadline without a
# newer committed step than it started at.
NO_PROGRESS_KINDS = ("failure", "deadline")


@dataclass(kw_only=True)
class _BudgetState:
    counts: dict[str, int] = field(default_factory=dict)
    without_progress: dict[str, int] = field(default_factory=dict)  # kind -> allocations in a row
    last_failure_step: int | None = None
    charged: list[str] = field(default_factory=list)
    history: list[dict[str, object]] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> _BudgetState:
        try:
            raw = json.loads(_read_bounded(path))
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"{path} is unreadable ({err}); delete it to reset the requeue budgets") from err
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} holds no budget record; delete it to reset the requeue budgets")
        counted = raw.get("without_progress") or {"failure": raw.get("failures_without_progress", 0)}  # or as before
        return cls(counts={str(k): int(v) for k, v in raw.get("counts", {}).items()},
                   without_progress={str(k): int(v) for k, v in counted.items() if k in NO_PROGRESS_KINDS},
                   last_failure_step=raw.get("last_failure_step"),
                   charged=list(raw.get("charged", [])),
                   history=list(raw.get("history", [])))

    def save(self, path: Path) -> None:
        doc = {"counts": self.counts, "without_progress": self.without_progress,
               "last_failure_step": self.last_failure_step, "charged": self.charged[-50:],
               "history": self.history[-200:]}
        # 0600: the budget is this job's own state, not for other users to read or edit.
        atomic_write(path, json.dumps(doc, indent=1, sort_keys=True), mode=0o600)

    def count_without_progress(self, kind: str, *, progressed: bool) -> int:
        """The no-progress guard: one more allocation of ``kind`` without progress (or none,
        ``progressed``); the count of such allocations in a row, this one included."""
        self.without_progress[kind] = 0 if progressed else self.without_progress.get(kind, 0) + 1
        return self.without_progress[kind]


def charge(state_dir: Path, cause: Cause | str, *, attempt: str,
           committed_step: int | None = None,
           options: BudgetOptions | None = None) -> BudgetDecision:
    """Charge one requeue to ``cause``'s budget unless it is exhausted.

    ``attempt`` identifies this run (e.g. "<job_id>:<restart_count>"): charging the
    same attempt twice (a signal storm, a retry after a refused requeue) counts once.
    """
    opts = options or BudgetOptions.from_env()
    cause = Cause.parse(cause) if isinstance(cause, str) else cause
    key = _BUDGET_KEY[cause]
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / BUDGET_FILE
    try:
        lock = _open_regular(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT)
    except OSError as exc:
        return _unrecorded(key, opts, f"its lock file is unusable ({exc})")
    try:
        try:
            _flock_bounded(lock, LOCK_WAIT_S, path.with_name(path.name + ".lock"))
        except LedgerBusy as exc:
            return _unrecorded(key, opts, str(exc))
        return _charge_locked(path, key, cause, attempt, committed_step, opts)
    finally:
        os.close(lock)


def _unrecorded(key: str, opts: BudgetOptions, why: str) -> BudgetDecision:
    """The requeue goes ahead uncounted: a stuck budget file must not strand a stopped job."""
    reason = f"requeue budget not consulted: {why}; requeueing without counting it"
    logging.getLogger("hpcckpt.lifecycle").error("hpcckpt: %s", reason)
    return BudgetDecision(allowed=True, key=key, used=-1, limit=opts.limit(key), reason=reason)


def _charge_locked(path: Path, key: str, cause: Cause, attempt: str, committed_step: int | None,
                   opts: BudgetOptions) -> BudgetDecision:
    try:
        state = _BudgetState.load(path)
    except ConfigError as exc:
        return _unrecorded(key, opts, str(exc))
    decision = _decide(state, key, cause, attempt, committed_step, opts)
    if decision.allowed and attempt not in state.charged:
        state.counts[key] = state.counts.get(key, 0) + 1
        state.charged.append(attempt)
    state.history.append({"time": time.time(), "attempt": attempt, "cause": cause.value,
                          "allowed": decision.allowed, "reason": decision.reason,
                          "committed_step": committed_step})
    try:
        state.save(path)
    except OSError as exc:  # a full disk must not cost the requeue: the decision stands, unrecorded
        logging.getLogger("hpcckpt.lifecycle").error(
            "hpcckpt: could not record the requeue budget in %s (%s); deciding without it", path, exc)
    return decision


def _read_bounded(path: Path) -> bytes:
    """The budget file's bytes: a regular file only (FIFO, device, link refused), size bounded."""
    fd = _open_regular(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(MAX_BUDGET_BYTES + 1)
    if len(data) > MAX_BUDGET_BYTES:
        raise ValueError(f"larger than {MAX_BUDGET_BYTES} bytes")
    return data


def _decide(state: _BudgetState, key: str, cause: Cause, attempt: str,
            committed_step: int | None, opts: BudgetOptions) -> BudgetDecision:
    used, limit = state.counts.get(key, 0), opts.limit(key)
    if attempt in state.charged:
        return BudgetDecision(allowed=True, key=key, used=used, limit=limit,
                              reason=f"attempt {attempt} already charged")
    if cause in (Cause.FAILURE, Cause.RANK_FAILURE):  # a rank failure may be a bug that repeats too
        stuck = state.last_failure_step is not None and committed_step == state.last_failure_step
        in_a_row = state.count_without_progress("failure", progressed=not stuck)
        state.last_failure_step = committed_step
        if in_a_row >= opts.max_failures_without_progress:
            return BudgetDecision(
                allowed=False, key=key, used=used, limit=limit,
                reason=(f"crash loop: {in_a_row + 1} failures in a row "
                        f"without progress past step {committed_step}; not requeueing. Fix the "
                        "error in the job's log, then resubmit (or raise "
                        "HPCCKPT_REQUEUE_MAX_FAILURES_WITHOUT_PROGRESS)"))
    if used >= limit:
        return BudgetDecision(
            allowed=False, key=key, used=used, limit=limit,
            reason=(f"{key} requeue budget exhausted ({used}/{limit}); raise "
                    f"HPCCKPT_REQUEUE_MAX_{key.upper()} or resubmit by hand"))
    return BudgetDecision(allowed=True, key=key, used=used + 1, limit=limit,
                          reason=f"{key} requeue {used + 1}/{limit}")


def no_progress(state_dir: Path, kind: str, *, progressed: bool) -> int | None:
    """Count one allocation of ``kind`` (``NO_PROGRESS_KINDS``) for the no-progress guard, in the
    budget file under its lock: the allocations of that kind in a row without progress, this one
    included (0: it progressed). None when the file cannot be used (its lock held past
    ``LOCK_WAIT_S``, unreadable, unwritable): the guard is not consulted, and said so, as the
    budget itself, so that a stuck file never strands a stopped job."""
    if kind not in NO_PROGRESS_KINDS:
        raise ValueError(f"no-progress kind {kind!r}; one of {', '.join(NO_PROGRESS_KINDS)}")
    log = logging.getLogger("hpcckpt.lifecycle")
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / BUDGET_FILE
    try:
        lock = _open_regular(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT)
    except OSError as exc:
        log.error("hpcckpt: the no-progress guard is not consulted: its lock file is unusable (%s)", exc)
        return None
    try:
        _flock_bounded(lock, LOCK_WAIT_S, path.with_name(path.name + ".lock"))
        state = _BudgetState.load(path)
        count = state.count_without_progress(kind, progressed=progressed)
        state.save(path)
        return count
    except (LedgerBusy, ConfigError, OSError) as exc:
        log.error("hpcckpt: the no-progress guard is not consulted: %s", exc)
        return None
    finally:
        os.close(lock)
