"""The getting-started page's Slurm block runs as written, on this worker's local Slurm cluster.

The block starts the cluster (``slurm/localcluster up`` says it is already up), renders the
template, submits the training job, preempts it with a ``high`` job once it trains, waits for
it to finish and reads its history: what a newcomer following the page sees.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.docs.docs_blocks import REPO, blocks

from .conftest import _cluster_env

if TYPE_CHECKING:
    from conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

PAGE = REPO / "docs" / "getting-started.md"


@pytest.mark.long(120)
def test_the_getting_started_slurm_block_preempts_requeues_and_finishes(
        slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    block = next(b for b in blocks(PAGE) if b.name == "getting-started-slurm")
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
        subprocess.run(["scancel", "-n", "hpcckpt-train"], env=env, capture_output=True, check=False)
    assert proc.returncode == 0, f"{block} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "1 interruption(s), 0 lost step(s), finished" in proc.stdout, proc.stdout
    assert "preemption" in proc.stdout, proc.stdout
    assert (tmp_path / "job.png").stat().st_size > 0
