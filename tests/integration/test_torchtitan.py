"""hpcckpt as torchtitan's checkpoint manager (issue 58, build item 4): a torchtitan-shaped
4-rank FSDP2 x TP job (tests/integration/torchtitan_train.py: torchtitan's train loop and
checkpoint-manager calls, gloo on CPU) preempted by a signal mid-run and requeued ends
bit-identical to a run never interrupted: parameters, AdamW state, learning rate.

``shaped`` drives ``hpcckpt.integrations.torchtitan.TitanCheckpoints`` with containers shaped
like torchtitan's; ``real`` builds ``HpcckptCheckpointManager`` from its config as
torchtitan's Trainer does, with torchtitan's own ``OptimizersContainer`` and
``LRSchedulersContainer`` (run only where torchtitan imports).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from hpcckpt.store import catalog
from tests.conftest import REPO
from tests.integration.test_fsdp_tp import _free_port, assert_equal_states, dump, result
from tests.prefork import Child

pytestmark = [pytest.mark.slow]

TIMEOUT_S = 240  # a hang guard only
HAVE_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None
TITANS = ["shaped", pytest.param("real", marks=pytest.mark.skipif(
    not HAVE_TORCHTITAN, reason="torchtitan is not installed (pip install torchtitan tyro einops spmd_types)"))]


def run_world(out: Path, *args: str, mesh: str = "2x2", codes: tuple[int, ...] = (0,)) -> list[int]:
    """One world of ``torchtitan_train`` on ``mesh``; every rank must exit with one of ``codes``."""
    dp, tp = (int(x) for x in mesh.split("x"))
    world = dp * tp
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCCKPT_", "SLURM_"))}
    env.update(HPCCKPT_CLUSTER="local", OMP_NUM_THREADS="1")
    out.mkdir(parents=True, exist_ok=True)
    phase = args[args.index("--phase") + 1]
    logs = [out / f"log-{phase}-r{r}.txt" for r in range(world)]
    procs = [Child(["-m", "tests.integration.torchtitan_train", "--rank", str(r), "--world", str(world),
                    "--port", str(port), "--out", str(out), "--mesh", mesh, *args],
                   cwd=REPO, env=env, output=logs[r]) for r in range(world)]
    try:
        deadline = time.monotonic() + TIMEOUT_S
        for p in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(60)
    got = [p.returncode for p in procs]
    assert all(c in codes for c in got), f"{phase}: exit codes {got}:\n" + "\n".join(
        f"--- rank {r}:\n{log.read_text()[-3000:]}" for r, log in enumerate(logs))
    return got


def results(out: Path, phase: str) -> list[dict[str, Any]]:
    return [result(out, phase, r) for r in range(4)]


@pytest.mark.parametrize("titan", TITANS)
def test_a_torchtitan_job_preempted_mid_run_resumes_bit_identical(titan: str, tmp_path: Path) -> None:
    """SIGUSR2 on rank 0 during step 3 of 6 (checkpoints every 2 steps): every rank saves step 3
    and leaves with RequeueExit; the requeued job resumes at step 3 (model, AdamW, LR schedule,
    dataloader position, train_state) and ends at step 6 equal, bit for bit, to a job never
    interrupted."""
    ref = tmp_path / "reference"
    run_world(ref, "--phase", "reference", "--total", "6", "--titan", titan)
    job = tmp_path / "job"
    run_world(job, "--phase", "run", "--total", "6", "--signal-at", "3", "--titan", titan)
    first = results(job, "run")
    assert all(r["loaded"] is False and r["requeue_step"] == 3 and r["step"] == 3 for r in first), first
    assert all(r["exit_code"] == 75 for r in first), first
    m = catalog.find(job / "ckpt", None).manifest
    assert m is not None and m["step"] == 3 and m["world_size"] == 4, m and m["step"]
    # the model's DTensors and the AdamW moments of the container's optimizer, each saved sharded
    sharded = sorted(n for n, s in m["shared"].items() if s["kind"] == "sharded")
    assert len(sharded) == 12 and all(n.startswith(("objects/model/", "objects/optimizer/state/"))
                                      for n in sharded), sharded
    run_world(job, "--phase", "run", "--total", "6", "--titan", titan)
    second = results(job, "run")
    assert all(r["loaded"] is True and r["start_step"] == 3 and r["step"] == 6 and "requeue_step" not in r
               for r in second), second
    assert len(second[0]["losses"]) == 3
    for r in range(4):
        assert_equal_states(dump(job, "run", r), dump(ref, "reference", r),
                            f"torchtitan ({titan}): rank {r} at step 6, preempted at 3, vs uninterrupted")
    m = catalog.find(job / "ckpt", None).manifest
    assert m is not None and m["step"] == 6, m and m["step"]  # the finished run's checkpoint
