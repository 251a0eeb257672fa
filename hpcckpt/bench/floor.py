"""The floor of a save at every step: the least any in-process checkpoint costs on this machine.

``Floor`` is a bench method (``methods.Method``) that does only what every checkpoint of a
CPU state must do: the training thread copies the state's bytes into memory of its own
(one ``copy_`` per tensor, into a shared buffer laid out once), and another *process*
writes that buffer to a file and fdatasyncs it, so no Python thread of the training
process runs beside training. It keeps no manifest, no commit, no retention and cannot be
restored: it is not a checkpoint, only the yardstick the small-state figure of the real
engines is read against (``bench.smallstate``). Like the engines at ``max_async=1``, a
save waits for the previous one to be durable before copying.

On the 2-core CPU VM this floor alone measured +18-19% for the copy and +23-30% with the
write and fdatasync, for a 3 MB state at 6 ms steps (one-off script, six block pairs each):
the memory traffic of the copy and the other process's kernel work land on the same two
cores as training.
"""
from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..errors import HpcckptError
from .methods import Method, _Pending
from .synthetic import PeerRig

ALIGN = 64

# The writer process: one byte in, the whole buffer written and fdatasynced, one byte out.
_WRITER = """
import mmap, os, sys
buf_fd, size, req, done, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
buf = mmap.mmap(buf_fd, size, prot=mmap.PROT_READ)
out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
view = memoryview(buf)
while os.read(req, 1):
    done_bytes = 0
    while done_bytes < size:
        done_bytes += os.pwrite(out, view[done_bytes:], done_bytes)
    os.fdatasync(out)
    os.write(done, b"d")
"""


class Floor(Method):
    name = "floor"

    def __init__(self, root: Path, rig: PeerRig) -> None:
        super().__init__(root, rig)
        if rig.device != "cpu":
            raise HpcckptError(f"bench floor: a CPU state only (this one is on {rig.device})")
        # The tensors a save writes: parameters and optimizer state live (training updates them
        # in place); the RNG states as captured here (a capture copies them: same bytes a save).
        self.sources = list(rig.state.capture(step=0).tensors.values())
        offsets, size = [], 0
        for t in self.sources:
            size = -(-size // ALIGN) * ALIGN
            offsets.append(size)
            size += t.numel() * t.element_size()
        self.size = max(size, 1)
        self.fd = os.memfd_create("hpcckpt-bench-floor")
        os.ftruncate(self.fd, self.size)
        self.buf = mmap.mmap(self.fd, self.size)
        whole = torch.frombuffer(self.buf, dtype=torch.uint8)
        self.views = [whole[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                      for o, t in zip(offsets, self.sources)]
        req_r, self.req = os.pipe()
        self.done, done_w = os.pipe()
        self.path = root / "floor.bin"
        self.proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(self.fd), str(self.size), str(req_r),
                                      str(done_w), str(self.path)], pass_fds=(self.fd, req_r, done_w))
        os.close(req_r)
        os.close(done_w)
        self.inflight = False

    def _wait(self) -> None:
        if self.inflight:
            if not os.read(self.done, 1):
                raise HpcckptError(f"bench floor: its writer process exited ({self.proc.wait()})")
            self.inflight = False

    def start(self, step: int) -> _Pending:
        t0 = time.perf_counter()
        self._wait()  # one save in flight, as an engine at max_async=1
        for view, source in zip(self.views, self.sources):
            view.copy_(source)
        os.write(self.req, b"s")
        self.inflight = True
        return _Pending(t0, self.path, waiter=self._wait)

    def _keep_only(self, path: Path) -> None:
        self.newest = path  # one file, overwritten by every save

    def close(self) -> None:
        try:
            self._wait()
        finally:
            os.close(self.req)  # the writer's read returns b"": it exits
            self.proc.wait(timeout=60)
            os.close(self.done)
            del self.views
            try:
                self.buf.close()
            except BufferError:  # a view still alive somewhere: the collector unmaps it
                pass
            os.close(self.fd)
