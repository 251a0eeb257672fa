"""Error paths of the CUDA checkpoint wrapper (no GPU needed).

"No driver" is exercised for real on machines without libcuda. "Driver too old"
and "no device" are injected with a tiny stand-in libcuda compiled here that
implements only what those paths call; it never stands in for a GPU feature.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpcckpt.cuda import CudaCheckpoint, CudaDriverMissing, CudaDriverTooOld, CudaNoContext, require_cuda_process
from hpcckpt.cuda import driver

FAKE_SRC = r"""
int cuDriverGetVersion(int *v) { *v = VERSION; return 0; }
int cuInit(unsigned flags) { (void)flags; return INIT_RC; }
#ifdef WITH_CHECKPOINT
int cuCheckpointProcessLock(int pid, void *args) { (void)pid; (void)args; return 0; }
#endif
"""


def _libcuda_present() -> bool:
    try:
        ctypes.CDLL(driver.LIBCUDA)
        return True
    except OSError:
        return False


def build_fake(tmp_path: Path, *, version: int, init_rc: int = 0, checkpoint: bool = False) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in libcuda")
    src = tmp_path / "fake.c"
    src.write_text(FAKE_SRC)
    lib = tmp_path / f"libcuda-fake-{version}-{init_rc}-{int(checkpoint)}.so"
    flags = [f"-DVERSION={version}", f"-DINIT_RC={init_rc}"] + (["-DWITH_CHECKPOINT"] if checkpoint else [])
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
