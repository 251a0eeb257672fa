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
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcckpt.store import catalog
from tests.conftest import REPO
from tests.integration.test_fsdp_tp import assert_equal_states, dump, result, run_ranks

pytestmark = [pytest.mark.slow]

TIMEOUT_S = 240  # a hang guard only
HAVE_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None
TITANS = ["shaped", pytest.param("real", marks=pytest.mark.skipif(
    not HAVE_TORCHTITAN, reason="torchtitan is not installed (pip install torchtitan tyro einops spmd_types)"))]


def run_world(out: Path, *args: str, mesh: str = "2x2", codes: tuple[int, ...] = (0,)) -> list[int]:
    """One world of ``torchtitan_train`` on ``mesh``; every rank must exit with one of ``codes``."""
    return run_ranks("tests.integration.torchtitan_train", out, mesh, *args, codes=codes)


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
    if titan == "shaped":
        check_inspect_regions(job / "ckpt", m)
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


def _byte_ranges(shape: list[int], index: list[list[list[int]]], itemsize: int) -> list[list[int]]:
    """The contiguous byte ranges of the row-major tensor that a region covers, by brute force."""
    idx = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    for d, dim in enumerate(index):
        idx = idx.index_select(d, torch.cat([torch.arange(a, b) for a, b in dim]))
    flat = sorted(idx.reshape(-1).tolist())
    out = [[flat[0], flat[0] + 1]]
    for i in flat[1:]:
        if i == out[-1][1]:
            out[-1][1] += 1
        else:
            out.append([i, i + 1])
    return [[a * itemsize, b * itemsize] for a, b in out]


def check_inspect_regions(root: Path, m: dict[str, Any]) -> None:
    """``hpcckpt inspect`` of the 2x2 checkpoint: each DTensor's global shape and each shard's region
    (index ranges per dimension, the tensor's byte ranges it covers) as the manifest records them."""
    out = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "inspect", str(root), "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    view = {s["name"]: s for s in json.loads(out.stdout)["shared"]}
    w0 = view["objects/model/0.weight"]
    assert w0["shape"] == [510, 64] and w0["kind"] == "sharded"
    # FSDP x TP: TP halves of 255 rows, FSDP shards of 128 and 127 rows within each: row ranges, each one byte range
    assert sorted((p["rank"], p["region"]["index"][0][0][0], p["region"]["byte_ranges"]) for p in w0["pieces"]) == [
        (0, 0, 1), (1, 255, 1), (2, 128, 1), (3, 383, 1)], w0["pieces"]
    w2 = view["objects/model/2.weight"]  # row-wise TP: column halves, FSDP row halves: 16 ranges each
    assert w2["shape"] == [32, 510] and {p["region"]["byte_ranges"] for p in w2["pieces"]} == {16}
    for s in view.values():
        if s["kind"] != "sharded":
            continue
        for p in s["pieces"]:
            r = p["region"]
            want = _byte_ranges(s["shape"], r["index"], 4)
            assert r["byte_ranges"] == len(want) and r["first_ranges"] == want[:4] and r["last_range"] == want[-1], (
                s["name"], p["rank"], r, want[:4], want[-1])
            assert sum(b - a for a, b in want) == p["nbytes"]
    text = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "inspect", str(root)], cwd=REPO,
                          capture_output=True, text=True, timeout=120).stdout
    assert "[0:16, 0:255] = 16 byte ranges of 1020 B of the tensor, 0..1020 to 30600..31620" in text, text
