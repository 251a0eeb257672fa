"""``JitGuard``: a just-in-time checkpoint when a rank fails (JITC, EuroSys 2024).

In data-parallel training every rank holds the same parameters and optimizer state.
When one rank dies (kill -9, segfault, OOM), raises, or hangs, the others still hold
the state after the last completed optimizer step; they write it and requeue, and
the next allocation replays at most the step that was in flight.

Call sequence (every rank; the Checkpointer owns one guard)::

    guard = JitGuard(ckpt)       # after register(): collective (agreement, heartbeat group)
    guard.start()                # after the restore, before the first step
    guard.at_boundary(step)      # main thread, at every step boundary, BEFORE any collective there
    guard.close()                # collective on a normal end; close(error=True) when leaving on an error

On a failure the heartbeat thread (``Heartbeat``) runs the whole JIT path and ends the
process with ``os._exit(EXIT_REQUEUE)``; the main thread may be blocked in a collective
for good, or raise (the interpreter's shutdown then waits for the save):

1. hold back optimizer steps (``StepGate``) and take this rank's consistent state: the
   boundary copy whose optimizer step counts equal the live ones;
2. meet the other survivors in files under the checkpoint directory (``rendezvous``)
   and agree on the step and the writer;
3. the writer commits the checkpoint (``writer.commit``), records it in the ledger and
   requeues through the cluster adapter; everyone exits 75 once it is durable (or once
   the writer is known dead: the previous checkpoint then stands).
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..config import TUNABLES, check_jit_timeout
from ..exitcodes import EXIT_REQUEUE, flush_and_exit
from ..lifecycle import current, requeue
from ..lifecycle.records import stop_fields
from ..store import catalog, names, torchfile
from ..store.manifest import record_in, record_out
from . import rendezvous, writer
from .capture import (
    Boundary,
    CudaWaitTimeout,
    StepGate,
    capture_boundary,
    capture_replicated,
    fingerprint,
    finish,
    replication_problem,
    to_host,
)
from .heartbeat import CLOSING, LEAVING, Heartbeat

if TYPE_CHECKING:
    from ..api import Checkpointer
    from ..lifecycle.ledger import Ledger

log = logging.getLogger("hpcckpt.jit")

DEFAULT_TIMEOUT_S = float(TUNABLES["jit_timeout_s"].default)
LEDGER_WAIT_S = 10.0  # the JIT path's ledger appends: a rank stopped inside an append holds the ledger's lock
TIMEOUT_ENV = TUNABLES["jit_timeout_s"].env  # resolved into options.jit_timeout_s by config.resolve_options


def _timeout_from(ckpt: Checkpointer | None, timeout_s: float | None) -> float:
    """``timeout_s``, else the resolved ``ckpt.options.jit_timeout_s``, else the table's default;
    checked by the options table's one rule (config.check_jit_timeout)."""
    value: Any = timeout_s
    if value is None:
        value = getattr(getattr(ckpt, "options", None), "jit_timeout_s", None)
    return check_jit_timeout(value)


def requeue_cause() -> str:
    """``rank_failure`` where the cluster adapter knows it (own budget), else ``node_failure``."""
    from ..cluster.base import Cause
    return "rank_failure" if any(c.value == "rank_failure" for c in Cause) else "node_failure"


def bounded_append(ledger: Ledger, event: str, wait_s: float = LEDGER_WAIT_S, **fields: Any) -> bool:
    """``ledger.append`` on a daemon thread, waiting at most ``wait_s``; False (logged) when skipped.

    The ledger's file lock may be held for good by a rank that was stopped (SIGSTOP) or
    hung inside an append: the JIT path must still save and requeue.
    """
    t = threading.Thread(target=ledger.append, args=(event,), kwargs=fields, name="hpcckpt-jit-ledger",
                         daemon=True)
    t.start()
    t.join(wait_s)
    if t.is_alive():
        log.error("hpcckpt: jit: the ledger did not take the %r event within %.0fs (its lock is held, maybe by "
                  "the failed rank); not recorded", event, wait_s)
        return False
    return True


def _shutdown_hook(ref: weakref.ref[JitGuard]) -> None:
    guard = ref()
    if guard is not None:
        guard._at_shutdown()


def _fork_hook(ref: weakref.ref[JitGuard]) -> None:
    guard = ref()
    if guard is not None:
        guard._in_child()


class JitGuard:
    """Detects a failed rank and writes the survivors' state; see the module docstring."""

    #: how the process ends after the JIT path (never returns)
    exit = staticmethod(flush_and_exit)

    def __init__(self, ckpt: Checkpointer, *, timeout_s: float | None = None, interval_s: float | None = None) -> None:
        self.ckpt = ckpt
        self.timeout_s = _timeout_from(ckpt, timeout_s)
        self.interval_s = float(interval_s) if interval_s else min(0.5, self.timeout_s / 4)
        self.rank, self.world = ckpt.ranks.rank, ckpt.ranks.world
        self.root = Path(ckpt.root)
        self.active = False
        self.closed = False
        self.problem: str | None = None
        self.heartbeat: Heartbeat | None = None
        self.gate: StepGate | None = None
        self.dir: Path | None = None
        self._boundary: Boundary | None = None
        self._cond = threading.Condition()
        self._started_jit = threading.Event()
        self._never = threading.Event()  # never set: what a thread waits on until os._exit
        self._start_step: int | None = None
        self._pid: int | None = None  # the process that started the guard (a forked child never watches)
        if self.world <= 1:
            self.problem = "a single rank: there is no survivor to save for it"
        else:
            problem = replication_problem(ckpt.state.objects, self.world, ckpt.state)
            if ckpt.ranks.max(1 if problem else 0) and problem is None:  # collective: all ranks agree
                problem = "another rank's registered state is not replicated"
            self.problem = problem
        if self.problem is not None:
            log.warning("hpcckpt: jit: just-in-time checkpoints are off (%s); if a rank fails, the job resumes "
                        "from the last periodic checkpoint", self.problem)
            return
        token = ckpt.ranks.token()  # collective
        self.dir = rendezvous.session_dir(self.root, token)
        self.heartbeat = Heartbeat(self.rank, self.world, timeout_s=self.timeout_s, interval_s=self.interval_s,
                                   on_failure=self._on_failure)  # collective: creates the group
        self.gate = StepGate({n: o for n, o in ckpt.state.objects.items() if isinstance(o, torch.optim.Optimizer)})
        self.active = True

    # -- the training side -------------------------------------------------------

    def start(self) -> None:
        """Copy the state at the current step and start the heartbeat; main thread, once."""
        if not self.active or self.heartbeat is None or self.heartbeat._thread is not None:
            return
        self._pid = os.getpid()
        self._start_step = int(self.ckpt.step)
        self._set_boundary(self._start_step)
        # Through weak references: the registrations never keep the Checkpointer and its model alive.
        ref = weakref.ref(self)
        threading._register_atexit(_shutdown_hook, ref)  # type: ignore[attr-defined]  # private CPython API, not in the stubs
        os.register_at_fork(after_in_child=lambda: _fork_hook(ref))
        self.heartbeat.start()
        if self.rank == 0:  # after the heartbeat started: a slow file system never delays it
            threading.Thread(target=self._sweep_sessions, name="hpcckpt-jit-sweep", daemon=True).start()
        log.info("hpcckpt: jit: watching %d ranks (timeout %.1fs, heartbeat every %.2fs)", self.world,
                 self.timeout_s, self.interval_s)

    def at_boundary(self, step: int) -> None:
        """Copy the rank-local state as of ``step`` (done). Call before any collective of the boundary."""
        if not self.active or self.closed:
            return
        self._set_boundary(int(step))
        if self._failing():
            self._never.wait()  # the JIT path owns this process now and ends it

    def _set_boundary(self, step: int) -> None:
        assert self.gate is not None
        b = capture_boundary(step, self.gate.snapshot(), self.ckpt.state.objects, self.ckpt.state.user_meta)
        b.trees["wall"] = time.time()
        with self._cond:
            self._boundary = b
            self._cond.notify_all()

    def close(self, error: bool | None = None) -> None:
        """Stop watching. ``error``: this rank leaves on an error (the others then save without it).

        By default an exception being handled counts as an error. A normal close returns
        once every rank has closed (the last step's collectives keep them close together).
        If a failure is detected meanwhile, never returns: the JIT path ends the process.
        """
        if not self.active or self.closed:
            return
        if error is None:
            exc = sys.exc_info()[1]
            error = exc is not None and not (isinstance(exc, SystemExit) and exc.code in (0, None, EXIT_REQUEUE))
        self.closed = True
        assert self.heartbeat is not None and self.gate is not None
        if self.heartbeat._thread is None:  # never started: nothing to tell the others
            self.gate.remove()
            self.heartbeat.destroy()
            return
        # CLOSING waits for every rank to close (a hung or dead one ends it as a failure instead).
        self.heartbeat.announce(LEAVING, self.timeout_s + self.interval_s + 1.0) if error else \
            self.heartbeat.announce(CLOSING, None)
        if self._failing():
            self._never.wait()
        self.gate.remove()
        self.heartbeat.destroy()

    def _in_child(self) -> None:
        """In a forked child (DataLoader worker, multiprocessing): the parent watches, never the child."""
        if self._pid is not None and os.getpid() != self._pid:
            self.active = False

    def _at_shutdown(self) -> None:
        """The interpreter is ending (the main thread returned or raised) without ``close``.

        An uncaught exception (``sys.last_value``, set when its traceback was printed)
        makes this rank leave (``LEAVING``: the others save without it); a normal end
        closes (``CLOSING``), as ``close()`` does.
        """
        if not self.active or os.getpid() != self._pid:
            return  # never started, or a forked child: no heartbeat thread here
        if self._failing():
            self._never.wait()
        if self.closed:
            return
        self.closed = True
        assert self.heartbeat is not None
        error = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        if error is not None:
            self.heartbeat.announce(LEAVING, self.timeout_s + self.interval_s + 1.0)
        else:
            self.heartbeat.announce(CLOSING, None)
        if self._failing():
            self._never.wait()

    def _failing(self) -> bool:
        """A failure was detected: the JIT path runs (or is about to) and will end the process."""
        return self._started_jit.is_set() or (self.heartbeat is not None and self.heartbeat.failed.is_set())

    def _sweep_sessions(self) -> None:
        """Rendezvous directories of earlier runs (this run holds the writer lease)."""
        try:
            for p in self.root.iterdir():
                if p.name.startswith(".jit-") and p != self.dir and p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass

    # -- the JIT path (heartbeat thread) ---------------------------------------------

    def _on_failure(self, reason: str, known_failed: list[int]) -> None:
        if self._started_jit.is_set():
            return
        self._started_jit.set()
        detected = time.time()
        log.error("hpcckpt: jit: rank %d detected a failure (%s)", self.rank, reason)
        code = EXIT_REQUEUE
        try:
            self._jit(reason, known_failed, detected)
        except BaseException as exc:  # noqa: BLE001 - the process must still end with a requeue
            log.exception("hpcckpt: jit: rank %d: the just-in-time checkpoint failed (%s); the previous "
                          "checkpoint stands", self.rank, exc)
        self.exit(code)

    def _consistent_state(self) -> tuple[Boundary | None, str]:
        """This rank's boundary copy if it matches the live parameters (steps held back)."""
        assert self.gate is not None
        if not self.gate.freeze(self.timeout_s):
            return None, "an optimizer step did not finish"
        want = self.gate.snapshot()
        with self._cond:
            # Between an optimizer step and its boundary the main thread may still get there.
            self._cond.wait_for(lambda: self._boundary is not None and self._boundary.counts == want,
                                self.timeout_s)
            b = self._boundary
        if b is None or b.counts != want:
            return None, "parameters are past the last boundary (the step's boundary never came)"
        return finish(b), ""

    def _jit(self, reason: str, known_failed: list[int], detected: float) -> None:
        assert self.dir is not None
        d = self.dir
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        b, replicated, rep_trees = self._report_alive(d, reason, known_failed, detected)
        grace = self.timeout_s + self.interval_s + 3.0
        decision = rendezvous.await_decision(d, self.world, set(known_failed), grace)
        roster = decision.get("roster", [])
        lead = min(roster) if roster else None
        log.error("hpcckpt: jit: rank %d: decision %s", self.rank,
                  {k: decision.get(k) for k in ("ok", "step", "writer", "failed", "reason")})
        outcome: dict[str, Any] | None = None
        if decision.get("ok") and decision.get("writer") == self.rank and b is not None:
            outcome = self._write(d, decision, b, replicated, rep_trees)
            requeuer = self.rank
        elif decision.get("ok"):
            outcome, requeuer = self._await_writer(d, decision, roster)
        else:
            requeuer = lead if lead is not None else -1
        if self.rank == lead:  # once the outcome is known
            self._record_failure(d, decision, outcome, roster, reason, detected, b)
        if self.rank == requeuer:
            self._stop_and_requeue(decision, outcome)
        log.error("hpcckpt: jit: rank %d exits %d for a requeue (%s)", self.rank, EXIT_REQUEUE,
                  f"checkpoint step {outcome['step']} committed" if outcome and outcome.get("ok")
                  else "no just-in-time checkpoint")

    def _report_alive(self, d: Path, reason: str, known_failed: list[int], detected: float
                      ) -> tuple[Boundary | None, dict[str, torch.Tensor], dict[str, Any]]:
        """This survivor's consistent state, written beside the others' with what it knows
        (``alive-<rank>.json``): the state, the replicated tensors and trees (None, {}, {} when
        it holds nothing it can write)."""
        b, why = self._consistent_state()
        with self._cond:
            last = self._boundary
        doc: dict[str, Any] = {"rank": self.rank, "ok": b is not None, "why": why, "reason": reason,
                               "known_failed": known_failed, "detected_at": detected,
                               "reached": last.step if last is not None else None,
                               "host": socket.gethostname(), "pid": os.getpid()}
        replicated: dict[str, torch.Tensor] = {}
        rep_trees: dict[str, Any] = {}
        if b is not None:
            rep_trees, live = capture_replicated(self.ckpt.state.objects, b.groups)
            assert self.gate is not None
            replicated = {n: t for n, t in live.items() if n not in b.tensors}  # live: the writer copies them
            try:
                b.tensors = to_host(b.tensors, b.events)
                fp = fingerprint(b.step, b.counts, replicated, list(self.gate.events.values()) + b.events)
            except CudaWaitTimeout as exc:  # this survivor holds nothing it can write; the others may
                log.error("hpcckpt: jit: rank %d: %s", self.rank, exc)
                b, replicated = None, {}
                doc.update(ok=False, why=str(exc))
        if b is not None:
            rec = torchfile.write(d / names.jit_local_file(self.rank), b.tensors)
            doc.update(step=b.step, counts=list(b.counts),
                       state_bytes=sum(t.numel() * t.element_size() for t in (*replicated.values(),
                                                                              *b.tensors.values())),
                       fp=fp,
                       local=record_out(rec), trees={k: v for k, v in b.trees.items() if k != "wall"},
                       boundary_at=b.trees.get("wall"))
        rendezvous.write_json(d / f"alive-{self.rank}.json", doc)
        return b, replicated, rep_trees

    def _await_writer(self, d: Path, decision: dict[str, Any], roster: list[int]
                      ) -> tuple[dict[str, Any] | None, int]:
        """Another rank writes: its outcome (None if it never came), and who requeues."""
        state_bytes = sum(int(x.get("state_bytes", 0)) for x in rendezvous.alive_docs(d).values()
                          if x.get("rank") == decision.get("writer"))
        limit = self._outcome_deadline(state_bytes)
        outcome, why = rendezvous.await_outcome(d, dead_after_s=max(10.0, 2 * self.timeout_s),
                                                deadline_s=limit)
        writer_rank = decision.get("writer")
        others = [r for r in roster if r != writer_rank]
        requeuer = writer_rank if outcome is not None else (min(others) if others else -1)
        if outcome is None:
            log.error("hpcckpt: jit: rank %d stops waiting for the writer (rank %s): %s; the previous "
                      "checkpoint stands", self.rank, writer_rank, why)
            if self.rank == requeuer:
                bounded_append(self.ckpt.ledger, "save_failed", step=decision.get("step"), final=True,
                               engine="jit", error=f"writer rank {writer_rank}: {why}")
        return outcome, int(requeuer) if requeuer is not None else -1

    def _record_failure(self, d: Path, decision: dict[str, Any], outcome: dict[str, Any] | None,
                        roster: list[int], reason: str, detected: float, b: Boundary | None) -> None:
        """The lead survivor's ``rank_failure`` record, once the outcome is known."""
        step = decision.get("step")
        saved = bool(outcome and outcome.get("ok"))
        reached = [int(x["reached"]) for r, x in rendezvous.alive_docs(d).items()
                   if r in roster and isinstance(x.get("reached"), int)]
        bounded_append(
            self.ckpt.ledger, "rank_failure", failed_ranks=decision.get("failed"), survivors=roster,
            reason=reason, detected_at=detected,
            detect_after_boundary_s=(detected - b.trees["wall"]) if b else None,
            jit_step=step if saved else None, lost_step=(step + 1) if isinstance(step, int) else None,
            reached_step=max(reached) if reached else None, timeout_s=self.timeout_s, jit=saved,
            problem=decision.get("reason") or (None if saved or outcome is None else outcome.get("error")))

    def _write(self, d: Path, decision: dict[str, Any], b: Boundary, replicated: dict[str, torch.Tensor],
               rep_trees: dict[str, Any]) -> dict[str, Any]:
        """The writer's part: commit, then publish the outcome."""
        step = int(decision["step"])
        stop = threading.Event()

        def beat() -> None:
            n = 0
            while not stop.is_set():
                n += 1
                try:
                    rendezvous.write_json(d / rendezvous.BEAT, n)
                except OSError:
                    pass
                stop.wait(0.25)

        beater = threading.Thread(target=beat, name="hpcckpt-jit-beat", daemon=True)
        beater.start()
        t0 = time.monotonic()
        try:
            existing = catalog.inspect_step(self.root, step)
            ours = {self.ckpt.committed_step, self.ckpt.resumed_from} - {None}
            if existing is not None and existing.status == "committed" and step in ours:
                path, wrote = existing.path, False  # this run committed (or resumed from) this very step
            # (a step-``step`` directory of an earlier run may hold other state: a fresh one replaces it)
            elif step == self._start_step:
                raise RuntimeError(f"no step completed since this run started at step {step}: nothing to save "
                                   "(the next run starts where this one did)")
            else:
                path, wrote = self._commit(d, decision, b, replicated, rep_trees, step), True
            save_s = time.monotonic() - t0
            outcome = {"ok": True, "step": step, "path": str(path), "save_s": save_s, "wrote": wrote}
            self.ckpt.committed_step = step
            bounded_append(self.ckpt.ledger, "commit", step=step, save_s=round(save_s, 6), engine=writer.ENGINE, final=True,
                                    path=str(path), jit=True, wrote=wrote, failed_ranks=decision["failed"])
            log.error("hpcckpt: jit: rank %d committed step %d in %.3fs (%s)", self.rank, step, save_s, path)
        except Exception as exc:
            outcome = {"ok": False, "step": step, "error": f"{type(exc).__name__}: {exc}"}
            log.error("hpcckpt: jit: the just-in-time checkpoint of step %d failed: %s", step, exc)
            bounded_append(self.ckpt.ledger, "save_failed", step=step, final=True, engine=writer.ENGINE,
                           error=outcome["error"])
        finally:
            stop.set()
        rendezvous.write_json(d / rendezvous.OUTCOME, outcome)
        return outcome

    def _commit(self, d: Path, decision: dict[str, Any], b: Boundary, replicated: dict[str, torch.Tensor],
                rep_trees: dict[str, Any], step: int) -> Path:
        """The survivors' state of ``step`` committed: this rank's own, the holders' from their files."""
        sources: dict[int, tuple[dict[str, torch.Tensor], Any]] = {
            self.rank: (b.tensors, {k: v for k, v in b.trees.items() if k != "wall"})}
        docs = rendezvous.alive_docs(d)
        for r in decision["holders"]:
            if r != self.rank:
                x = docs[r]
                sources[r] = (torchfile.read(d / names.jit_local_file(r), record_in(x["local"])), x["trees"])
        source_of = {int(r): int(s) for r, s in decision["source_of"].items()}
        assert self.gate is not None
        replicated = to_host(replicated, list(self.gate.events.values()) + b.events)
        return writer.commit(
            self.root, step=step, world=self.world, writer_rank=self.rank,
            keep=int(getattr(self.ckpt.options, "keep", 3)),
            job=self._job(), user={}, replicated_trees=rep_trees, replicated=replicated, sources=sources,
            source_of=source_of,
            info={"failed_ranks": decision["failed"], "writer": self.rank, "holders": decision["holders"],
                  "substituted": sorted(r for r, s in source_of.items() if s != r),
                  "fingerprint": decision["fingerprint"]})

    def _outcome_deadline(self, state_bytes: int) -> float:
        """How long the others wait for the writer's outcome at most, even while it beats.

        Generous: the state written at 20 MB/s, the writer lock's wait, and a few timeouts.
        """
        return state_bytes / 20e6 + writer.LOCK_TIMEOUT_S + 6 * self.timeout_s + 60.0

    def _committed_step(self) -> int | None:
        try:
            newest = catalog.find(self.root, None)
        except Exception:  # noqa: BLE001 - none committed
            return None
        return newest.step

    def _stop_and_requeue(self, decision: dict[str, Any], outcome: dict[str, Any] | None) -> None:
        committed = self._committed_step()
        bounded_append(self.ckpt.ledger, "stop", **stop_fields(
            mode="inprocess", reason="rank_failure", step=decision.get("step"), committed_step=committed,
            requeue=True, final_saved=bool(outcome and outcome.get("ok")), failed_ranks=decision.get("failed")))
        # A rank died, so the job step's status is not 75 and a batch script that requeues only on
        # 75 would not: the writer requeues itself (this process ends right after anyway).
        result = requeue(cluster=self.ckpt.cluster, state_dir=self.root, cause=requeue_cause(),
                         committed_step=committed, ledger=self.ckpt.ledger, source="jit").as_dict()
        log.error("hpcckpt: jit: requeue decision: %s", result)

    def _job(self) -> dict[str, object]:
        return current().as_job(self.ckpt.cluster.name)
