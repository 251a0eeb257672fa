"""Error paths of the CUDA checkpoint wrapper (no GPU needed).

"No driver" is exercised for real on machines without libcuda. "Driver too old"
and "no device" are injected with a tiny stand-in libcuda compiled here that
implements only what those paths call; it never stands in for a GPU feature.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcckpt.cuda import (
    CudaCheckpoint,
    CudaDriverMissing,
    CudaDriverTooOld,
    CudaNoContext,
    driver,
    require_cuda_process,
)

FAKE_SRC = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
int cuDriverGetVersion(int *v) { *v = VERSION; return 0; }
int cuInit(unsigned flags) { (void)flags; return INIT_RC; }
#ifdef WITH_CHECKPOINT
/* Each PID's state as the checkpoint API's state machine moves it (0 RUNNING, 1 LOCKED,
   2 CHECKPOINTED), so that tests see what our code asked for. */
static int spid[64], sstate[64];
static int *slot(int pid) {
    int i;
    for (i = 0; i < 64; i++) if (spid[i] == pid) return &sstate[i];
    for (i = 0; i < 64; i++) if (spid[i] == 0) { spid[i] = pid; sstate[i] = 0; return &sstate[i]; }
    return &sstate[0];
}
/* FAKE_BLOCK_FD: the call named by FAKE_BLOCK_WHAT (default Checkpoint), for FAKE_BLOCK_PID
   (default any), blocks until a byte can be read from that fd (a driver call waiting for a
   target that never runs, released by the test). */
static int block(const char *what, int pid) {
    const char *fd = getenv("FAKE_BLOCK_FD"), *w = getenv("FAKE_BLOCK_WHAT"), *p = getenv("FAKE_BLOCK_PID");
    char c;
    if (!fd || strcmp(w ? w : "Checkpoint", what) != 0 || (p && atoi(p) != pid)) return 0;
    return read(atoi(fd), &c, 1) != 1;
}
int cuCheckpointProcessGetState(int pid, int *state) {
    if (block("GetState", pid)) return 999;
    *state = *slot(pid); return STATE_RC;
}
int cuCheckpointProcessLock(int pid, void *args) {
    (void)args; if (block("Lock", pid)) return 999;
    if (STATE_RC == 0) *slot(pid) = 1; return STATE_RC;
}
int cuCheckpointProcessCheckpoint(int pid, void *args) {
    (void)args; if (block("Checkpoint", pid)) return 999;
    if (STATE_RC == 0) *slot(pid) = 2; return STATE_RC;
}
/* cuda.h's CUcheckpointRestoreArgs (64 bytes): the pairs are written, one line each
   ("<old uuid hex> <new uuid hex>"), to FAKE_RESTORE_LOG when that is set. */
typedef struct { unsigned char old_uuid[16], new_uuid[16]; } gpu_pair;
typedef struct { gpu_pair *pairs; unsigned int count; char reserved[52 - sizeof(void *)];
                 unsigned long long reserved1; } restore_args;
int cuCheckpointProcessRestore(int pid, void *args) {
    const restore_args *a = args; const char *log = getenv("FAKE_RESTORE_LOG");
    unsigned i, k;
    if (block("Restore", pid)) return 999;
    if (log) {
        FILE *f = fopen(log, "a");
        fprintf(f, "count %u\n", a->count);
        for (i = 0; i < a->count; i++) {
            for (k = 0; k < 16; k++) fprintf(f, "%02x", a->pairs[i].old_uuid[k]);
            fputc(' ', f);
            for (k = 0; k < 16; k++) fprintf(f, "%02x", a->pairs[i].new_uuid[k]);
            fputc('\n', f);
        }
        fclose(f);
    }
    if (STATE_RC == 0) *slot(pid) = 1; return STATE_RC;
}
/* The GPUs this process sees, from FAKE_GPUS: "<uuid hex32>=<name>;..." in CUDA's order (what
   CUDA_VISIBLE_DEVICES and the job's cgroup leave it). */
static int gpu_field(int i, char *uuid_hex, char *name, int len) {
    const char *s = getenv("FAKE_GPUS"); int n = 0;
    while (s && *s) {
        const char *eq = strchr(s, '='), *end = strchr(s, ';');
        if (!eq) return 0;
        if (!end) end = s + strlen(s);
        if (n == i) {
            if (uuid_hex) { memcpy(uuid_hex, s, 32); uuid_hex[32] = 0; }
            if (name) { int m = (int)(end - eq - 1) < len - 1 ? (int)(end - eq - 1) : len - 1;
                        memcpy(name, eq + 1, m); name[m] = 0; }
            return 1;
        }
        n++; s = *end ? end + 1 : end;
    }
    return 0;
}
int cuDeviceGetCount(int *count) { int n = 0; while (gpu_field(n, 0, 0, 0)) n++; *count = n; return 0; }
int cuDeviceGet(int *dev, int ordinal) { *dev = ordinal; return gpu_field(ordinal, 0, 0, 0) ? 0 : 101; }
int cuDeviceGetName(char *name, int len, int dev) { return gpu_field(dev, 0, name, len) ? 0 : 101; }
int cuDeviceGetUuid_v2(unsigned char *uuid, int dev) {
    char hex[33]; int k; unsigned v;
    if (!gpu_field(dev, hex, 0, 0)) return 101;
    for (k = 0; k < 16; k++) { sscanf(hex + 2 * k, "%2x", &v); uuid[k] = (unsigned char)v; }
    return 0;
}
int cuCheckpointProcessUnlock(int pid, void *args) {
    (void)args; if (block("Unlock", pid)) return 999;
    if (STATE_RC == 0) *slot(pid) = 0; return STATE_RC;
}
/* FAKE_BLOCK_AT_EXIT: the library's teardown at exit blocks on that fd, as libcuda's may
   while one of its calls is still blocked. */
__attribute__((destructor)) static void teardown(void) {
    const char *fd = getenv("FAKE_BLOCK_AT_EXIT"); char c;
    if (fd && read(atoi(fd), &c, 1) < 0) return;
}
#endif
"""


def _libcuda_present() -> bool:
    try:
        ctypes.CDLL(driver.LIBCUDA)
        return True
    except OSError:
        return False


def build_fake(tmp_path: Path, *, version: int, init_rc: int = 0, checkpoint: bool = False, state_rc: int = 0,
               name: str | None = None) -> Path:
    """A stand-in libcuda; ``state_rc`` is what its state query and lock return (the one
    seam the CPU-process tests inject at); ``name="libcuda.so.1"`` makes a process that
    loads it look, in /proc/PID/maps, like one that maps the driver."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in libcuda")
    tmp_path.mkdir(parents=True, exist_ok=True)
    src = tmp_path / "fake.c"
    src.write_text(FAKE_SRC)
    lib = tmp_path / (name or f"libcuda-fake-{version}-{init_rc}-{int(checkpoint)}-{state_rc}.so")
    flags = [f"-DVERSION={version}", f"-DINIT_RC={init_rc}", f"-DSTATE_RC={state_rc}"] + \
        (["-DWITH_CHECKPOINT"] if checkpoint else [])
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src), *flags], check=True)
    return lib


def test_argument_structs_match_the_driver_abi() -> None:
    # cuda.h: every cuCheckpoint*Args struct is 64 bytes; a wrong layout would make
    # the driver read garbage in the reserved fields and fail with INVALID_VALUE.
    assert ctypes.sizeof(driver._LockArgs) == 64
    assert ctypes.sizeof(driver._RestoreArgs) == 64
    assert ctypes.sizeof(driver._ReservedArgs) == 64
    assert driver._LockArgs.timeoutMs.offset == 0
    assert driver._RestoreArgs.gpuPairsCount.offset == ctypes.sizeof(ctypes.c_void_p)


@pytest.mark.skipif(_libcuda_present(), reason="this machine has an NVIDIA driver")
def test_no_driver_is_a_clean_error() -> None:
    with pytest.raises(CudaDriverMissing, match="no NVIDIA driver"):
        CudaCheckpoint()


def test_missing_library_path_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "libcuda.so.1"
    with pytest.raises(CudaDriverMissing, match=str(missing)):
        CudaCheckpoint(str(missing))


def test_old_driver_is_refused_with_the_needed_version(tmp_path: Path) -> None:
    lib = build_fake(tmp_path, version=12040)
    with pytest.raises(CudaDriverTooOld, match=r"supports CUDA 12\.4.*needs CUDA 12\.8"):
        CudaCheckpoint(str(lib))


def test_new_version_number_without_the_api_is_refused(tmp_path: Path) -> None:
    lib = build_fake(tmp_path, version=12080, checkpoint=False)
    with pytest.raises(CudaDriverTooOld):
        CudaCheckpoint(str(lib))


def test_driver_without_devices_says_so(tmp_path: Path) -> None:
    lib = build_fake(tmp_path, version=12080, init_rc=100, checkpoint=True)
    with pytest.raises(CudaDriverMissing, match="no CUDA device"):
        CudaCheckpoint(str(lib))


def test_pid_without_cuda_context() -> None:
    proc = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(CudaNoContext, match=f"PID {proc.pid} has not loaded the CUDA driver"):
            require_cuda_process(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def test_pid_that_does_not_exist() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    with pytest.raises(CudaNoContext, match="does not exist"):
        require_cuda_process(proc.pid)


@pytest.mark.skipif(_libcuda_present(), reason="this machine has an NVIDIA driver")
def test_cli_reports_no_driver_as_json_with_exit_4() -> None:
    proc = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "cuda", "state", str(os.getpid()), "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 4, proc.stderr
    err = json.loads(proc.stdout)
    assert err["type"] == "CudaDriverMissing" and "libcuda" in err["error"]


MAPPER = "import ctypes, sys, time\nctypes.CDLL(sys.argv[1])\nprint('ready', flush=True)\ntime.sleep(60)\n"


@contextlib.contextmanager
def _mapper(lib: Path) -> Iterator[int]:
    """A live process that has ``lib`` mapped; yields its PID."""
    with subprocess.Popen([sys.executable, "-c", MAPPER, str(lib)], stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            yield proc.pid
        finally:
            proc.kill()


@pytest.mark.parametrize("state_rc", [3, 1], ids=["NOT_INITIALIZED", "INVALID_VALUE"])
def test_process_mapping_libcuda_without_context_is_not_a_cuda_process(tmp_path: Path, state_rc: int) -> None:
    from hpcckpt.cuda import cuda_pids
    from hpcckpt.cuda.group import driver_mappers

    mapped = build_fake(tmp_path / "m", version=12080, checkpoint=True, name="libcuda.so.1")
    driver_lib = build_fake(tmp_path / "d", version=12080, checkpoint=True, state_rc=state_rc)
    with _mapper(mapped) as pid:
        assert driver_mappers(pid) == [pid]  # it does map "libcuda.so"
        said: list[str] = []
        assert cuda_pids(pid, driver=lambda: CudaCheckpoint(str(driver_lib)), log=said.append) == []
        assert "has no CUDA context" in said[0]


def test_process_with_cuda_state_is_a_cuda_process(tmp_path: Path) -> None:
    from hpcckpt.cuda import cuda_pids

    mapped = build_fake(tmp_path / "m", version=12080, checkpoint=True, name="libcuda.so.1")
    driver_lib = build_fake(tmp_path / "d", version=12080, checkpoint=True, state_rc=0)
    with _mapper(mapped) as pid:
        assert cuda_pids(pid, driver=lambda: CudaCheckpoint(str(driver_lib))) == [pid]


@pytest.mark.skipif(_libcuda_present(), reason="this machine has an NVIDIA driver")
def test_libcuda_mapped_where_there_is_no_driver_is_a_cpu_process(tmp_path: Path) -> None:
    from hpcckpt.cuda import cuda_pids

    with _mapper(build_fake(tmp_path, version=12080, checkpoint=True, name="libcuda.so.1")) as pid:
        assert cuda_pids(pid) == []


def test_lock_saying_no_context_drops_the_process(tmp_path: Path) -> None:
    from hpcckpt.cuda import checkpoint_all

    cu = CudaCheckpoint(str(build_fake(tmp_path / "d", version=12080, checkpoint=True, state_rc=3)))
    with _mapper(build_fake(tmp_path / "m", version=12080, checkpoint=True, name="libcuda.so.1")) as pid:
        assert checkpoint_all(cu, [pid], lock_timeout_ms=1000) == []


def test_gpu_plan_same_gpus_remap_and_refusals() -> None:
    from hpcckpt.cuda.driver import Gpu
    from hpcckpt.cuda.gpumap import plan
    from hpcckpt.errors import CudaCheckpointError

    a, b, c = ("GPU-" + ch * 8 + "-0000-0000-0000-000000000000" for ch in "abc")
    rec = [{"index": 0, "uuid": a, "name": "NVIDIA H100 80GB HBM3"}]
    h100 = "NVIDIA H100 80GB HBM3"
    assert plan([], [], can_remap=False) is None
    assert plan(rec, [Gpu(index=0, uuid=b, name=h100), Gpu(index=1, uuid=a, name=h100)], can_remap=False) is None
    assert plan(rec, [Gpu(index=0, uuid=c, name=h100)], can_remap=True) == [(a, c)]
    with pytest.raises(CudaCheckpointError, match="needs CUDA 13.0"):
        plan(rec, [Gpu(index=0, uuid=c, name=h100)], can_remap=False)
    with pytest.raises(CudaCheckpointError, match="same GPU model"):
        plan(rec, [Gpu(index=0, uuid=c, name="NVIDIA A100-SXM4-80GB")], can_remap=True)
    with pytest.raises(CudaCheckpointError, match="same GPU count"):
        plan(rec, [], can_remap=True)


def test_restore_onto_other_gpus_passes_uuid_pairs_to_the_driver(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """After a requeue the job's cgroup shows another H100 (and CUDA_VISIBLE_DEVICES renumbers):
    the stand-in driver enumerates what is visible, and cuCheckpointProcessRestore receives
    the pairs by UUID, never by index; where the job's GPU is still here under another
    index, nothing is remapped."""
    from hpcckpt.cuda.gpumap import plan

    a, b, c = "a1" * 16, "b2" * 16, "c3" * 16
    text = {h: driver.uuid_text(bytes.fromhex(h)) for h in (a, b, c)}
    h100 = "NVIDIA H100 80GB HBM3"
    log = tmp_path / "restore.log"
    monkeypatch.setenv("FAKE_RESTORE_LOG", str(log))
    lib = build_fake(tmp_path / "d", version=13000, checkpoint=True)
    with _mapper(build_fake(tmp_path / "m", version=13000, checkpoint=True, name="libcuda.so.1")) as pid:
        saved = [{"index": 1, "uuid": text[a], "name": h100}]  # the job's cuda:0 was the node's second GPU
        # the next allocation: one H100, another one, the only one the job sees
        monkeypatch.setenv("FAKE_GPUS", f"{b}={h100}")
        cu = CudaCheckpoint(str(lib))
        visible = cu.gpus()
        assert visible == [driver.Gpu(index=0, uuid=text[b], name=h100)]
        cu.restore(pid, plan(saved, visible, can_remap=cu.can_remap))
        # the same GPU, now shown second after another one
        monkeypatch.setenv("FAKE_GPUS", f"{c}={h100};{a}={h100}")
        cu.restore(pid, plan(saved, cu.gpus(), can_remap=cu.can_remap))
    assert log.read_text().splitlines() == ["count 1", f"{a} {b}", "count 0"]


def test_uuid_round_trip() -> None:
    text = "GPU-0123abcd-4567-89ef-0123-456789abcdef"
    assert driver.uuid_text(driver.uuid_bytes(text)) == text


@pytest.mark.parametrize("kind", ["too-old", "cuInit-fails"])
def test_unusable_driver_with_no_gpu_handles_is_a_cpu_process(tmp_path: Path, kind: str) -> None:
    # A CPU job with a CUDA build of torch on a node whose driver predates the checkpoint
    # API (or whose cuInit fails) must still be dumped: it holds no /dev/nvidia* files.
    from hpcckpt.cuda import cuda_pids

    version, init_rc = (12020, 0) if kind == "too-old" else (12080, 999)
    driver_lib = build_fake(tmp_path / "d", version=version, checkpoint=True, init_rc=init_rc)
    with _mapper(build_fake(tmp_path / "m", version=12080, checkpoint=True, name="libcuda.so.1")) as pid:
        said: list[str] = []
        assert cuda_pids(pid, driver=lambda: CudaCheckpoint(str(driver_lib)), log=said.append) == []
        assert "cannot be used" in said[0] and "CPU processes" in said[0]


def test_unusable_driver_and_gpu_handles_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcckpt.cuda import cuda_pids, group
    from hpcckpt.errors import CudaCheckpointError

    driver_lib = build_fake(tmp_path / "d", version=12020, checkpoint=True)
    # The seam: what /proc says the process holds (no GPU here to open /dev/nvidia0 for real).
    monkeypatch.setattr(group.proctree, "nvidia_handles", lambda _pid: ["/dev/nvidia0", "/dev/nvidiactl"])
    with _mapper(build_fake(tmp_path / "m", version=12080, checkpoint=True, name="libcuda.so.1")) as pid:
        with pytest.raises(CudaCheckpointError, match=r"holds /dev/nvidia0.*uses the GPU.*CUDA 12\.8"):
            cuda_pids(pid, driver=lambda: CudaCheckpoint(str(driver_lib)))


def _wait_state(pid: int, want: str) -> None:
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if set(driver.task_states(pid).values()) == {want}:
            return
        time.sleep(0.01)
    raise AssertionError(f"PID {pid} never reached task state {want}: {driver.task_states(pid)}")


def test_stopped_process_is_refused_before_any_call(tmp_path: Path) -> None:
    import signal

    cu = CudaCheckpoint(str(build_fake(tmp_path / "d", version=12080, checkpoint=True)))
    with _mapper(build_fake(tmp_path / "m", version=12080, checkpoint=True, name="libcuda.so.1")) as pid:
        os.kill(pid, signal.SIGSTOP)
        _wait_state(pid, "T")
        for call in (cu.lock, cu.checkpoint, cu.unlock):
            with pytest.raises(driver.CudaProcessStopped, match=rf"the process is stopped.*kill -CONT {pid}"):
                call(pid)
        os.kill(pid, signal.SIGCONT)
        _wait_state(pid, "S")
        cu.lock(pid)  # running again: the call goes through


class _Block:
    """The stand-in's call ``what`` (for ``pid``) blocks until ``release()``; meanwhile the
    deadline seam (driver._join) gives up on that call at once and waits for every other
    call to return, so which call is "stuck" never depends on timing."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, what: str, pid: int | None) -> None:
        self.r, self.w = os.pipe()
        self.monkeypatch = monkeypatch
        self.prefix: str | None = f"hpcckpt-{what}-{pid if pid is not None else ''}"
        self.stuck: list = []
        monkeypatch.setenv("FAKE_BLOCK_FD", str(self.r))
        monkeypatch.setenv("FAKE_BLOCK_WHAT", what)
        if pid is not None:
            monkeypatch.setenv("FAKE_BLOCK_PID", str(pid))
        monkeypatch.setattr(driver, "_join", self.join)

    def join(self, thread: threading.Thread, _timeout_s: float) -> None:
        if self.prefix is not None and thread.name.startswith(self.prefix):
            self.stuck.append(thread)
            return
        thread.join(60)
        assert not thread.is_alive(), f"{thread.name} did not return"

    def release(self) -> None:
        """The blocked call returns (late); later calls do not block."""
        self.monkeypatch.delenv("FAKE_BLOCK_FD")
        self.prefix = None
        os.write(self.w, b"x" * 8)
        for t in self.stuck:
            t.join(60)
            assert not t.is_alive()

    def close(self) -> None:
        os.write(self.w, b"x" * 8)  # never leave a thread blocked in the stand-in
        for t in self.stuck:
            t.join(60)
        os.close(self.r)
        os.close(self.w)
        driver.CudaCheckpoint._stuck.clear()
        driver.take_late_returns()


@contextlib.contextmanager
def _blocking(monkeypatch: pytest.MonkeyPatch, what: str, pid: int | None = None) -> Iterator[_Block]:
    block = _Block(monkeypatch, what, pid)
    try:
        yield block
    finally:
        block.close()


def test_driver_call_that_never_returns_is_reported_stuck(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    lib = build_fake(tmp_path / "d", version=12080, checkpoint=True)
    cu = CudaCheckpoint(str(lib))
    mapped = build_fake(tmp_path / "m", version=12080, checkpoint=True, name="libcuda.so.1")
    with _mapper(mapped) as pid, _mapper(mapped) as other, _blocking(monkeypatch, "Checkpoint", pid) as block:
        cu.lock(pid)
        with pytest.raises(driver.CudaCallStuck, match=rf"Checkpoint\(pid={pid}\) did not return.*STUCK.*"
                                                      rf"PID {pid}: \d+ task\(s\).*may already be LOCKED"):
            cu.checkpoint(pid)
        # While it is blocked, nothing else goes into the driver for that PID (this instance or another)...
        with pytest.raises(driver.CudaCallStuck, match="not calling .*Unlock.*has not returned.*STUCK"):
            CudaCheckpoint(str(lib)).unlock(pid)
        # ... but other PIDs are not held up: a peer already locked can still be brought back.
        cu.lock(other)
        cu.unlock(other)
        assert cu.state(other) is driver.ProcessState.RUNNING
        assert driver.take_late_returns() == []
        block.release()  # the target "runs again": the call returns, late
        assert driver.CudaCheckpoint._stuck == {}
        late = driver.take_late_returns()
        assert [(x.pid, x.what, x.left) for x in late] == [(pid, "Checkpoint", driver.ProcessState.CHECKPOINTED)]
        err = capsys.readouterr().err
        assert (f"Checkpoint(pid={pid}), reported STUCK, returned after" in err and "now CHECKPOINTED" in err
                and f"`hpcckpt cuda restore {pid}` and `hpcckpt cuda unlock {pid}`" in err), err
        assert cu.state(pid) is driver.ProcessState.CHECKPOINTED
        cu.restore(pid)
        cu.unlock(pid)
        assert cu.state(pid) is driver.ProcessState.RUNNING


def test_a_stuck_lock_never_stops_the_peers_being_given_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    # The real driver wrapper and its guard, the stand-in's lock blocking for one PID only.
    from hpcckpt.criu.failure import is_stuck
    from hpcckpt.cuda import checkpoint_all
    from hpcckpt.errors import CudaCheckpointError

    cu = CudaCheckpoint(str(build_fake(tmp_path / "d", version=12080, checkpoint=True)))
    mapped = build_fake(tmp_path / "m", version=12080, checkpoint=True, name="libcuda.so.1")
    with _mapper(mapped) as first, _mapper(mapped) as second, _blocking(monkeypatch, "Lock", second) as block:
        with pytest.raises(CudaCheckpointError) as info:
            checkpoint_all(cu, [first, second], lock_timeout_ms=1000)
        assert "processes resumed" not in str(info.value) and is_stuck(info.value)
        assert f"Lock(pid={second}) did not return" in str(info.value)
        assert cu.state(first) is driver.ProcessState.RUNNING  # locked, then unlocked by the undo
        with pytest.raises(driver.CudaCallStuck, match=rf"not calling .*GetState\(pid={second}\).*STUCK"):
            cu.state(second)
        block.release()  # the lock completes late: the process is LOCKED, and that is said
        assert "is now LOCKED" in capsys.readouterr().err and cu.state(second) is driver.ProcessState.LOCKED


def test_a_state_query_that_hangs_is_could_not_query_not_stuck(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcckpt.criu.failure import is_stuck
    from hpcckpt.cuda import cuda_pids

    lib = build_fake(tmp_path / "d", version=12080, checkpoint=True)
    with _mapper(build_fake(tmp_path / "m", version=12080, checkpoint=True, name="libcuda.so.1")) as pid, \
            _blocking(monkeypatch, "GetState", pid) as block:
        with pytest.raises(driver.CudaQueryTimedOut, match=rf"could not query PID {pid}'s CUDA state.*within 30 s.*"
                                                          "nothing was changed") as info:
            cuda_pids(pid, driver=lambda: CudaCheckpoint(str(lib)))
        assert not is_stuck(info.value) and "STUCK" not in str(info.value)
        with pytest.raises(driver.CudaQueryTimedOut, match="could not be queried") as info:
            CudaCheckpoint(str(lib)).lock(pid)  # nothing goes in for that PID until the query returns
        assert not is_stuck(info.value)
        block.release()
        assert [x.left for x in driver.take_late_returns()] == [None]
        assert CudaCheckpoint(str(lib)).state(pid) is driver.ProcessState.RUNNING


def test_a_traced_task_gets_time_for_its_tracer_to_let_go(monkeypatch: pytest.MonkeyPatch) -> None:
    # The seam: the task states /proc reports. A task traced (t) by a criu that is going away
    # is waited for; stopped (T) is refused at once; still traced at the deadline is refused.
    answers = iter([{11: "t", 12: "S"}, {11: "t", 12: "S"}, {11: "S", 12: "S"}, {11: "S", 12: "S"}])
    monkeypatch.setattr(driver, "task_states", lambda _pid: next(answers))
    monkeypatch.setattr(driver.time, "sleep", lambda _s: None)
    driver.refuse_stopped(10, "Restore")  # the tracer let go on the second look: the call may go on
    monkeypatch.setattr(driver, "task_states", lambda _pid: {11: "T", 12: "S"})
    waited: list[float | None] = []
    monkeypatch.setattr(driver, "wait_for_tracer", lambda _pid, **k: waited.append(k.get("timeout_s")))
    with pytest.raises(driver.CudaProcessStopped, match="kill -CONT 10"):
        driver.refuse_stopped(10, "Restore")
    assert waited == []  # a stopped task: no waiting
    monkeypatch.setattr(driver, "task_states", lambda _pid: {11: "t"})
    monkeypatch.setattr(driver, "tracer_of", lambda _pid, _tid: 4242)
    with pytest.raises(driver.CudaProcessStopped, match=r"held by a tracer.*tracer PID 4242"):
        driver.refuse_stopped(10, "Unlock")
    assert waited == [None]  # waited (the default TRACER_WAIT_S), then refused


H100, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"


def _uuid(n: int) -> str:
    return f"GPU-{n:08x}-0000-0000-0000-000000000000"


def _rec(index: int, n: int, name: str = H100) -> dict:
    return {"index": index, "uuid": _uuid(n), "name": name}


def test_gpu_plan_keeps_identical_uuids_and_pairs_the_rest_by_index_within_a_model() -> None:
    from hpcckpt.cuda.driver import Gpu
    from hpcckpt.cuda.gpumap import plan
    from hpcckpt.errors import CudaCheckpointError

    # The job used GPUs 1 and 3 (of 4); GPU 3 (UUID 13) is still here, but at index 0.
    rec = [_rec(1, 11), _rec(3, 13)]
    here = [Gpu(index=0, uuid=_uuid(13), name=H100), Gpu(index=1, uuid=_uuid(21), name=H100),
            Gpu(index=2, uuid=_uuid(22), name=H100)]
    assert plan(rec, here, can_remap=True) == [(_uuid(11), _uuid(21)), (_uuid(13), _uuid(13))]
    # Two moved GPUs go, in index order, to the free GPUs of their own model, whatever the order here.
    rec = [_rec(0, 1), _rec(1, 2, A100), _rec(2, 3)]
    here = [Gpu(index=0, uuid=_uuid(30), name=A100), Gpu(index=1, uuid=_uuid(31), name=H100),
            Gpu(index=2, uuid=_uuid(32), name=H100)]
    assert plan(rec, here, can_remap=True) == [(_uuid(1), _uuid(31)), (_uuid(2), _uuid(30)), (_uuid(3), _uuid(32))]
    # A GPU still here is never handed to another: too few free H100s is a clear error.
    rec = [_rec(0, 1), _rec(1, 2)]
    here = [Gpu(index=0, uuid=_uuid(2), name=H100), Gpu(index=1, uuid=_uuid(40), name=A100)]
    with pytest.raises(CudaCheckpointError, match=rf"used 1 {H100} GPU\(s\).*only 0 free.*same GPU count and model"):
        plan(rec, here, can_remap=True)
    # Only the job's GPUs matter: extra GPUs here change nothing.
    assert plan([_rec(0, 5)], [Gpu(index=0, uuid=_uuid(6), name=H100), Gpu(index=1, uuid=_uuid(5), name=H100)],
                can_remap=False) is None


def test_job_gpus_are_the_device_files_its_processes_use() -> None:
    from hpcckpt.cuda.driver import Gpu
    from hpcckpt.cuda.gpumap import job_gpus

    visible = [Gpu(index=i, uuid=_uuid(100 + i), name=H100) for i in range(4)]
    table = {m: {"uuid": _uuid(100 + m).upper(), "name": H100, "bus": f"0000:0{m}:00.0"}
             for m in range(4)}
    minors = {7: ({2}, {0, 1, 2, 3}), 8: (set(), {0, 1, 2, 3})}
    said: list[str] = []
    got = job_gpus([7], visible, log=said.append, minors_of=minors.__getitem__, by_minor=lambda: table)
    assert got == [{"index": 2, "uuid": _uuid(102), "name": H100, "bus": "0000:02:00.0", "seen_as": "mapped"}]
    assert not said
    # Nothing mapped: the open device files; nothing readable in /proc/driver: every visible GPU, said.
    got = job_gpus([8], visible, log=said.append, minors_of=minors.__getitem__, by_minor=lambda: table)
    assert [g["index"] for g in got] == [0, 1, 2, 3] and {g["seen_as"] for g in got} == {"open"}
    got = job_gpus([7], visible, log=said.append, minors_of=minors.__getitem__, by_minor=dict)
    assert {g["seen_as"] for g in got} == {"visible"} and len(got) == 4
    assert "no /proc/driver/nvidia/gpus" in said[0] and "recording all 4 visible GPU(s)" in said[0]


def test_gpus_hidden_by_cuda_visible_devices_are_mapped_by_uuid_not_index() -> None:
    """Slurm's allocation shows the job one GPU as CUDA index 0, whichever physical GPU it is:
    before the requeue minor 2 (UUID 102), after it minor 3 of another node (UUID 203). The
    record names the GPU by UUID and bus; the restore pairs UUIDs, never index 0 with index 0."""
    from hpcckpt.cuda.driver import Gpu
    from hpcckpt.cuda.gpumap import job_gpus, plan

    table = {m: {"uuid": _uuid(100 + m), "name": H100, "bus": f"0000:0{m}:00.0"} for m in range(4)}
    seen_before = [Gpu(index=0, uuid=_uuid(102), name=H100)]  # CUDA_VISIBLE_DEVICES hides 0, 1, 3
    rec = job_gpus([7], seen_before, minors_of=lambda _p: ({2}, {2}), by_minor=lambda: table)
    assert rec == [{"index": 0, "uuid": _uuid(102), "name": H100, "bus": "0000:02:00.0", "seen_as": "mapped"}]
    seen_after = [Gpu(index=0, uuid=_uuid(203), name=H100)]
    assert plan(rec, seen_after, can_remap=True) == [(_uuid(102), _uuid(203))]
    # Back on a node where the same physical GPU is visible (at another index): nothing to remap.
    assert plan(rec, [Gpu(index=0, uuid=_uuid(100), name=H100), Gpu(index=1, uuid=_uuid(102), name=H100)],
                can_remap=True) is None


def test_driver_gpus_parses_the_proc_information_files(tmp_path: Path) -> None:
    from hpcckpt.cuda.gpumap import driver_gpus

    d = tmp_path / "0000:05:00.0"
    d.mkdir()
    (d / "information").write_text(f"Model: \t\t {H100}\nIRQ:   \t\t 45\nGPU UUID: \t {_uuid(9)}\n"
                                   "Video BIOS: \t 96.00.99.00.01\nBus Type: \t PCIe\nDevice Minor: \t 3\n"
                                   "GPU Excluded:\t No\n")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "information").write_text("garbage\n")
    assert driver_gpus(tmp_path) == {3: {"uuid": _uuid(9), "name": H100, "bus": "0000:05:00.0"}}


def _exec_done(pid: int, argv0: bytes, timeout_s: float = 30.0) -> None:
    """Wait until ``pid`` has exec'd ``argv0`` (Popen returns after the fork; until the exec,
    /proc/PID/cmdline is the parent's, or empty)."""
    import time
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] != argv0:
        assert time.monotonic() < deadline, f"PID {pid} never exec'd {argv0!r}"
        time.sleep(0.01)


def test_process_holding_gpu_files_without_libcuda_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An NVML-only process (nvidia-smi, a pynvml monitor) holds /dev/nvidiactl without libcuda.
    # The seam: what /proc says it holds (no GPU here to open /dev/nvidiactl for real).
    from hpcckpt.cuda import cuda_pids, group
    from hpcckpt.errors import CudaCheckpointError

    with subprocess.Popen(["sleep", "30"]) as proc:
        try:
            _exec_done(proc.pid, b"sleep")  # named by its command line: not the forked parent's, not empty
            monkeypatch.setattr(group.proctree, "nvidia_handles",
                                lambda pid: ["/dev/nvidiactl"] if pid == proc.pid else [])

            def no_driver() -> CudaCheckpoint:
                raise AssertionError("the driver is not needed to refuse this")

            with pytest.raises(CudaCheckpointError, match=rf"PID {proc.pid} \(sleep 30\) holds /dev/nvidiactl "
                                                          r"without the CUDA driver.*monitors outside the job"):
                cuda_pids(proc.pid, driver=no_driver)
        finally:
            proc.kill()


def test_unexpected_state_query_error_without_gpu_files_is_a_cpu_process(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # The seam: the driver's answer to the state query (999, not a known "no context" code).
    from hpcckpt.cuda import cuda_pids, group
    from hpcckpt.errors import CudaCheckpointError

    driver_lib = build_fake(tmp_path / "d", version=12080, checkpoint=True, state_rc=999)
    with _mapper(build_fake(tmp_path / "m", version=12080, checkpoint=True, name="libcuda.so.1")) as pid:
        said: list[str] = []
        assert cuda_pids(pid, driver=lambda: CudaCheckpoint(str(driver_lib)), log=said.append) == []
        assert "state query failed" in said[0] and "999" in said[0] and "no CUDA context" in said[0]
        monkeypatch.setattr(group.proctree, "nvidia_handles", lambda p: ["/dev/nvidia0"] if p == pid else [])
        with pytest.raises(CudaCheckpointError, match=rf"cannot tell whether PID {pid} .*has CUDA state.*nvidia0"):
            cuda_pids(pid, driver=lambda: CudaCheckpoint(str(driver_lib)))


def test_gpu_files_without_a_context_say_starting_cuda_or_forked(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcckpt.cuda import cuda_pids, group
    from hpcckpt.errors import CudaCheckpointError

    driver_lib = build_fake(tmp_path / "d", version=12080, checkpoint=True, state_rc=3)
    with _mapper(build_fake(tmp_path / "m", version=12080, checkpoint=True, name="libcuda.so.1")) as pid:
        monkeypatch.setattr(group.proctree, "nvidia_handles", lambda p: ["/dev/nvidiactl"] if p == pid else [])
        with pytest.raises(CudaCheckpointError, match=r"still starting CUDA.*send the signal again.*forked from a "
                                                      r"CUDA process without exec.*'spawn'.*NVML"):
            cuda_pids(pid, driver=lambda: CudaCheckpoint(str(driver_lib)))


def test_cli_with_a_call_stuck_exits_at_once_with_its_status(tmp_path: Path) -> None:
    # The stand-in's lock never returns, and its teardown at exit would wait for it (as
    # libcuda's may): the command still reports STUCK and exits, with its error status.
    lib = build_fake(tmp_path / "d", version=12080, checkpoint=True)
    r, w = os.pipe()
    try:
        with _mapper(build_fake(tmp_path / "m", version=12080, checkpoint=True, name="libcuda.so.1")) as pid:
            env = {**os.environ, "HPCCKPT_LIBCUDA": str(lib), "FAKE_BLOCK_FD": str(r), "FAKE_BLOCK_WHAT": "Lock",
                   "FAKE_BLOCK_AT_EXIT": str(r)}
            proc = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "cuda", "lock", str(pid), "--json",
                                   "--call-timeout-s", "0.2"], capture_output=True, text=True, timeout=120,
                                  env=env, pass_fds=(r,))
    finally:
        os.close(r)
        os.close(w)
    assert proc.returncode == 4, proc.stderr
    err = json.loads(proc.stdout)
    assert err["type"] == "CudaCallStuck" and f"Lock(pid={pid}) did not return" in err["error"]
    assert "still blocked in the driver (skipping the CUDA library's teardown" in proc.stderr
