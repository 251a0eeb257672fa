"""The watchdog: a tiny all-reduce every ``interval_s`` on a gloo group of its own.

The group is created collectively (every rank, same order) with a short timeout, so a
rank that is killed (its sockets close: the peers fail at once) or stopped (SIGSTOP,
a hung host: the peers' all-reduce times out) is noticed within ``timeout_s`` plus
one interval, whatever the training's main thread is doing (it may be blocked for
good in a collective of the user's step).

Each rank contributes one slot of a vector: 0 healthy, ``CLOSING`` (a normal close:
the heartbeat goes on until every rank has closed, so a rank that closes early never
leaves the others unwatched), ``LEAVING`` (this rank's training ended on an error:
the others treat it as failed and need not wait for it at the rendezvous).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("hpcckpt.jit")

HEALTHY, CLOSING, LEAVING = 0, 1, 2


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of ``str(exc)`` (empty for an exception without a message)."""
    return (str(exc).splitlines() or [""])[0][:limit]


class Heartbeat:
    """One background thread; ``on_failure(reason, known_failed)`` runs on it, once."""

    def __init__(self, rank: int, world: int, *, timeout_s: float, interval_s: float,
                 on_failure: Callable[[str, list[int]], None]) -> None:
        self.rank, self.world = rank, world
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self.on_failure = on_failure
        # Collective: every rank creates it at the same point (JitGuard's construction).
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.status = HEALTHY
        self.rounds = 0
        self.carried = HEALTHY  # the status the last completed round carried from this rank
        self.failed = threading.Event()
        self.stopped = threading.Event()  # no more rounds (closed, or failed)
        self._round = threading.Condition()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="hpcckpt-jit-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._rounds()
        except BaseException as exc:  # noqa: BLE001 - never a silently dead watchdog
            if not self.failed.is_set():
                log.exception("hpcckpt: jit: rank %d: the heartbeat thread failed", self.rank)
                self._fail(f"heartbeat thread error: {type(exc).__name__}: {first_line(exc)}", [])
        finally:
            self.stopped.set()
            with self._round:
                self._round.notify_all()

    def _rounds(self) -> None:
        while True:
            sent = self.status
            t = torch.zeros(self.world, dtype=torch.int64)
            t[self.rank] = sent
            try:
                dist.all_reduce(t, group=self.group)
            except Exception as exc:  # a peer died (connection closed) or hangs (timeout)
                self._fail(f"heartbeat failed: {type(exc).__name__}: {first_line(exc)}", [])
                return
            leaving = [r for r in range(self.world) if int(t[r]) == LEAVING and r != self.rank]
            done = all(int(t[r]) != HEALTHY for r in range(self.world))
            with self._round:
                self.rounds += 1
                self.carried = sent
                self._round.notify_all()
            if sent == LEAVING:
                return  # announced: this rank is out
            if leaving and sent == HEALTHY:
                self._fail(f"rank(s) {leaving} left training on an error", leaving)
                return
            if done:
                return  # every rank closed (or left): nothing more to watch
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def _fail(self, reason: str, known_failed: list[int]) -> None:
        self.failed.set()
        self.stopped.set()
        with self._round:
            self._round.notify_all()
        self.on_failure(reason, known_failed)

    def announce(self, status: int, timeout_s: float | None) -> bool:
        """Send ``status``; wait until a round carried it (``LEAVING``) or the heartbeat
        stopped (``CLOSING``: every rank closed, or a failure). False: stopped without it."""
        with self._round:
            if self.stopped.is_set():
                return False
            self.status = status
            self._wake.set()
            if status == CLOSING:
                self._round.wait_for(self.stopped.is_set, timeout_s)
            else:
                self._round.wait_for(lambda: self.carried == status or self.stopped.is_set(), timeout_s)
            return self.carried == status

    def destroy(self) -> None:
        """Destroy the group once the thread has ended (the healthy close path only)."""
        if self._thread is not None:
            self._wake.set()
            self._thread.join(self.timeout_s + self.interval_s + 1.0)
            if self._thread.is_alive():
                return  # still inside a collective: leave the group to the process exit
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group(self.group)
            except Exception:  # noqa: BLE001 - best effort at close
                pass
