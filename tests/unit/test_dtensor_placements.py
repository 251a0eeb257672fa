"""DTensors of every placement on 1-D and 2-D meshes (CPU, gloo, local processes): saved once
by their owners as regions of the global tensor, restored on another mesh, another world
size, or into plain tensors; ``Partial`` refused by name (issue 58).

The ranks run this module (``python -m tests.unit.test_dtensor_placements``): each registers
an object whose state is a set of DTensors built by ``distribute_tensor`` from known global
tensors (``GLOBALS``), placed as ``LAYOUTS[mesh]`` says, saves, and a second world of
another shape restores them into its own placements and compares ``full_tensor()`` with
the global tensors.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcckpt.store import catalog
from hpcckpt.store.shared import global_nbytes
from tests.conftest import REPO
from tests.prefork import Child, wait_all

pytestmark = [pytest.mark.slow]

SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "rows": ((7, 5), torch.float32),  # 7 rows over 4 ranks: 2, 2, 2, 1
    "cols": ((5, 7), torch.float32),
    "last": ((3, 4, 9), torch.float32),
    "hsdp": ((6, 10), torch.float32),
    "fsdp_tp": ((9, 11), torch.float32),
    "tp_fsdp": ((9, 11), torch.float32),
    "few": ((3,), torch.float32),  # 3 elements over 4 ranks: one holds nothing
    "scalar": ((), torch.float32),
    "copy": ((4, 4), torch.float64),
    "half": ((8, 6), torch.bfloat16),
}

# placements by mesh: "2x2" (the save), "2" and "4" (other worlds), "1" (one rank)
LAYOUTS: dict[str, dict[str, tuple[str, ...]]] = {
    "2x2": {"rows": ("S0", "S0"), "cols": ("S1", "S1"), "last": ("S2", "R"), "hsdp": ("R", "S0"),
            "fsdp_tp": ("S0", "S1"), "tp_fsdp": ("S1", "S0"), "few": ("S0", "S0"), "scalar": ("R", "R"),
            "copy": ("R", "R"), "half": ("S1", "S0")},
    "2": {"rows": ("S1",), "cols": ("S0",), "last": ("S1",), "hsdp": ("R",), "fsdp_tp": ("S1",),
          "tp_fsdp": ("S0",), "few": ("S0",), "scalar": ("R",), "copy": ("S1",), "half": ("S0",)},
    "4": {"rows": ("S1",), "cols": ("S1",), "last": ("S0",), "hsdp": ("S1",), "fsdp_tp": ("S0",),
          "tp_fsdp": ("S1",), "few": ("R",), "scalar": ("R",), "copy": ("S0",), "half": ("S1",)},
}


def global_tensor(name: str) -> torch.Tensor:
    shape, dtype = SHAPES[name]
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float64).reshape(shape) * 0.5 + len(name)).to(dtype)


# -- the ranks ---------------------------------------------------------------------

class Holder:
    """A registered object whose state is DTensors (or plain tensors, on one rank)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.t = tensors

    def state_dict(self) -> dict[str, Any]:
        return dict(self.t)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.tensor import DTensor
        for k, v in sd.items():
            cur = self.t[k]
            if v is cur:
                continue
            if isinstance(cur, DTensor):
                cur.to_local().copy_(v.to_local() if isinstance(v, DTensor) else v)
            else:
                cur.copy_(v)


def _placements(codes: tuple[str, ...]) -> list[Any]:
    from torch.distributed.tensor import Partial, Replicate, Shard
    return [Replicate() if c == "R" else Partial() if c == "P" else Shard(int(c[1:])) for c in codes]


def _build(mesh_spec: str, *, zero: bool) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    if mesh_spec == "1":
        return {n: torch.zeros(SHAPES[n][0], dtype=SHAPES[n][1]) for n in SHAPES}
    dims = tuple(int(x) for x in mesh_spec.split("x"))
    mesh = init_device_mesh("cpu", dims)
    out = {}
    for name, codes in LAYOUTS[mesh_spec].items():
        g = global_tensor(name)
        out[name] = distribute_tensor(torch.zeros_like(g) if zero else g, mesh, _placements(codes))
    if zero and mesh_spec == "2":  # a strided local shard (a transposed view): restored block by block
        from torch.distributed.tensor import DTensor
        t = out["cols"]
        rows, width = t.to_local().shape
        local = torch.zeros(width, rows, dtype=t.dtype).t()
        assert not local.is_contiguous()
        out["cols"] = DTensor.from_local(local, mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    return out


def _worker(a: argparse.Namespace) -> dict[str, Any]:
    from hpcckpt.api import Checkpointer
    from hpcckpt.errors import ConfigError
    res: dict[str, Any] = {"rank": a.rank}
    tensors = _build(a.mesh, zero=a.phase == "resume")
    if a.phase == "partial":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Partial
        mesh = init_device_mesh("cpu", (a.world,))
        tensors = {"grad_sum": DTensor.from_local(torch.ones(3, 2), mesh, [Partial()])}
    ck = Checkpointer(a.out / "ckpt", engine=a.engine, keep=5)
    try:
        res["restored"] = ck.register(holder=Holder(tensors))
        if a.phase == "resume":
            from torch.distributed.tensor import DTensor
            got = {n: (t.full_tensor() if isinstance(t, DTensor) else t) for n, t in tensors.items()}
            res["differ"] = [n for n in SHAPES if not (got[n].dtype == SHAPES[n][1]
                                                       and torch.equal(got[n], global_tensor(n)))]
        else:
            for _ in ck.steps(1):
                pass
            try:
                ck.save(final=True).wait()
            except ConfigError as exc:
                res["refused"] = str(exc)
    finally:
        ck.close()
    return res


def main() -> None:
    import torch.distributed as dist
    p = argparse.ArgumentParser()
    for opt in ("--rank", "--world", "--port"):
        p.add_argument(opt, type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--mesh", required=True)
    p.add_argument("--phase", choices=("save", "resume", "partial"), required=True)
    p.add_argument("--engine", default="sync")
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.world)
    code = 0
    try:
        res = _worker(a)
        (a.out / f"result-{a.phase}-{a.mesh}-r{a.rank}.json").write_text(json.dumps(res))
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if a.world > 1 and code == 0:
        dist.barrier()
        dist.destroy_process_group()
    os._exit(code)


# -- the tests ---------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_world(out: Path, mesh: str, phase: str, engine: str = "sync") -> list[dict[str, Any]]:
    world = 1
    for d in mesh.split("x"):
        world *= int(d)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCCKPT_", "SLURM_"))}
    env.update(HPCCKPT_CLUSTER="local", OMP_NUM_THREADS="1")
    out.mkdir(parents=True, exist_ok=True)
    logs = [out / f"log-{phase}-{mesh}-r{r}.txt" for r in range(world)]
    procs = [Child(["-m", "tests.unit.test_dtensor_placements", "--rank", str(r), "--world", str(world),
                    "--port", str(port), "--out", str(out), "--mesh", mesh, "--phase", phase, "--engine", engine],
                   cwd=REPO, env=env, output=logs[r]) for r in range(world)]
    codes = wait_all(procs, 240, kill_late=True)  # a hang guard only
    assert codes == [0] * world, f"{phase} on {mesh}: exit codes {codes}:\n" + "\n".join(
        f"--- rank {r}:\n{log.read_text()[-3000:]}" for r, log in enumerate(logs))
    return [json.loads((out / f"result-{phase}-{mesh}-r{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dtensor_placements")
    run_world(out, "2x2", "save", engine="concurrent")
    return out


def test_every_placement_on_a_2x2_mesh_is_written_once_by_its_owners(saved: Path) -> None:
    m = catalog.find(saved / "ckpt", None).manifest
    assert m is not None and m["world_size"] == 4
    shared = {n.rsplit("/", 1)[1]: s for n, s in m["shared"].items() if n.startswith("objects/holder/")}
    assert sorted(shared) == sorted(SHAPES), sorted(shared)
    for name, spec in shared.items():
        got = sum(int(p["nbytes"]) for p in spec["pieces"])
        assert got == global_nbytes(spec), f"{name}: pieces hold {got} bytes of {global_nbytes(spec)}"
    regions = {n: sorted((p["rank"], p["offsets"], p["lengths"]) for p in s["pieces"]) for n, s in shared.items()}
    assert regions["copy"] == [(0, [0, 0], [4, 4])]  # replicated on both mesh dimensions: rank 0 alone
    assert regions["scalar"] == [(0, [], [])]
    assert regions["hsdp"] == [(0, [0, 0], [3, 10]), (1, [3, 0], [3, 10])]  # the first replica of each shard
    assert regions["last"] == [(0, [0, 0, 0], [3, 4, 5]), (2, [0, 0, 5], [3, 4, 4])]  # Shard(2), uneven
    assert regions["rows"] == [(0, [0, 0], [2, 5]), (1, [2, 0], [2, 5]), (2, [4, 0], [2, 5]),
                               (3, [6, 0], [1, 5])]  # Shard(0) twice: uneven
    assert regions["few"] == [(0, [0], [1]), (1, [1], [1]), (2, [2], [1])]  # rank 3's shard is empty
    assert regions["fsdp_tp"] == [(0, [0, 0], [5, 6]), (1, [0, 6], [5, 5]), (2, [5, 0], [4, 6]),
                                  (3, [5, 6], [4, 5])]
    assert regions["tp_fsdp"] == [(0, [0, 0], [5, 6]), (1, [5, 0], [4, 6]), (2, [0, 6], [5, 5]),
                                  (3, [5, 6], [4, 5])]


@pytest.mark.parametrize("mesh", ["2", "4", "1"])
def test_a_2x2_checkpoint_restores_on_another_mesh_and_into_plain_tensors(saved: Path, mesh: str,
                                                                           tmp_path: Path) -> None:
    import shutil
    shutil.copytree(saved / "ckpt", tmp_path / "ckpt")
    for res in run_world(tmp_path, mesh, "resume"):
        assert res["restored"] == 1 and res["differ"] == [], res


def test_a_partial_dtensor_is_refused_by_name(tmp_path: Path) -> None:
    results = run_world(tmp_path, "2", "partial")
    for res in results:
        why = res.get("refused") or ""
        assert "'objects/holder/grad_sum'" in why and "Partial" in why and "sum" in why, res
    assert not [i.step for i in catalog.scan(tmp_path / "ckpt") if i.status == "committed"]


if __name__ == "__main__":
    main()
