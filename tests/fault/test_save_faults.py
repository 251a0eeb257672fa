"""Every failed save is survivable and every record is true.

- mkdir ENOSPC (a real tmpfs out of inodes) when the sync engine makes a save's
  temporary directory: that save fails, training goes on, the previous checkpoint
  stays and is what a resume loads;
- EINTR on the native writer's open() (injected by an LD_PRELOAD shim at that one
  seam): retried, the save commits;
- faults after the rename (LATEST, pruning): the step is committed and recorded as a
  commit with a warning, never as ``save_failed``.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcckpt import Checkpointer
from hpcckpt.store import catalog, commit
from tests.conftest import REPO

pytestmark = [pytest.mark.fault]


def _ledger(root: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (root / "ledger.jsonl").read_text().splitlines()]


@pytest.fixture
def inode_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs with few inodes: once they are used up, mkdir fails with ENOSPC."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "few-inodes"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,nr_inodes=64", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _use_up_inodes(where: Path) -> list[Path]:
    made: list[Path] = []
    while True:
        path = where / f"filler-{len(made)}"
        try:
            path.touch()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
            return made
        made.append(path)


def test_mkdir_enospc_fails_that_sync_save_only(inode_tmpfs: Path) -> None:
    root = inode_tmpfs / "ck"
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fillers: list[Path] = []
    ran: list[int] = []
    with Checkpointer(root, engine="sync", every_steps=1, keep=2) as ck:
        ck.register(model=model, optimizer=opt)
        for step in ck.steps(5):
            ran.append(step)
            if step == 2:  # step-1 and step-2 are committed by now; the next saves cannot mkdir
                fillers = _use_up_inodes(inode_tmpfs)
            opt.zero_grad()
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
    assert ran == list(range(5)), "training stopped over a failed save"
    failed = [r for r in _ledger(root) if r["event"] == "save_failed"]
    assert failed and all("No space left" in str(r["error"]) for r in failed), failed
    committed = [i.step for i in catalog.scan(root) if i.status == "committed"]
    assert committed and max(committed) == 2 and not [r for r in failed if r["step"] in committed]
    for f in fillers:
        f.unlink()
    with Checkpointer(root, engine="sync", every_steps=1000) as ck:
        assert ck.register(model=torch.nn.Linear(4, 4)) == 2


SHIM = r'''
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
static int hits;
static int shim(const char* name, const char* path, int flags, mode_t mode) {
    int (*real)(const char*, int, ...) = (int (*)(const char*, int, ...))dlsym(RTLD_NEXT, name);
    /* the native writer's open of a rank file in a save's temp dir: EINTR twice */
    if ((flags & O_CREAT) && (flags & O_NOFOLLOW) && strstr(path, ".tmp-") && strstr(path, "/rank-") && hits < 2) {
        hits++;
        const char* mark = getenv("EINTR_MARK");
        if (mark) { FILE* f = fopen(mark, "a"); if (f) { fputs("eintr\n", f); fclose(f); } }
        errno = EINTR;
        return -1;
    }
    return real(path, flags, mode);
}
int open(const char* path, int flags, ...) {
    va_list ap; va_start(ap, flags); mode_t m = (flags & O_CREAT) ? va_arg(ap, mode_t) : 0; va_end(ap);
    return shim("open", path, flags, m);
}
int open64(const char* path, int flags, ...) {
    va_list ap; va_start(ap, flags); mode_t m = (flags & O_CREAT) ? va_arg(ap, mode_t) : 0; va_end(ap);
    return shim("open64", path, flags, m);
}
'''

TRAIN = r'''
import sys, torch
from hpcckpt import Checkpointer
model = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with Checkpointer(sys.argv[1], engine="concurrent", every_steps=1) as ck:
    ck.register(model=model, optimizer=opt)
    for _ in ck.steps(2):
        opt.zero_grad(); model(torch.ones(1, 64)).sum().backward(); opt.step()
print("done")
'''


@pytest.mark.native
def test_eintr_on_the_native_writers_open_is_retried(tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler for the LD_PRELOAD shim")
    src, shim = tmp_path / "eintr.c", tmp_path / "eintr.so"
    src.write_text(SHIM)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(shim), str(src), "-ldl"], check=True)
    root, mark = tmp_path / "ck", tmp_path / "eintr-hits"
    env = {**os.environ, "LD_PRELOAD": str(shim), "EINTR_MARK": str(mark)}
    ran = subprocess.run([sys.executable, "-c", TRAIN, str(root)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300, check=False)
    assert ran.returncode == 0 and "done" in ran.stdout, ran.stderr[-3000:]
    assert mark.read_text().count("eintr") == 2, "the shim never interrupted the writer's open"
    events = [r["event"] for r in _ledger(root)]
    assert "save_failed" not in events and events.count("commit") >= 2, events
    assert all(i.status == "committed" for i in catalog.scan(root, full=True))


@pytest.mark.parametrize("fault", ["latest", "prune"])
def test_a_fault_after_the_rename_records_a_commit(tmp_path: Path, fault: str,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    def broken(*_a: object, **_k: object) -> object:
        raise OSError(errno.EIO, "Input/output error (injected)")

    root = tmp_path / "ck"
    model = torch.nn.Linear(4, 4)
    with Checkpointer(root, engine="sync", every_steps=1, keep=1) as ck:
        ck.register(model=model)
        for step in ck.steps(3):
            if step == 1:
                if fault == "latest":
                    monkeypatch.setattr(commit, "replace_hint", broken)  # the LATEST update
                else:
                    monkeypatch.setattr(catalog, "prune", broken)
    records = _ledger(root)
    assert not [r for r in records if r["event"] == "save_failed"], records
    committed = [int(str(r["step"])) for r in records if r["event"] == "commit"]
    on_disk = [i.step for i in catalog.scan(root) if i.status == "committed"]
    assert set(on_disk) <= set(committed) and max(on_disk) == max(committed)
    assert "is committed, but could not" in caplog.text or "is committed, but retention" in caplog.text


# --- a failed final save: tried once more, at the Checkpointer, whichever the engine --------------

def _fail_final_saves(engine: str, monkeypatch: pytest.MonkeyPatch, times: int) -> list[int]:
    """Make the next ``times`` saves fail where the engine makes its file (ENOSPC); the calls made."""
    calls: list[int] = []
    if engine == "concurrent":
        from hpcckpt.engines.concurrent import ConcurrentEngine
        real = ConcurrentEngine._staging_for

        def staging(self: Any, *a: Any, **k: Any) -> Any:
            calls.append(1)
            if len(calls) <= times:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            return real(self, *a, **k)
        monkeypatch.setattr(ConcurrentEngine, "_staging_for", staging)
    else:
        from hpcckpt.engines import sync
        real_write = sync.torchfile.write

        def write(*a: Any, **k: Any) -> Any:
            calls.append(1)
            if len(calls) <= times:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            return real_write(*a, **k)
        monkeypatch.setattr(sync.torchfile, "write", write)
    return calls


def _stopped_run(root: Path, engine: str, monkeypatch: pytest.MonkeyPatch,
                 times: int) -> tuple[int, int, list[int]]:
    """One committed step, then the final save at a SIGUSR2 fails ``times`` times:
    (the committed step, the stop's step, the tries)."""
    from hpcckpt.api import EXIT_REQUEUE, RequeueExit
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: list[int] = []
    good = -1
    with pytest.raises(RequeueExit) as stopped:
        with Checkpointer(root, engine=engine, every_steps=None) as ck:
            ck.register(model=model, optimizer=opt)
            for step in ck.steps(10):
                opt.zero_grad()
                model(torch.ones(1, 4)).sum().backward()
                opt.step()
                if step == 1:
                    ck.save(block=True)  # the last good checkpoint
                    good = ck.step
                    calls = _fail_final_saves(engine, monkeypatch, times)
                if step == 3:
                    os.kill(os.getpid(), signal.SIGUSR2)  # a real signal through the real handler
    assert stopped.value.code == EXIT_REQUEUE and good >= 0 and stopped.value.step > good
    return good, stopped.value.step, calls


@pytest.mark.native
@pytest.mark.parametrize("engine", ["concurrent", "sync"])
def test_a_final_save_that_fails_once_is_tried_again(tmp_path: Path, engine: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ck"
    good, step, calls = _stopped_run(root, engine, monkeypatch, times=1)
    assert len(calls) == 2, calls
    records = _ledger(root)
    failed = [r for r in records if r["event"] == "save_failed"]
    assert [(r["step"], r["final"]) for r in failed] == [(step, True)] and "injected" in str(failed[0]["error"])
    assert [r["step"] for r in records if r["event"] == "commit"] == [good, step]
    stop = [r for r in records if r["event"] == "stop"][-1]
    assert stop["final_saved"] is True and stop["committed_step"] == step and "final_error" not in stop
    with Checkpointer(root, engine=engine, every_steps=1000) as ck:
        assert ck.register(model=torch.nn.Linear(4, 4)) == step


@pytest.mark.native
@pytest.mark.parametrize("engine", ["concurrent", "sync"])
def test_a_final_save_that_fails_twice_exits_with_the_reason_and_the_last_good_step(
        tmp_path: Path, engine: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "ck"
    good, step, calls = _stopped_run(root, engine, monkeypatch, times=10)
    assert len(calls) == 2, f"{len(calls)} tries of the final save: once more, not more (no retry in the engine too)"
    records = _ledger(root)
    assert [r["step"] for r in records if r["event"] == "save_failed"] == [step, step]
    stop = [r for r in records if r["event"] == "stop"][-1]
    assert stop["final_saved"] is False and stop["committed_step"] == good
    assert "injected" in str(stop["final_error"])
    assert f"resumes from the previous committed checkpoint, step {good}" in caplog.text
    assert [i.step for i in catalog.scan(root) if i.status == "committed"] == [good]
    with Checkpointer(root, engine=engine, every_steps=1000) as ck:
        assert ck.register(model=torch.nn.Linear(4, 4)) == good


@pytest.mark.parametrize("engine", ["sync", "concurrent"])
def test_a_commit_that_fails_before_its_rename_costs_no_kept_checkpoint(
        tmp_path: Path, engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With keep >= 2, retention renames the oldest kept checkpoint aside before the commit's
    rename (one fsync of the root covers both, ``publish._prune_first``); a commit that then
    fails (here its manifest cannot be written: ENOSPC, injected at that one call) puts it
    back: the failed save costs no checkpoint, and the next save prunes as usual."""
    from hpcckpt.engines import SaveContext, make_engine
    from hpcckpt.errors import CheckpointFailed
    from hpcckpt.ranks import Ranks
    from hpcckpt.state import TrainState

    root = tmp_path / "ckpt"
    eng = make_engine(engine, SaveContext(root=root, keep=3, job={}, user={}), Ranks())
    state = TrainState()
    state.register("model", torch.nn.Linear(8, 8))
    eng.bind(state)

    def save(step: int) -> BaseException | None:
        try:  # a failed save: raised by the sync engine's save(), by the concurrent one's handle
            assert eng.save(state.capture(step=step), step).wait(timeout=60)
        except CheckpointFailed as exc:
            return exc
        finally:
            if hasattr(eng, "drain"):
                eng.drain()
        return None

    def steps() -> list[int]:
        return [info.step for info in catalog.scan(root)]

    real_new, real_rewrite = commit.write_new_durable, commit.rewrite_durable

    def full(real: Any) -> Any:  # a fresh manifest, or one rewritten in a recycled directory
        def write(path: Path, data: bytes) -> Any:
            if path.name == commit.MANIFEST:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            return real(path, data)
        return write

    try:
        for step in range(1, 6):
            assert save(step) is None
        assert steps() == [3, 4, 5]
        monkeypatch.setattr(commit, "write_new_durable", full(real_new))
        monkeypatch.setattr(commit, "rewrite_durable", full(real_rewrite))
        error = save(6)
        assert isinstance(error, CheckpointFailed) and "No space left" in str(error), error
        assert steps() == [3, 4, 5]  # the one pruned for step 6 is back
        assert not any(p.name.startswith(commit.TRASH_PREFIX) for p in root.iterdir())
        monkeypatch.undo()
        assert save(7) is None
        assert steps() == [4, 5, 7]
    finally:
        eng.close()
