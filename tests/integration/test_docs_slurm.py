"""The documentation's Slurm blocks run as written, on this worker's local Slurm cluster.

Each block (`<!-- run: NAME-slurm -->`: getting started, own checkpoints, CRIU mode) starts the
cluster (``slurm/localcluster up`` says it is already up), renders its template, submits the
training job, preempts it with a ``high`` job once it trains, waits for it to finish and reads
its history: what a newcomer following the page sees. The training sleeps between its steps
(``--step-sleep-s``), so the blocks wait on Slurm rather than spend the suite's CPU.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.docs.docs_blocks import REPO, Block, blocks, pages

from .conftest import _cluster_env
from .test_criu_local import criu_ok  # noqa: F401  (fixture, asked for by the CRIU block)

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

BLOCKS = {b.name: b for page in pages() for b in blocks(page) if b.mark == "run" and (b.name or "").endswith("-slurm")}
# What each block's output must show, besides its exit status 0: the job came back from one
# preemption and finished (the history's own words), and what that way in adds.
EXPECT = {
    "getting-started-slurm": ["1 interruption(s), 0 lost step(s), finished", "preemption"],
    "own-checkpoints-slurm": ["1 interruption(s)", "finished", "preemption", "resumed at step"],
    "criu-slurm": ["1 interruption(s)", "finished", "preemption"],
}
JOB_NAMES = {"getting-started-slurm": "hpcckpt-train", "own-checkpoints-slurm": "hpcckpt-own",
             "criu-slurm": "hpcckpt-criu"}


def test_every_slurm_block_is_run_here() -> None:
    assert set(BLOCKS) == set(EXPECT), "a *-slurm block needs its expectations in EXPECT (or a block was renamed)"


def _run(block: Block, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    (tmp_path / "slurm").symlink_to(REPO / "slurm")
    # As a newcomer's shell has it: no hpcckpt settings of the suite's, this worker's cluster.
    env = {k: v for k, v in _cluster_env().items()
           if not k.startswith(("SLURM_", "HPCCKPT_")) or k.startswith("HPCCKPT_CLUSTER_")}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1",
               MPLBACKEND="Agg")
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block.text], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=480, check=False)
    if proc.returncode != 0:
        subprocess.run(["scancel", "-n", JOB_NAMES[block.name or ""]], env=env, capture_output=True, check=False)
    return proc


@pytest.mark.long(150)
@pytest.mark.parametrize("name", sorted(EXPECT))
def test_the_slurm_block_preempts_requeues_and_finishes(slurm_cluster: SlurmCluster, tmp_path: Path,
                                                        name: str, request: pytest.FixtureRequest) -> None:
    if name.startswith("criu"):
        request.getfixturevalue("criu_ok")
    block = BLOCKS[name]
    proc = _run(block, tmp_path)
    assert proc.returncode == 0, f"{block} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    for words in EXPECT[name]:
        assert words in proc.stdout, f"{block}: no {words!r} in its output:\n{proc.stdout[-3000:]}"
    if name == "getting-started-slurm":
        assert (tmp_path / "job.png").stat().st_size > 0
