"""The CUDA checkpoint round trip on a real GPU (``pytest -m gpu``).

A child process fills a CUDA tensor and reports its checksum; this process moves
it RUNNING -> LOCKED -> CHECKPOINTED (device memory released) -> LOCKED -> RUNNING
through ``hpcckpt cuda`` and the child recomputes the checksum on the GPU.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

CHILD = r"""
import sys, torch
x = torch.arange(1 << 24, device="cuda", dtype=torch.float32).mul_(0.5)
torch.cuda.synchronize()
print(float(x.double().sum().item()), flush=True)
for line in sys.stdin:
    print(float(x.double().sum().item()), flush=True)
"""


def hpcckpt_cuda(action: str, pid: int) -> dict:
    proc = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "cuda", action, str(pid), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def test_lock_checkpoint_restore_unlock_keeps_device_memory() -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        before = child.stdout.readline().strip()
        assert hpcckpt_cuda("state", child.pid)["state"] == "running"
        assert hpcckpt_cuda("lock", child.pid)["state"] == "locked"
        assert hpcckpt_cuda("checkpoint", child.pid)["state"] == "checkpointed"
        assert hpcckpt_cuda("restore", child.pid)["state"] == "locked"
        assert hpcckpt_cuda("unlock", child.pid)["state"] == "running"
        child.stdin.write("again\n")
        child.stdin.flush()
        after = child.stdout.readline().strip()
        assert after == before
        assert hpcckpt_cuda("toggle", child.pid)["state"] == "checkpointed"
        assert hpcckpt_cuda("toggle", child.pid)["state"] == "running"
        child.stdin.write("again\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == before
    finally:
        child.kill()
        child.wait()
        for pipe in (child.stdin, child.stdout):
            if pipe is not None:
                pipe.close()
