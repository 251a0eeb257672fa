"""FSDP2 x tensor parallelism on a 2x2 mesh (CPU, gloo, 4 local processes): every DTensor
placement the pair produces is saved once, by its owners, and resumed on other meshes;
a ``dcp.save`` checkpoint resumes under hpcckpt; an hpcckpt checkpoint exported to DCP is
read back by DCP's own reader (issue 58).

The ranks are tests/integration/fsdp_tp_train.py (a 128 -> 1022 -> 40 MLP: ``ColwiseParallel``
then ``RowwiseParallel`` on ``tp``, ``fully_shard`` on ``dp``, AdamW; 2 MB of state, so that
the ranks' own small tensors, RNG states, stay under 5% of it). 1022 rows over 2 x 2 ranks
are uneven shards (256 and 255 rows); the first layer's parameters are placed
``(_StridedShard(0), Shard(0))``, the second's weight ``(Shard(0), Shard(1))`` and its bias
``(Shard(0), Replicate())``. The saved state is compared with full tensors gathered by
``DTensor.full_tensor()`` in the ranks that saved it.
"""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcckpt.store import catalog
from hpcckpt.store.shared import state_bytes, written_bytes
from tests.conftest import REPO
from tests.prefork import Child, wait_all

pytestmark = [pytest.mark.slow]

TIMEOUT_S = 240  # a hang guard only: each world finishes in seconds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_world(out: Path, mesh: str, *args: str) -> None:
    """Run one world of ``fsdp_tp_train`` on ``mesh`` (``DPxTP``); every rank must exit 0."""
    run_ranks("tests.integration.fsdp_tp_train", out, mesh, *args)


def run_ranks(module: str, out: Path, mesh: str, *args: str, codes: tuple[int, ...] = (0,)) -> list[int]:
    """Run ``module`` as the DP x TP ranks of one gloo world on ``mesh`` (``DPxTP``), each from the
    prefork server with its log in ``out``; every rank must exit with one of ``codes``."""
    dp, tp = (int(x) for x in mesh.split("x"))
    world = dp * tp
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCCKPT_", "SLURM_"))}
    env.update(HPCCKPT_CLUSTER="local", OMP_NUM_THREADS="1")
    out.mkdir(parents=True, exist_ok=True)
    phase = args[args.index("--phase") + 1]
    logs = [out / f"log-{phase}-{mesh}-r{r}.txt" for r in range(world)]
    procs = [Child(["-m", module, "--rank", str(r), "--world", str(world),
                    "--port", str(port), "--out", str(out), "--mesh", mesh, *args],
                   cwd=REPO, env=env, output=logs[r]) for r in range(world)]
    got = wait_all(procs, TIMEOUT_S, kill_late=True)
    assert all(c in codes for c in got), f"{phase} on {mesh}: exit codes {got}:\n" + "\n".join(
        f"--- rank {r}:\n{log.read_text()[-3000:]}" for r, log in enumerate(logs))
    return got


def dump(out: Path, kind: str, rank: int = 0) -> dict[str, torch.Tensor]:
    return dict(torch.load(out / f"state-{kind}-r{rank}.pt"))


def result(out: Path, phase: str, rank: int = 0) -> dict[str, Any]:
    return dict(json.loads((out / f"result-{phase}-r{rank}.json").read_text()))


def assert_equal_states(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: tensors {sorted(got)} != {sorted(want)}"
    differ = [k for k in want if not (got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]))]
    assert not differ, f"{what}: {len(differ)} of {len(want)} tensors differ: {differ}"


@pytest.fixture(scope="module")
def saved_2x2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp_tp")
    run_world(out, "2x2", "--phase", "save", "--engine", "sync", "--steps", "3")
    return out


def test_fsdp_tp_2x2_saves_each_byte_once_with_the_regions_of_every_placement(saved_2x2: Path) -> None:
    m = catalog.find(saved_2x2 / "ckpt", None).manifest
    assert m is not None and m["step"] == 3 and m["world_size"] == 4, m and (m["step"], m["world_size"])
    shared = m["shared"]
    names = [n for n in shared if n.startswith(("objects/model/", "objects/optimizer/state/"))]
    assert len(names) == 4 + 4 * 2, sorted(shared)  # 4 parameters, their exp_avg and exp_avg_sq
    assert {shared[n]["kind"] for n in names} == {"sharded"}
    # the column-wise layer: 1022 rows, TP halves of 511, FSDP shards of 256 and 255 within each
    w0 = shared["objects/model/0.weight"]
    assert sorted((p["rank"], p["offsets"], p["lengths"]) for p in w0["pieces"]) == [
        (0, [0, 0], [256, 128]), (1, [511, 0], [256, 128]), (2, [256, 0], [255, 128]),
        (3, [767, 0], [255, 128])], w0["pieces"]
    # the row-wise layer's weight: columns split by TP, rows by FSDP
    w2 = shared["objects/model/2.weight"]
    assert sorted((p["rank"], p["offsets"], p["lengths"]) for p in w2["pieces"]) == [
        (0, [0, 0], [20, 511]), (1, [0, 511], [20, 511]), (2, [20, 0], [20, 511]),
        (3, [20, 511], [20, 511])], w2["pieces"]
    # its bias is replicated over TP: written once, by the first replica of each FSDP shard
    b2 = shared["objects/model/2.bias"]
    assert sorted((p["rank"], p["offsets"]) for p in b2["pieces"]) == [(0, [0]), (2, [20])], b2["pieces"]
    written = sum(written_bytes(m).values())
    assert written <= 1.05 * state_bytes(m), (written, state_bytes(m))


@pytest.mark.parametrize("mesh", ["4x1", "1x2"])
def test_fsdp_tp_2x2_checkpoint_resumes_on_another_mesh(saved_2x2: Path, mesh: str,
                                                        tmp_path: Path) -> None:
    import shutil
    shutil.copytree(saved_2x2 / "ckpt", tmp_path / "ckpt")
    run_world(tmp_path, mesh, "--phase", "resume", "--engine", "concurrent", "--steps", "2")
    want = dump(saved_2x2, "saved")
    world = 4 if mesh == "4x1" else 2
    for r in range(world):
        assert result(tmp_path, "resume", r)["step_restored"] == 3
        assert_equal_states(dump(tmp_path, "restored", r), want, f"2x2 -> {mesh}: rank {r} restored vs saved")
    res = result(tmp_path, "resume")
    assert res["committed_step"] == 5 and all(torch.isfinite(torch.tensor(res["losses"]))), res


@pytest.mark.parametrize("app", ["sharded", "full"])
def test_get_state_dict_and_set_state_dict_register_as_they_are(app: str, tmp_path: Path) -> None:
    """DCP users' ``AppState`` (``get_state_dict``/``set_state_dict`` with ``StateDictOptions``)
    registered as one object: saved on 2x2, restored on 4x1 equal to the saved state.
    ``sharded`` (the default options) saves the DTensor shards once; ``full``
    (``full_state_dict``, ``cpu_offload``, ``broadcast_from_rank0``) saves rank 0's whole
    tensors, and ``set_state_dict`` broadcasts them on load."""
    run_world(tmp_path, "2x2", "--phase", "save", "--app", app, "--steps", "3")
    m = catalog.find(tmp_path / "ckpt", None).manifest
    assert m is not None and m["step"] == 3
    sharded = [n for n, s in m["shared"].items() if s["kind"] == "sharded"]
    assert len(sharded) == (12 if app == "sharded" else 0), sorted(m["shared"])
    assert sum(written_bytes(m).values()) <= 1.05 * state_bytes(m)
    run_world(tmp_path, "4x1", "--phase", "resume", "--app", app, "--steps", "1")
    want = dump(tmp_path, "saved")
    for r in range(4):
        assert result(tmp_path, "resume", r)["step_restored"] == 3
        assert_equal_states(dump(tmp_path, "restored", r), want, f"AppState({app}) 2x2 -> 4x1: rank {r}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp_tp_reference")
    run_world(out, "2x2", "--phase", "reference", "--total", "6")
    return out


@pytest.mark.parametrize("engine", ["sync", "concurrent"])
def test_fsdp_tp_preempted_mid_run_is_bit_identical_to_an_uninterrupted_run(reference: Path, engine: str,
                                                                            tmp_path: Path) -> None:
    """A preemption (SIGUSR2 on rank 0 during step 2) stops all four ranks at step 3 with a
    checkpoint; the requeued run resumes it on the same 2x2 mesh and ends at step 6 equal,
    bit for bit, to a run that was never interrupted."""
    run_world(tmp_path, "2x2", "--phase", "run", "--engine", engine, "--total", "6", "--signal-at", "3")
    first = [result(tmp_path, "run", r) for r in range(4)]
    assert all(r["requeue_step"] == 3 and r["committed_step"] == 3 for r in first), first
    m = catalog.find(tmp_path / "ckpt", None).manifest
    assert m is not None and m["step"] == 3 and m["engine"] == engine
    assert sum(written_bytes(m).values()) <= 1.05 * state_bytes(m)
    run_world(tmp_path, "2x2", "--phase", "run", "--engine", engine, "--total", "6")
    for r in range(4):
        res = result(tmp_path, "run", r)
        assert res["restored"] == 3 and res["committed_step"] == 6 and "requeue_step" not in res, res
        assert_equal_states(dump(tmp_path, "run", r), dump(reference, "reference", r),
                            f"{engine}: rank {r} at step 6, preempted at 3, vs uninterrupted")


def test_a_dcp_checkpoint_of_fsdp_tp_resumes_under_hpcckpt_at_its_step(tmp_path: Path) -> None:
    """A run checkpointed with ``dcp.save`` (2x2) is adopted by a Checkpointer on 4x1: the same
    parameters, optimizer state and step; training goes on, hpcckpt's own checkpoint follows,
    and the next run resumes from that one."""
    run_world(tmp_path, "2x2", "--phase", "dcp-save", "--steps", "3")
    run_world(tmp_path, "4x1", "--phase", "dcp-resume", "--steps", "2")
    want = dump(tmp_path, "saved")
    for r in range(4):
        res = result(tmp_path, "dcp-resume", r)
        assert res["restored"] is None and res["adopted"] == 3 and res["step_restored"] == 3, res
        assert_equal_states(dump(tmp_path, "restored", r), want, f"dcp.save 2x2 -> hpcckpt 4x1: rank {r}")
    m = catalog.find(tmp_path / "ckpt", None).manifest
    assert m is not None and m["step"] == 5, m and m["step"]
    # requeued again: hpcckpt's own checkpoint (step 5) wins, the DCP one is not read
    run_world(tmp_path, "4x1", "--phase", "dcp-resume", "--steps", "1")
    res = result(tmp_path, "dcp-resume")
    assert res["restored"] == 5 and res["adopted"] is None and res["step_restored"] == 5, res


def test_an_hpcckpt_checkpoint_exported_to_dcp_reads_back_equal(saved_2x2: Path, tmp_path: Path) -> None:
    """``hpcckpt.interop.dcp.export`` of the 2x2 checkpoint, read by DCP's own reader
    (``dcp_to_torch_save``): every parameter and optimizer tensor equal to the saved state."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from hpcckpt.interop.dcp import export
    got = export(saved_2x2 / "ckpt", tmp_path / "dcp")
    assert got["step"] == 3 and got["objects"] == ["model", "optimizer"], got
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "read.pt")
    sd = torch.load(tmp_path / "read.pt", weights_only=False)
    assert sd["step"] == 3
    flat = {f"param/{k}": v for k, v in sd["model"].items()}
    for idx, st in sd["optimizer"]["state"].items():
        for key, v in st.items():
            flat[f"optim/{idx}/{key}"] = v
    assert_equal_states(flat, dump(saved_2x2, "saved"), "hpcckpt 2x2 -> DCP export")
