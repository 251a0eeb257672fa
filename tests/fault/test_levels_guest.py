"""Multi-level checkpoints on a shared node (issue 51, items 1 and 2), with real users and real
file systems.

- **Another user's root.** A second local user (made here with useradd) creates the victim's
  default node-local root ``/dev/shm/hpcckpt-<uid>/<key>/`` first (0777), puts her own step in
  it and plants the pointer's temporary name (``.hpcckpt-level.json.<pid>``) as links to a
  file of the victim's, for every pid the victim's process can have (a PID namespace: pids
  from 1). The victim's run never resumes from her step and never writes through a link: it
  refuses the root, naming it and the fix; with ``HPCCKPT_LOCAL_DIR`` it trains afresh.
  Everything runs in mount and PID namespaces of its own with a tmpfs on /dev/shm, so nothing
  of the machine's /dev/shm is touched.
- **A node-local root full (a 64 KiB tmpfs) or made read-only mid-run**: the shared level
  keeps its periodic checkpoints (every 4 steps) and the final one of the stop, with one
  warning; the stopped run resumes from the newest, bit-identical.

Needs root (useradd, runuser, unshare, mount); skipped otherwise.
"""
from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from hpcckpt.api import EXIT_REQUEUE, Checkpointer, RequeueExit
from hpcckpt.levels import POINTER
from hpcckpt.lifecycle.ledger import Ledger
from hpcckpt.store import catalog
from hpcckpt.store.scavenge import level_key
from tests.conftest import REPO
from tests.localusers import local_user

pytestmark = [pytest.mark.native, pytest.mark.fault]

USER = "hpcktest-mallory"
PIDS = 500  # links planted for pids 1..PIDS: every pid the victim can have in its namespace
SECRET = b"the victim's own file\n"


def _namespaces() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "--mount", "--pid", "--fork", "--mount-proc", "--propagation", "private", "--",
         "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"], capture_output=True, check=False).returncode == 0


@pytest.fixture(scope="module")
def mallory() -> Iterator[str]:
    if os.geteuid() != 0:
        pytest.skip("a second local user and namespaces need root")
    if shutil.which("useradd") is None or shutil.which("runuser") is None or not _namespaces():
        pytest.skip("needs useradd, runuser and mount/PID namespaces (unshare)")
    with local_user(USER) as user:
        yield user.name


VICTIM = """
import json, os, sys
from hpcckpt.api import Checkpointer
from hpcckpt.errors import ConfigError
from tests.helpers import tiny_state, train_step
objs, out = tiny_state(0), {"pid": os.getpid()}
try:
    with Checkpointer(sys.argv[1], every_steps=3, local_every_steps=1) as ck:
        out["restored"] = ck.register(**objs)
        for _ in ck.steps(12):
            train_step(objs)
    out["done"] = True
except ConfigError as exc:
    out["config_error"] = str(exc)
print(json.dumps(out))
"""


def test_another_users_node_local_root_is_never_trusted_nor_written_through(
        mallory: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.helpers import tiny_state, train_step
    work = Path(tempfile.mkdtemp(prefix="hpcckpt-guest-", dir="/tmp"))  # pytest's tmp is root's alone
    try:
        work.chmod(0o755)
        # Her step: a real node-local step of the same model (other values), step 9, readable to her.
        monkeypatch.setenv("HPCCKPT_CLUSTER", "local")
        objs = tiny_state(1)
        with Checkpointer(work / "hers", every_steps=3, local_every_steps=1, local_dir=str(work / "her-local")) as ck:
            ck.register(**objs)
            for _ in ck.steps(9):
                train_step(objs)
        (hers,) = [p for p in (work / "her-local").iterdir() if (p / "step-9").is_dir()]
        subprocess.run(["chmod", "-R", "a+rX", str(work / "her-local")], check=True)
        # The victim's own files, one per name the pointer's temporary file could have (0600);
        # she links each name in her root to the victim's file of that name, in one ln (the
        # victim's pid, in a namespace where pids start at 1, stays well below PIDS).
        mine = work / "victim-files"
        mine.mkdir(mode=0o755)
        for pid in range(1, PIDS + 1):
            (mine / f"{POINTER}.{pid}").write_bytes(SECRET)
            (mine / f"{POINTER}.{pid}").chmod(0o600)
        ckpt = work / "ckpt"
        root = f"/dev/shm/hpcckpt-{os.geteuid()}/{level_key(ckpt)}"
        plant = (f"set -e; d={shlex.quote(root)}; mkdir -p \"$d\"; chmod 0777 \"$(dirname \"$d\")\" \"$d\"; "
                 f"cp -r {shlex.quote(str(hers / 'step-9'))} \"$d/step-9\"; "
                 f"ln -s {shlex.quote(str(mine))}/{POINTER}.* \"$d/\"")

        def untouched() -> bool:
            files = sorted(mine.iterdir())
            return len(files) == PIDS and all(f.read_bytes() == SECRET for f in files)

        python = shlex.quote(sys.executable)
        victim = f"{python} -c {shlex.quote(VICTIM)} {shlex.quote(str(ckpt))}"
        script = "\n".join([
            "set -e",
            "mount -t tmpfs -o mode=1777,size=64m tmpfs /dev/shm",
            f"runuser -u {mallory} -- sh -c {shlex.quote(plant)}",
            f"{victim} > {work}/first.json",
            f"ls -la {shlex.quote(root)} | head -5 > {work}/listing.txt",
            f"(ls {shlex.quote(str(ckpt))} 2>/dev/null || true) > {work}/first-ckpt.txt",
            f"HPCCKPT_LOCAL_DIR=/dev/shm/victim-own {victim} > {work}/second.json",
        ])
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCCKPT_", "SLURM_"))}
        env.update(HPCCKPT_CLUSTER="local", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        proc = subprocess.run(["unshare", "--mount", "--pid", "--fork", "--mount-proc", "--propagation", "private",
                               "--", "sh", "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        first = json.loads((work / "first.json").read_text())
        listing = (work / "listing.txt").read_text()
        assert f"{mallory} {mallory}" in listing, listing  # her root, as she made it
        assert untouched(), "a planted link was written through"
        assert 1 <= first.pop("pid") <= PIDS  # a pid she planted a link for
        assert "restored" not in first, first  # never resumed from her step 9
        assert root.rsplit("/", 1)[0] in first["config_error"] and "HPCCKPT_LOCAL_DIR" in first["config_error"], first
        assert "step-" not in (work / "first-ckpt.txt").read_text()  # nothing was trained on her state
        second = json.loads((work / "second.json").read_text())
        assert second.pop("pid") <= PIDS and second == {"restored": None, "done": True}, second  # a root of the victim's own: afresh
        assert untouched()
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --- a full or read-only node-local root: the shared level takes over ---

def model_and_opt(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))  # ~400 KB with Adam
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(8, 64)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"param/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        out.update({f"optim/{i}/{k}": torch.as_tensor(v).clone() for k, v in s.items()})
    return out


@pytest.mark.parametrize("engine", ["sync", "concurrent"])
@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_a_failing_node_local_level_keeps_the_shared_levels_checkpoints(
        small_tmpfs: Callable[[str], Path], tmp_path: Path, engine: str, fault: str,
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Node-local every step, shared every 4, keep 20. ``full``: the node-local root is a 64 KiB
    tmpfs, smaller than one checkpoint. ``read-only``: its tmpfs is remounted read-only after
    step 5 was committed there. SIGTERM during step 9: the stop at step 10 takes the final
    checkpoint. The shared level holds 4, 8 and the final 10; one warning says the node-local
    level was given up; at most the save that found it out failed; the next run resumes step 10
    bit-identical to the stopped run's state."""
    local = small_tmpfs("64k" if fault == "full" else "16m")
    ckpt = tmp_path / "ckpt"
    monkeypatch.setenv("HPCCKPT_CLUSTER", "local")
    caplog.set_level(logging.INFO, logger="hpcckpt")
    options = {"engine": engine, "every_steps": 4, "local_every_steps": 1, "local_dir": str(local), "keep": 20}
    model, opt = model_and_opt(0)
    ck = Checkpointer(ckpt, **options)  # type: ignore[arg-type]
    with pytest.raises(RequeueExit) as stop:
        with ck:
            ck.register(model=model, optimizer=opt)
            for step in ck.steps(30):
                train(model, opt)
                if step == 5 and fault == "read-only":  # step 5 is committed node-local: now it turns read-only
                    if engine == "concurrent":
                        ck.engine.drain()  # type: ignore[attr-defined]
                    subprocess.run(["mount", "-o", "remount,ro", str(local)], check=True)
                if step == 9:
                    os.kill(os.getpid(), signal.SIGTERM)
    saved = state_of(model, opt)
    assert stop.value.code == EXIT_REQUEUE and stop.value.step == 10
    assert ck.committed_step == 10
    shared = sorted(i.step for i in catalog.committed_newest_first(ckpt))
    assert {4, 8, 10} <= set(shared) and shared[-1] == 10, shared
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    gave_up = [m for m in messages if "straight to the shared level" in m]
    assert len(gave_up) == 1, gave_up
    events = Ledger(ckpt).read()
    failed = [e["step"] for e in events if e["event"] == "save_failed"]
    assert len(failed) <= 1 and not [e for e in events if e["event"] == "save_failed" and e.get("final")], failed
    if fault == "read-only":
        assert [i.step for i in catalog.committed_newest_first(Path(ck.levels.local))][:1] == [5]  # type: ignore[union-attr]

    model2, opt2 = model_and_opt(1)  # other initial values: only the restore can make them equal
    with Checkpointer(ckpt, **options) as ck2:  # type: ignore[arg-type]
        assert ck2.register(model=model2, optimizer=opt2) == 10
        assert ck2.restored_level == "shared"
        got = state_of(model2, opt2)
    assert sorted(got) == sorted(saved)
    differ = [k for k in saved if not torch.equal(got[k], saved[k])]
    assert not differ, differ
