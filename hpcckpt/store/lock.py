"""Locks on one checkpoint root: a short commit lock and a lease held by the live writer.

- ``writer_lock``: serialises commits and retention (held for milliseconds). Two job
  instances after a requeue race (the old one still flushing, the new one starting)
  must not interleave commits or retention.
- ``WriterLease``: held by the training job (its coordinator) from start to close, so
  that a second live job in the same directory (a requeued job overlapping its
  previous instance, or a user's mistake) is refused with the holder's host, PID and
  Slurm job id instead of resuming from the other's checkpoints. It is an ``flock``
  on ``.hpcckpt.writer``: the kernel drops it when the holder dies, so a killed job
  never blocks its requeued successor. A holder recorded on this host whose process
  is gone (its lock kept alive only by an orphaned child that inherited it) is
  broken. A previous instance of the same Slurm job (lower restart count) is waited
  for a while: Slurm is still killing it.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from ..errors import ConfigError, HpcckptError
from .names import LEASE_NAME, LOCK_NAME

SAME_JOB_WAIT_S = 60.0  # how long a requeued job waits for its previous instance to die
_POLL_S = 0.25

log = logging.getLogger("hpcckpt")


def writer_lock(root: Path, timeout_s: float = -1) -> FileLock:
    """A ``filelock.FileLock`` on ``root/.hpcckpt.lock`` (use as a context manager).

    The root is checked first (``usable_root``): filelock retries an open that fails
    for ever, so a directory where the lock file cannot be made (read-only, another
    user's, ``/proc/self``) would hang instead of saying so.
    """
    root = Path(root)
    usable_root(root)
    return FileLock(str(root / LOCK_NAME), timeout=timeout_s, mode=0o600)


class CommitLock:
    """``writer_lock`` for a process that commits often (an engine commits every save): the
    lock file is checked and opened once, and each commit is one ``flock`` and one unlock.

    ``filelock`` spends 0.2-0.3 ms of Python per acquire and release (fork and thread
    bookkeeping, the file opened and closed each time); a small state saved at every step
    commits every few milliseconds from a background thread, and that time is held under
    the interpreter lock, so training waited for it. This is the same exclusive ``flock``
    on the same file: ``filelock`` leaves the file in place, so the two (and
    ``reader_lock``'s shared flock) exclude each other. A lock file replaced meanwhile (its
    directory removed and made again) is reopened: the flock is taken on the file that is
    there. Where the file system has no ``flock`` (``ENOLCK``, ``EOPNOTSUPP``), each commit
    goes through ``writer_lock`` and its fallback. Safe across threads of the process.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.path = self.root / LOCK_NAME
        self._fd: int | None = None
        self._mutex = threading.Lock()
        self._fallback = False

    @contextlib.contextmanager
    def __call__(self, timeout_s: float = -1) -> Iterator[None]:
        """Hold the lock (``timeout_s`` < 0: wait for ever; else ``filelock.Timeout`` after it)."""
        if self._fallback:
            with writer_lock(self.root, timeout_s=timeout_s):
                yield
            return
        if not self._mutex.acquire(timeout=timeout_s if timeout_s >= 0 else -1):
            raise Timeout(str(self.path))
        try:
            fd = self._take(timeout_s)
            if fd is None:  # no flock here: filelock's own fallback
                self._fallback = True
                with writer_lock(self.root, timeout_s=timeout_s):
                    yield
                return
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            self._mutex.release()

    def _take(self, timeout_s: float) -> int | None:
        """The descriptor, flocked, of the file now at ``path``; None: no flock on this file system."""
        for _ in range(8):
            if self._fd is None:
                usable_root(self.root)
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            fd = self._fd
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the common case: free
            except OSError as exc:
                if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    self.close()
                    return None
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                if timeout_s < 0:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                elif not _flock_within(fd, fcntl.LOCK_EX, timeout_s):
                    raise Timeout(str(self.path)) from None
            try:
                now = os.stat(self.path, follow_symlinks=False)
                mine = os.fstat(fd)
                if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                    return fd
            except FileNotFoundError:
                pass
            fcntl.flock(fd, fcntl.LOCK_UN)  # a replaced file: lock the one that is there
            self.close()
        raise OSError(errno.EAGAIN, f"{self.path} keeps being replaced while it is locked")

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def usable_root(root: Path) -> None:
    """Make ``root`` if needed and prove the lock file can be created in it; ConfigError naming
    the directory, the reason and the fix otherwise (never a raw OSError, never a hang)."""
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ConfigError(
            f"checkpoint directory {root} cannot be used: {exc.strerror or exc} "
            f"({exc.filename or root / LOCK_NAME}). Give the job a directory it can create files in "
            "(dir=... or HPCCKPT_DIR), on a file system shared by its nodes") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"checkpoint directory {root}: {LOCK_NAME} is not a regular file; remove it")
    finally:
        os.close(fd)


@contextlib.contextmanager
def reader_lock(root: Path, timeout_s: float = 30.0) -> Iterator[bool]:
    """A shared flock on ``root/.hpcckpt.lock`` while listing (yields whether it is held).

    Only where a writer created the lock file and this user may open it: a reader never
    creates files, and without the lock the caller still copes (``catalog.scan`` retries).
    Commits (``writer_lock``, exclusive) wait for the listing, and the listing for them.
    """
    try:
        fd = os.open(Path(root) / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        yield False
        return
    try:
        yield _flock_within(fd, fcntl.LOCK_SH, timeout_s)
    finally:
        os.close(fd)  # drops the lock


def _flock_within(fd: int, kind: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                return False
        time.sleep(0.002)


class WriterBusy(HpcckptError):
    """Another live job holds the writer lease of this checkpoint directory."""

    def __init__(self, message: str, *, holder_job_id: str | None = None) -> None:
        super().__init__(message)
        self.holder_job_id = holder_job_id  # the Slurm job holding it, when it is one


@dataclass(frozen=True, kw_only=True)
class Holder:
    """Who holds (or last held) a lease, as written into the lease file."""

    host: str
    pid: int
    job_id: str | None = None
    job: str | None = None  # the job as people name it (an array task as A_T); job_id is Slurm's own
    restart: int = 0
    started: float = 0.0
    proc_start: str | None = None  # /proc/PID/stat start time: tells a reused PID apart
    pid_ns: str | None = None  # PIDs are only comparable within one PID namespace (containers)

    @classmethod
    def me(cls, job_id: str | None = None, restart: int = 0, job: str | None = None) -> Holder:
        """This process, in the job ``job_id`` (Slurm's, None outside Slurm) after ``restart`` restarts;
        ``job``: its name for people (an array task's A_T), ``job_id`` when not given."""
        return cls(host=socket.gethostname(), pid=os.getpid(), job_id=job_id or None,
                   job=(job or job_id) or None, restart=restart,
                   started=time.time(), proc_start=_proc_start(os.getpid()), pid_ns=_pid_ns())

    @classmethod
    def parse(cls, raw: bytes) -> Holder | None:
        try:
            d = json.loads(raw.decode("utf-8"))
            return cls(host=str(d["host"]), pid=int(d["pid"]), job_id=d.get("job_id") and str(d["job_id"]),
                       job=(d.get("job") or d.get("job_id")) and str(d.get("job") or d["job_id"]),
                       restart=int(d.get("restart") or 0), started=float(d.get("started") or 0.0),
                       proc_start=d.get("proc_start") and str(d["proc_start"]),
                       pid_ns=d.get("pid_ns") and str(d["pid_ns"]))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return None

    def describe(self) -> str:
        job = f"Slurm job {self.job or self.job_id} (restart {self.restart})" if self.job_id else "no Slurm job"
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started)) if self.started else "?"
        return f"host {self.host}, PID {self.pid}, {job}, since {since}"

    def gone(self) -> bool:
        """True only when certainly dead: on this host, and its PID is free or reused."""
        if self.host != socket.gethostname() or self.pid_ns != _pid_ns():
            return False
        now = _proc_start(self.pid)
        return now is None or (self.proc_start is not None and now != self.proc_start)

    def predecessor_of(self, me: Holder) -> bool:
        """An earlier instance of my own Slurm job (requeued): it is being killed, wait for it."""
        return self.job_id is not None and self.job_id == me.job_id and self.restart < me.restart


def _pid_ns() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _proc_start(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks), or None when no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2:].split()
    return fields[19].decode() if len(fields) > 19 else None


class WriterLease:
    """The lease on ``root/.hpcckpt.writer``; ``acquire`` raises ``WriterBusy`` naming the holder.

    Leases of one process on one root are shared (counted): a second Checkpointer in
    the same process is the same writer, not a rival.
    """

    _held: dict[str, list[Any]] = {}  # realpath of the lease file -> [fd, count]
    _mutex = threading.Lock()

    def __init__(self, root: Path, *, job_id: str | None = None, restart: int = 0, job: str | None = None) -> None:
        """``job_id``/``restart``: the holder's Slurm job and restart count (the caller's identity;
        the store reads no environment), so that a requeued instance knows its predecessor;
        ``job``: the job's name for people (an array task's A_T), for records and messages."""
        self.root = Path(root)
        self.path = self.root / LEASE_NAME
        self._key: str | None = None
        self._job_id, self._restart, self._job = job_id, restart, job

    def acquire(self, *, wait_s: float = SAME_JOB_WAIT_S) -> None:
        key = os.path.realpath(self.path)
        with self._mutex:
            if key in self._held:
                self._held[key][1] += 1
                self._key = key
                return
            fd = self._take(wait_s)
            self._held[key] = [fd, 1]
            self._key = key

    def release(self) -> None:
        """Give the lease up (the last holder in this process unlocks and closes)."""
        if self._key is None:
            return
        with self._mutex:
            key = self._key
            self._key = None
            entry = self._held.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self._held[key]
                # Unlock explicitly: forked children (DataLoader workers) share the descriptor.
                with contextlib.suppress(OSError):
                    fcntl.flock(entry[0], fcntl.LOCK_UN)
                os.close(entry[0])

    def _take(self, wait_s: float) -> int:
        me = Holder.me(self._job_id, self._restart, self._job)
        deadline = time.monotonic() + wait_s
        while True:
            with writer_lock(self.root):  # lock + record as one step, as ``_break`` sees them
                fd = self._open()
                try:
                    locked = _try_flock(fd)
                except OSError as exc:  # ENOLCK, EOPNOTSUPP: a file system without flock
                    log.warning("hpcckpt: cannot lock %s (%s); a second writer in %s would not be "
                                "detected", self.path, exc.strerror, self.root)
                    locked = True
                if locked:
                    _record(fd, me)
                    return fd
                holder = Holder.parse(_read(fd))
                os.close(fd)
            if holder is not None and holder.gone():
                self._break(holder)
                continue
            if holder is not None and holder.predecessor_of(me) and time.monotonic() < deadline:
                _pause(holder)
                continue
            raise WriterBusy(self._busy_message(holder, me),
                             holder_job_id=(holder.job or holder.job_id) if holder else None)

    def _open(self) -> int:
        usable_root(self.root)
        return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)

    def _break(self, holder: Holder) -> None:
        """Replace a lease file whose recorded holder is dead (an orphan keeps its old inode locked)."""
        with writer_lock(self.root):
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                return
            try:
                if Holder.parse(_read(fd)) == holder and not _try_flock(fd):
                    log.warning("hpcckpt: the writer lease of %s was held for %s, which is gone; taking it over",
                                self.root, holder.describe())
                    os.unlink(self.path)
            finally:
                os.close(fd)

    def _busy_message(self, holder: Holder | None, me: Holder) -> str:
        who = holder.describe() if holder is not None else "a process that did not record itself"
        waited = " (waited for it as the previous instance of this job)" if holder and holder.predecessor_of(me) else ""
        return (f"another live job is writing checkpoints in {self.root}: {who}{waited}. Two writers in one "
                "directory would resume from each other's checkpoints. Stop that job (e.g. scancel), or give "
                f"this one its own directory (dir=... or HPCCKPT_DIR); the lease is {self.path}")


def _pause(holder: Holder) -> None:
    """Wait a moment for the previous instance of this job to die."""
    log.info("hpcckpt: waiting for the previous instance of this job to exit (%s)", holder.describe())
    time.sleep(_POLL_S)


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


def _read(fd: int) -> bytes:
    try:
        return os.pread(fd, 4096, 0)
    except OSError:
        return b""


def _record(fd: int, me: Holder) -> None:
    """Write the holder record; best effort (a full disk must not stop a job that holds the lock)."""
    data = json.dumps(asdict(me), sort_keys=True).encode()
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    except OSError as exc:
        log.warning("hpcckpt: could not record the writer lease holder in %s (%s)", LEASE_NAME, exc)
