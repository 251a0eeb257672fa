"""The DataLoader workers hpcckpt quiets (``QuietWorkers``) end with the script.

hpcckpt makes the workers of a loader it trains through ignore the stop signals (Slurm
sends them to every process of the job; a worker that died of one would fail the step
that must reach the final save). At the interpreter's exit multiprocessing ends the
workers still running with ``terminate()`` (a TERM, which they now ignore) and then
``join()``s them without a timeout: a loader with ``persistent_workers=True`` (timm's
default) kept its workers to the end, and every process hung at exit, after a normal end
and after a stop's exit 75 alike (under Slurm, until the time limit).

So, once per process, an ``atexit`` callback (registered after multiprocessing's and
torch's, so it runs before them) ends them first: the worker iterators of the loaders
hpcckpt quieted (a persistent loader's ``_iterator``) and of the passes it began are shut
down as torch does it (each worker is told to end and joined), and a quieted worker still
alive after that (an iterator hpcckpt never saw) is killed. Workers of other loaders are
left to multiprocessing, as without hpcckpt.
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger("hpcckpt")

JOIN_S = 2.0  # how long quieted workers still alive after the shutdown get before they are killed

class QuietWorkers:
    """The ``worker_init_fn`` that ``signals.quiet_workers`` gives a DataLoader trained through
    hpcckpt: each worker process ignores the stop signals, then runs the loader's own function."""

    def __init__(self, inner: Callable[[int], Any] | None, signums: tuple[int, ...]) -> None:
        self.inner, self.signums = inner, signums

    def __call__(self, worker_id: int) -> Any:
        for signum in self.signums:
            signal.signal(signum, signal.SIG_IGN)
        return self.inner(worker_id) if self.inner is not None else None


_lock = threading.Lock()
_loaders: weakref.WeakSet[Any] = weakref.WeakSet()
_iterators: weakref.WeakSet[Any] = weakref.WeakSet()
_registered_in: int | None = None  # the pid whose exit runs ``end_at_exit`` (a fork's child has its own)


def track_loader(loader: Any) -> None:
    """``loader``'s workers are quieted: end them (its persistent iterator) at exit."""
    _track(_loaders, loader)


def track_iterator(it: Any) -> None:
    """An iterator hpcckpt made of a loader (a pass it began): if its workers are quieted, end them at exit."""
    if isinstance(getattr(it, "_worker_init_fn", None), QuietWorkers) and callable(
            getattr(it, "_shutdown_workers", None)):
        _track(_iterators, it)


def _track(into: weakref.WeakSet[Any], obj: Any) -> None:
    global _registered_in
    with _lock:
        try:
            into.add(obj)
        except TypeError:  # no weak references to it: the kill at exit still ends its workers
            pass
        if _registered_in != os.getpid():
            _registered_in = os.getpid()
            import multiprocessing.util  # noqa: F401  # registers its atexit first, so ours runs before it
            atexit.register(end_at_exit)


def end_at_exit() -> None:
    """The atexit callback: end the quieted workers (never raises)."""
    if _registered_in != os.getpid():
        return
    try:
        end_workers()
    except BaseException as exc:  # noqa: BLE001  # at exit: a failure here must not hide the script's status
        log.debug("hpcckpt: ending DataLoader workers at exit: %s", exc)


def end_workers(join_s: float = JOIN_S) -> list[int]:
    """Shut down the worker iterators of tracked loaders and passes, then kill their quieted
    workers still alive; returns the pids killed.

    A quieted loader's iterator hpcckpt never saw (one the script made and kept) is looked
    for among the live objects, only while a child that ignores TERM is still running (which
    multiprocessing's exit would wait for without end)."""
    with _lock:
        iterators = list(_iterators)
        loaders = list(_loaders)
    iterators += [getattr(ld, "_iterator", None) for ld in loaders]
    done: dict[int, Any] = {}
    _shut_down(iterators, done)
    if _deaf_children():
        _shut_down(_live_quieted_iterators(), done)
    procs = [w for it in done.values() for w in getattr(it, "_workers", ())]
    return _kill_alive(procs, join_s)


def _quieted(it: Any) -> bool:
    return isinstance(getattr(it, "_worker_init_fn", None), QuietWorkers) and callable(
        getattr(it, "_shutdown_workers", None))


def _shut_down(iterators: list[Any], done: dict[int, Any]) -> None:
    for it in iterators:
        if id(it) in done or not _quieted(it):
            continue
        done[id(it)] = it
        if getattr(it, "_shutdown", True):
            continue
        try:
            it._shutdown_workers()  # tells each worker to end, joins it, forgets its pids
        except Exception as exc:  # noqa: BLE001
            log.debug("hpcckpt: shutting down a DataLoader iterator at exit: %s", exc)


def _deaf_children() -> bool:
    """Whether a live multiprocessing child of this process ignores TERM (its ``terminate()`` would not end it)."""
    import multiprocessing

    from .tree import status_field
    for p in multiprocessing.active_children():
        ignored = status_field(p.pid, "SigIgn") if p.pid else None
        if ignored and int(ignored, 16) >> (signal.SIGTERM - 1) & 1:
            return True
    return False


def _live_quieted_iterators() -> list[Any]:
    """Iterators of quieted loaders among the live objects (the collector's), by generation."""
    import gc
    import sys
    dataloader = sys.modules.get("torch.utils.data.dataloader")
    cls = getattr(dataloader, "_MultiProcessingDataLoaderIter", None)
    if not isinstance(cls, type):
        return []
    found: list[Any] = []
    for generation in range(3):  # by type first: no attribute of an arbitrary object is read
        found += [o for o in gc.get_objects(generation) if issubclass(type(o), cls) and _quieted(o)]
    return found


def _kill_alive(procs: list[Any], join_s: float) -> list[int]:
    deadline = time.monotonic() + join_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    left = [p for p in procs if p.is_alive()]
    if not left:
        return []
    # torch's SIGCHLD handler raises in the main thread for a worker of a live iterator that
    # dies; at exit that would only print an error in place of the script's own status
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    killed = []
    for p in left:
        try:
            p.kill()  # it ignores TERM (QuietWorkers)
            killed.append(p.pid)
        except (OSError, ValueError):
            continue
    for p in left:
        p.join(timeout=5.0)
    log.debug("hpcckpt: killed DataLoader workers %s at exit", killed)
    return killed
