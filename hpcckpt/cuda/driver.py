"""The CUDA driver's process checkpoint API (cuCheckpointProcess*) through ctypes.

The API (CUDA 12.8, driver >= 570) acts on ANOTHER process by PID: ``lock`` stops
new CUDA work in it and waits for submitted work, ``checkpoint`` copies its device
memory into its host memory and releases the GPU, ``restore`` re-acquires the GPU
and copies the memory back, ``unlock`` lets it run CUDA work again. States:
RUNNING -lock-> LOCKED -checkpoint-> CHECKPOINTED -restore-> LOCKED -unlock-> RUNNING.
A CHECKPOINTED process holds no GPU resources, which is what lets CRIU dump it.

Every argument struct is 64 bytes and "reserved fields must be zero"; zeroed
structs are passed rather than NULL so that the layout is explicit.

The driver does the work through the TARGET's own CUDA restore thread (CRIU's cuda
plugin PTRACE_CONTs that thread before each call for this reason). A target that is
stopped (SIGSTOP: task state T) or held by a tracer (t) would block the call forever,
so lock/checkpoint/restore/unlock refuse a stopped process up front (a traced one
gets a few seconds for its tracer to let go: a criu that was just killed), and every
call runs with a deadline (``call_timeout_s``; state queries a short one): a lock,
checkpoint, restore or unlock that does not return is reported as STUCK, with the
target's task states, and no further call is made for THAT process until it returns
(calls for other processes go on, each with its own deadline, so peers already locked
can still be brought back). A state query that does not return changed nothing: it is
reported as "could not query". A stuck call that returns late is said on stderr with
what it left (LOCKED or CHECKPOINTED, and the command that brings the process back),
and recorded for the supervisor (``take_late_returns``), which brings it back itself.
"""
from __future__ import annotations

import atexit
import ctypes
import enum
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from ..errors import CudaCheckpointError
from ..exitcodes import flush_and_exit
from ..proc.tree import maps_library, status_field, task_states

LIBCUDA = "libcuda.so.1"
# How a process that talks to the driver shows in /proc/PID/maps (not libcudart).
MAPPED_DRIVER = "/libcuda.so"
# cuDriverGetVersion encodes 1000*major + 10*minor; the checkpoint API came with 12.8.
MIN_DRIVER_API = 12080
MIN_DRIVER_TEXT = "CUDA 12.8 (NVIDIA driver >= 570)"
# Restoring onto other GPUs (CUcheckpointRestoreArgs.gpuPairs) needs CUDA 13.0 (driver >= 580).
MIN_REMAP_API = 13000
MIN_REMAP_TEXT = "CUDA 13.0 (NVIDIA driver >= 580)"
_CUDA_SUCCESS = 0
# What the state query or lock returns for a process that maps libcuda but never
# created a context (a CPU-only job with a CUDA build of torch): not a CUDA process.
NO_CONTEXT_CODES = (1, 3)  # CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_INITIALIZED
_CUDA_ERROR_NO_DEVICE = 100
_CUDA_ERROR_NOT_FOUND = 500
# How long one cuCheckpointProcess* call may take before it is called stuck (a lock gets
# its own timeout on top). Checkpoint and restore copy all device memory (80 GB on an
# H100) between GPU and host: minutes at worst, never hours.
CALL_TIMEOUT_S = 600.0
# State queries (GetState, GetRestoreThreadId) change nothing and answer at once when the
# driver is sane; one that hangs is a failed query, not a stuck process.
QUERY_TIMEOUT_S = 30.0
# How long a traced (t) target's tracer gets to let go before the call is refused: criu
# killed on a timeout detaches from the job only once the kernel has reaped it.
TRACER_WAIT_S = 10.0
# Calls that run on the target's restore thread and so need the target's tasks running.
_NEEDS_TARGET_RUNNING = ("Lock", "Checkpoint", "Restore", "Unlock")
_STUCK_LOCK = threading.Lock()
_TASK_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible wait", "T": "stopped by a signal",
                "t": "stopped by a tracer", "Z": "zombie", "X": "dead", "I": "idle"}


class CudaDriverMissing(CudaCheckpointError):
    """libcuda.so.1 cannot be loaded: no NVIDIA driver on this machine."""


class CudaDriverTooOld(CudaCheckpointError):
    """The driver predates the checkpoint API."""


class CudaNoContext(CudaCheckpointError):
    """The PID does not exist or has no CUDA context."""


class CudaProcessStopped(CudaCheckpointError):
    """The target is stopped or held by a tracer: its restore thread cannot run."""


class CudaCallStuck(CudaCheckpointError):
    """A lock/checkpoint/restore/unlock did not return within its deadline (or one of the
    same process has not): the process may be left LOCKED or CHECKPOINTED."""

    def __init__(self, message: str, *, pid: int = 0, what: str = "") -> None:
        super().__init__(message)
        self.pid = pid
        self.what = what


class CudaQueryTimedOut(CudaCheckpointError):
    """A state query (GetState, GetRestoreThreadId) did not return in time: nothing in the
    process was changed by it, but its CUDA state could not be read."""


@dataclass(frozen=True, kw_only=True)
class LateReturn:
    """A call reported stuck that returned after all. ``left``: the state a successful
    lock/checkpoint/restore/unlock puts the process in (None when it failed or was a query)."""

    pid: int
    what: str
    name: str
    result: str
    left: ProcessState | None
    after_s: float


_LATE: list[LateReturn] = []


def take_late_returns() -> list[LateReturn]:
    """The stuck calls that have returned since the last call (each is reported once)."""
    with _STUCK_LOCK:
        out = list(_LATE)
        _LATE.clear()
    return out


def any_stuck() -> bool:
    """Whether some driver call of this process is still blocked in the driver."""
    with _STUCK_LOCK:
        return bool(CudaCheckpoint._stuck)


# The status this process means to exit with (set by its entry point before it returns);
# used only when a driver call is still blocked at exit (see _leave_if_stuck).
_EXIT_STATUS: list[int] = []


def set_exit_status(code: int) -> None:
    """Say which status this process is about to exit with (used only if a call is stuck)."""
    _EXIT_STATUS[:] = [int(code)]


def _leave_if_stuck() -> None:
    """At exit, with a driver call still blocked, a normal exit can hang in libcuda's own
    teardown (its exit handlers wait for that call): flush and leave with the intended
    status at once. Registered (atexit) when a call first gets stuck; Python's atexit
    handlers run before the C library's, so this comes first."""
    if not any_stuck() or not _EXIT_STATUS:
        return
    with _STUCK_LOCK:
        names = ", ".join(name for name, _ in CudaCheckpoint._stuck.values())
    try:
        print(f"hpcckpt: exiting with {names} still blocked in the driver (skipping the CUDA library's "
              "teardown, which would wait for it)", file=sys.stderr)
    except (OSError, ValueError):
        pass
    flush_and_exit(_EXIT_STATUS[0])


_AT_EXIT: list[bool] = []


def describe_tasks(pid: int) -> str:
    """``PID 12: 9 tasks: 8 sleeping, 1 stopped by a signal (TID 15)`` (for messages)."""
    states = task_states(pid)
    if not states:
        return f"PID {pid} is gone"
    counts = Counter(states.values())
    parts = []
    for st, n in sorted(counts.items()):
        tids = [t for t, s in states.items() if s == st]
        parts.append(f"{n} {_TASK_STATES.get(st, st)}" + (f" (TID {', '.join(map(str, tids[:5]))})"
                                                            if st in "Tt" else ""))
    return f"PID {pid}: {len(states)} task(s): {', '.join(parts)}"


def tracer_of(pid: int, tid: int) -> int:
    """TracerPid of a task (0: not traced, or gone)."""
    value = status_field(pid, "TracerPid", task=tid)
    return int(value) if value and value.isdigit() else 0


def _traced_tasks(pid: int) -> list[int]:
    return [tid for tid, st in task_states(pid).items() if st == "t"]


def wait_for_tracer(pid: int, *, timeout_s: float | None = None, poll_s: float = 0.05) -> None:
    """Give tasks of ``pid`` in a tracing stop (t) up to ``timeout_s`` for their tracer to let go
    (a criu killed on a timeout detaches only once it is gone); returns at once when none is."""
    deadline = time.monotonic() + (TRACER_WAIT_S if timeout_s is None else timeout_s)
    while _traced_tasks(pid) and time.monotonic() < deadline:
        time.sleep(poll_s)


def refuse_stopped(pid: int, what: str) -> None:
    """Raise CudaProcessStopped when any task of ``pid`` is stopped (T), or still traced (t)
    after TRACER_WAIT_S for its tracer to detach."""
    states = task_states(pid)
    if "t" in states.values() and "T" not in states.values():
        wait_for_tracer(pid)
    stopped = {tid: st for tid, st in task_states(pid).items() if st in ("T", "t")}
    if not stopped:
        return
    traced = any(st == "t" for st in stopped.values())
    tracers = sorted({tracer_of(pid, tid) for tid, st in stopped.items() if st == "t"} - {0})
    by = f" (tracer PID {', '.join(map(str, tracers))})" if tracers else ""
    fix = (f"detach the tracer{by} (a debugger, strace, or a criu still holding it) and retry" if traced else
           f"resume it (kill -CONT {pid}) and retry")
    raise CudaProcessStopped(
        f"not calling cuCheckpointProcess{what}(pid={pid}): the process is "
        f"{'held by a tracer' if traced else 'stopped'} ({describe_tasks(pid)}); the driver does this work "
        f"through the process's own CUDA restore thread, so the call would block until it runs again: {fix}")


class CudaCallFailed(CudaCheckpointError):
    """A cuCheckpointProcess* call returned an error."""

    def __init__(self, message: str, *, code: int, name: str) -> None:
        super().__init__(message)
        self.code = code
        self.name = name


class ProcessState(enum.IntEnum):
    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3


class _LockArgs(ctypes.Structure):
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


class _GpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", ctypes.c_ubyte * 16), ("newUuid", ctypes.c_ubyte * 16)]


class _RestoreArgs(ctypes.Structure):
    _fields_ = [("gpuPairs", ctypes.POINTER(_GpuPair)), ("gpuPairsCount", ctypes.c_uint),
                ("reserved", ctypes.c_char * (52 - ctypes.sizeof(ctypes.c_void_p))),
                ("reserved1", ctypes.c_uint64)]


class _ReservedArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


@dataclass(frozen=True, kw_only=True)
class Gpu:
    """One visible device: its index as this process sees it, UUID (``GPU-...``) and model."""

    index: int
    uuid: str
    name: str

    def as_dict(self) -> dict[str, object]:
        return {"index": self.index, "uuid": self.uuid, "name": self.name}


def uuid_text(raw: bytes) -> str:
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def uuid_bytes(text: str) -> bytes:
    raw = bytes.fromhex(text.removeprefix("GPU-").replace("-", ""))
    if len(raw) != 16:
        raise CudaCheckpointError(f"{text!r} is not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)")
    return raw


@dataclass(frozen=True, kw_only=True)
class DriverInfo:
    path: str
    api_version: int

    @property
    def text(self) -> str:
        return f"{self.api_version // 1000}.{(self.api_version % 1000) // 10}"


def load_library(path: str = LIBCUDA) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(path)
    except OSError as exc:
        raise CudaDriverMissing(
            f"cannot load {path} ({exc}): no NVIDIA driver on this machine. The CUDA "
            f"checkpoint API needs {MIN_DRIVER_TEXT}; run on a GPU node, or set "
            "HPCCKPT_LIBCUDA to the driver library's path") from None


class CudaCheckpoint:
    """One loaded driver. Methods take the target's PID as this process sees it."""

    # The calls still blocked in the driver, by target PID: (call name, what). No call is
    # made for that PID until it has returned; other PIDs are not held up by it.
    _stuck: ClassVar[dict[int, tuple[str, str]]] = {}

    def __init__(self, library: str | None = None, *, call_timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.path = library or os.environ.get("HPCCKPT_LIBCUDA") or LIBCUDA
        self.call_timeout_s = call_timeout_s
        self._lib = load_library(self.path)
        self.info = DriverInfo(path=self.path, api_version=self._driver_version())
        self._require_checkpoint_api()
        self._init()

    def _driver_version(self) -> int:
        fn = getattr(self._lib, "cuDriverGetVersion", None)
        if fn is None:
            raise CudaDriverMissing(f"{self.path} has no cuDriverGetVersion: not a CUDA driver library")
        version = ctypes.c_int(0)
        rc = fn(ctypes.byref(version))
        if rc != _CUDA_SUCCESS:
            raise CudaDriverMissing(f"cuDriverGetVersion failed in {self.path}: {self.error_name(rc)}")
        return version.value

    def _require_checkpoint_api(self) -> None:
        has_api = hasattr(self._lib, "cuCheckpointProcessLock")
        if self.info.api_version < MIN_DRIVER_API or not has_api:
            raise CudaDriverTooOld(
                f"the NVIDIA driver at {self.path} supports CUDA {self.info.text}; the checkpoint "
                f"API (cuCheckpointProcess*) needs {MIN_DRIVER_TEXT}. Upgrade the driver, or use "
                "hpcckpt's in-process engines (--mode app) on this node")

    def _init(self) -> None:
        rc = self._lib.cuInit(0)
        if rc == _CUDA_ERROR_NO_DEVICE:
            raise CudaDriverMissing(f"cuInit: the driver at {self.path} sees no CUDA device on this machine")
        if rc != _CUDA_SUCCESS:
            raise CudaCheckpointError(f"cuInit failed: {self.error_name(rc)}")

    def error_name(self, code: int) -> str:
        text = ctypes.c_char_p()
        fn = getattr(self._lib, "cuGetErrorName", None)
        if fn is not None and fn(code, ctypes.byref(text)) == _CUDA_SUCCESS and text.value:
            return f"{text.value.decode()} ({code})"
        return f"CUresult {code}"

    def _call(self, what: str, pid: int, *args: object, extra_s: float = 0.0) -> None:
        name = f"cuCheckpointProcess{what}(pid={pid})"
        with _STUCK_LOCK:
            held = CudaCheckpoint._stuck.get(pid)
        if held is not None:
            if held[1] in _NEEDS_TARGET_RUNNING:
                raise CudaCallStuck(f"not calling {name}: {held[0]} has not returned and is still blocked in "
                                    f"the driver (STUCK): PID {pid} may be left LOCKED or CHECKPOINTED; check it "
                                    f"with `hpcckpt cuda state {pid}`", pid=pid, what=held[1])
            raise CudaQueryTimedOut(f"not calling {name}: an earlier {held[0]} has not returned, so PID {pid}'s "
                                    "CUDA state could not be queried (nothing was changed in it)")
        if what in _NEEDS_TARGET_RUNNING:
            refuse_stopped(pid, what)
        fn = getattr(self._lib, f"cuCheckpointProcess{what}")
        deadline = self.call_timeout_s + extra_s if what in _NEEDS_TARGET_RUNNING else \
            min(self.call_timeout_s, QUERY_TIMEOUT_S)
        rc = self._with_deadline(name, what, pid, lambda: fn(ctypes.c_int(pid), *args), deadline)
        if rc != _CUDA_SUCCESS:
            hint = ""
            if rc == _CUDA_ERROR_NOT_FOUND or not maps_library(pid, MAPPED_DRIVER):
                hint = f"; PID {pid} has no CUDA context (is it a CUDA process, and alive?)"
            raise CudaCallFailed(f"cuCheckpointProcess{what}(pid={pid}) failed: {self.error_name(rc)}{hint}",
                                 code=int(rc), name=self.error_name(rc))

    def _with_deadline(self, name: str, what: str, pid: int, call: Callable[[], int], deadline_s: float) -> int:
        """Run one driver call on a helper thread (ctypes drops the GIL); a call that does
        not return in time is left there, recorded as stuck for ``pid``, and reported."""
        result: list[int] = []
        failure: list[BaseException] = []
        done: list[bool] = []
        t0 = time.monotonic()

        def run() -> None:
            try:
                result.append(int(call()))
            except BaseException as exc:  # noqa: BLE001  (re-raised in the caller's thread)
                failure.append(exc)
            with _STUCK_LOCK:
                done.append(True)
                late = CudaCheckpoint._stuck.get(pid, ("",))[0] == name
                if late:  # returned after all: the driver is free again for this PID
                    del CudaCheckpoint._stuck[pid]
            if late:
                self._returned_late(name, what, pid, result, failure, time.monotonic() - t0)

        worker = threading.Thread(target=run, name=f"hpcckpt-{what}-{pid}", daemon=True)
        worker.start()
        _join(worker, deadline_s)
        with _STUCK_LOCK:
            stuck = not done
            if stuck:
                CudaCheckpoint._stuck[pid] = (name, what)
                if not _AT_EXIT:
                    _AT_EXIT.append(True)
                    atexit.register(_leave_if_stuck)
        if stuck and what not in _NEEDS_TARGET_RUNNING:
            raise CudaQueryTimedOut(
                f"could not query PID {pid}'s CUDA state: {name} did not return within {deadline_s:.0f} s "
                f"(nothing was changed in the process; now {describe_tasks(pid)})")
        if stuck:
            raise CudaCallStuck(
                f"{name} did not return within {deadline_s:.0f} s (STUCK): the driver waits for the process's "
                f"own CUDA restore thread. Now {describe_tasks(pid)}. The process may already be LOCKED (its CUDA "
                "calls block) or further, and the call may still complete once the process runs (this is said "
                f"when it does): check with `hpcckpt cuda state {pid}`, bring it back with `hpcckpt cuda restore "
                f"{pid}` and `hpcckpt cuda unlock {pid}`, or cancel the job (its last committed checkpoint is "
                "intact)", pid=pid, what=what)
        if failure:
            raise failure[0]
        return result[0]

    def _returned_late(self, name: str, what: str, pid: int, result: list[int], failure: list[BaseException],
                       after_s: float) -> None:
        """A call reported stuck has returned: say so, with what it left, and record it."""
        left: ProcessState | None = None
        if failure:
            text = f"raised {failure[0]!r}"
        elif result[0] != _CUDA_SUCCESS:
            text = f"failed: {self.error_name(result[0])}"
        else:
            text = "succeeded"
            left = _LEFT_BY.get(what)
        late = LateReturn(pid=pid, what=what, name=name, result=text, left=left, after_s=after_s)
        with _STUCK_LOCK:
            _LATE.append(late)
        print(f"hpcckpt: {late_text(late)}", file=sys.stderr, flush=True)

    def state(self, pid: int) -> ProcessState:
        require_cuda_process(pid)
        out = ctypes.c_int(-1)
        self._call("GetState", pid, ctypes.byref(out))
        try:
            return ProcessState(out.value)
        except ValueError:
            raise CudaCheckpointError(f"PID {pid}: the driver reports an unknown process state {out.value}") from None

    def probe(self, pid: int) -> ProcessState | None:
        """``pid``'s CUDA state, or None when it has no CUDA context (NO_CONTEXT_CODES)."""
        try:
            return self.state(pid)
        except CudaCallFailed as exc:
            if exc.code in NO_CONTEXT_CODES:
                return None
            raise

    @property
    def can_remap(self) -> bool:
        return self.info.api_version >= MIN_REMAP_API

    def gpus(self) -> list[Gpu]:
        """The devices this process sees (CUDA_VISIBLE_DEVICES applies), in CUDA's order."""
        count = ctypes.c_int(0)
        self._check(self._lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
        get_uuid = getattr(self._lib, "cuDeviceGetUuid_v2", None) or self._lib.cuDeviceGetUuid
        out = []
        for i in range(count.value):
            dev, raw = ctypes.c_int(0), (ctypes.c_ubyte * 16)()
            name = ctypes.create_string_buffer(256)
            self._check(self._lib.cuDeviceGet(ctypes.byref(dev), i), "cuDeviceGet")
            self._check(get_uuid(raw, dev), "cuDeviceGetUuid")
            self._check(self._lib.cuDeviceGetName(name, len(name), dev), "cuDeviceGetName")
            out.append(Gpu(index=i, uuid=uuid_text(bytes(raw)), name=name.value.decode(errors="replace")))
        return out

    def _check(self, rc: int, what: str) -> None:
        if rc != _CUDA_SUCCESS:
            raise CudaCallFailed(f"{what} failed: {self.error_name(rc)}", code=int(rc), name=self.error_name(rc))

    def lock(self, pid: int, *, timeout_ms: int = 0) -> None:
        """Block new CUDA work in ``pid`` and wait for submitted work (0: the driver waits
        indefinitely; hpcckpt still gives up after ``call_timeout_s`` + the timeout)."""
        require_cuda_process(pid)
        args = _LockArgs(timeoutMs=timeout_ms)
        self._call("Lock", pid, ctypes.byref(args), extra_s=timeout_ms / 1000)

    def checkpoint(self, pid: int) -> None:
        require_cuda_process(pid)
        self._call("Checkpoint", pid, ctypes.byref(_ReservedArgs()))

    def restore(self, pid: int, pairs: list[tuple[str, str]] | None = None) -> None:
        """Bring ``pid``'s device memory back; ``pairs`` (old UUID, new UUID) remap GPUs
        and must name every GPU the process used (driver >= 580)."""
        require_cuda_process(pid)
        args = _RestoreArgs()
        if pairs:
            if not self.can_remap:
                raise CudaDriverTooOld(f"restoring onto other GPUs needs {MIN_REMAP_TEXT}; the driver at "
                                       f"{self.path} supports CUDA {self.info.text}")
            table = (_GpuPair * len(pairs))()
            for i, (old, new) in enumerate(pairs):
                table[i].oldUuid[:] = list(uuid_bytes(old))
                table[i].newUuid[:] = list(uuid_bytes(new))
            args.gpuPairs = ctypes.cast(table, ctypes.POINTER(_GpuPair))
            args.gpuPairsCount = len(pairs)
        self._call("Restore", pid, ctypes.byref(args))

    def unlock(self, pid: int) -> None:
        require_cuda_process(pid)
        self._call("Unlock", pid, ctypes.byref(_ReservedArgs()))

    def restore_thread_id(self, pid: int) -> int:
        require_cuda_process(pid)
        tid = ctypes.c_int(0)
        self._call("GetRestoreThreadId", pid, ctypes.byref(tid))
        return tid.value

    def toggle(self, pid: int, *, timeout_ms: int = 0) -> ProcessState:
        """RUNNING -> CHECKPOINTED, or CHECKPOINTED -> RUNNING (like cuda-checkpoint --toggle)."""
        st = self.state(pid)
        if st is ProcessState.RUNNING:
            self.lock(pid, timeout_ms=timeout_ms)
            self.checkpoint(pid)
        elif st is ProcessState.LOCKED:
            self.unlock(pid)
        elif st is ProcessState.CHECKPOINTED:
            self.restore(pid)
            self.unlock(pid)
        else:
            raise CudaCheckpointError(f"PID {pid} is in state {st.name}; toggle cannot move it")
        return self.state(pid)


def require_cuda_process(pid: int) -> None:
    """Raise CudaNoContext unless ``pid`` is alive and has the CUDA driver mapped."""
    if not os.path.exists(f"/proc/{pid}"):
        raise CudaNoContext(f"PID {pid} does not exist (check the PID; inside a container or "
                            "PID namespace use the PID as seen from where hpcckpt runs)")
    if not maps_library(pid, MAPPED_DRIVER):
        raise CudaNoContext(f"PID {pid} has not loaded the CUDA driver (libcuda), so it has no CUDA "
                            "context to lock or checkpoint")


# The state a successful call leaves its process in.
_LEFT_BY = {"Lock": ProcessState.LOCKED, "Checkpoint": ProcessState.CHECKPOINTED, "Restore": ProcessState.LOCKED,
            "Unlock": ProcessState.RUNNING}


def late_text(late: LateReturn) -> str:
    """What a late return means, and the commands that bring the process back."""
    said = "reported STUCK" if late.what in _NEEDS_TARGET_RUNNING else "timed out"
    head = f"{late.name}, {said}, returned after {late.after_s:.0f} s and {late.result}"
    if late.left is ProcessState.LOCKED:
        return (f"{head}: PID {late.pid} is now LOCKED (its CUDA calls block): bring it back with "
                f"`hpcckpt cuda unlock {late.pid}`")
    if late.left is ProcessState.CHECKPOINTED:
        return (f"{head}: PID {late.pid} is now CHECKPOINTED (its GPU memory is in host memory, its CUDA calls "
                f"block): bring it back with `hpcckpt cuda restore {late.pid}` and `hpcckpt cuda unlock {late.pid}`")
    return f"{head}; check PID {late.pid} with `hpcckpt cuda state {late.pid}`"


def _join(thread: threading.Thread, timeout_s: float) -> None:
    """Wait for a driver call's thread (a seam: tests decide which call "never returns")."""
    thread.join(timeout_s)
