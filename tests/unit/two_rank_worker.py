"""One rank of a 2-rank gloo job driving the concurrent engine, with a fault on rank 1.

Run by tests/unit/test_two_ranks.py: ``python -m tests.unit.two_rank_worker RANK PORT ROOT``.
Phase 1: Checkpointer saves every 2 steps; rank 1 cannot start the save of step 4
(injected ENOSPC while staging). Phase 2: the ranks name different steps in one save.
Phase 3: a restart restores step 8 in place on both ranks; then, in a copy whose
step 8 is damaged on rank 1 only, both ranks fall back to step 6 together.
Writes ROOT/result-RANK.json with what each save reported on this rank.

``... RANK PORT ROOT auto``: every_steps="auto" with timings that differ by rank
(injected at the policy's observations: rank 0 sees slow steps, so it wants a save
every step; rank 1 sees costly saves, so it wants one every 10,000 steps); writes
ROOT/auto-RANK.json with the steps this rank saved and its committed step.
"""
from __future__ import annotations

import errno
import json
import shutil
import sys
from pathlib import Path

import h5py
import torch
import torch.distributed as dist

from hpcckpt.api import Checkpointer
from tests.helpers import tiny_state, train_step


def main() -> None:
    rank, port, root = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if sys.argv[4:] == ["auto"]:
        auto_interval(rank, root)
        dist.destroy_process_group()
        return
    result: dict[str, object] = {"errors": {}}
    errors: dict[str, str] = result["errors"]  # type: ignore[assignment]
    objs = tiny_state(rank)
    with Checkpointer(root / "ckpt", engine="concurrent", every_steps=2, keep=10) as ck:
        ck.register(**objs)
        engine = ck.engine
        real_stage = engine._stage  # type: ignore[attr-defined]

        def stage(flat, step, *args, **kwargs):  # type: ignore[no-untyped-def]
            if rank == 1 and step == 4:
                raise OSError(errno.ENOSPC, "No space left on device (injected)", str(args[1]))
            return real_stage(flat, step, *args, **kwargs)

        engine._stage = stage  # type: ignore[attr-defined]
        for _step in ck.steps(8):
            train_step(objs)
            engine.drain()  # type: ignore[attr-defined]
        for h in list(ck._saves.handles):  # settled at the boundaries: nothing may be left
            errors[str(h.step)] = "unsettled"
        result["committed_step"] = ck.committed_step
        # Phase 2: rank 1 names another step than rank 0 in the same collective save.
        flat = ck.state.capture(step=20)
        handle = engine.save(flat, 20 + rank)
        try:
            handle.wait()
        except Exception as exc:  # recorded for the test to check
            errors["mismatch"] = str(exc)
    try:  # after close the groups are gone: a collective must say so, not act alone
        ck.ranks.all(True)
    except Exception as exc:
        result["after_close"] = str(exc)
    result.update(restart(rank, root, objs))
    (root / f"result-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def restart(rank: int, root: Path, trained: dict[str, object]) -> dict[str, object]:
    """Phase 3, as a requeued job would see it (fresh objects, other initial values)."""
    out: dict[str, object] = {}
    want = {k: v.clone() for k, v in trained["model"].state_dict().items()}  # type: ignore[attr-defined]
    objs = tiny_state(rank + 10)
    ptrs = [p.data_ptr() for p in objs["model"].parameters()]
    with Checkpointer(root / "ckpt", engine="concurrent", every_steps=None) as ck:
        out["restored"] = ck.register(**objs)
    out["in_place"] = ptrs == [p.data_ptr() for p in objs["model"].parameters()]
    out["equal"] = all(torch.equal(objs["model"].state_dict()[k], v) for k, v in want.items())
    if rank == 0:
        shutil.copytree(root / "ckpt", root / "damaged")
    dist.barrier()
    if rank == 1:
        path = root / "damaged" / "step-8" / "rank-1.h5"
        with h5py.File(path, "r") as f:
            offset = f["objects/model/0.weight"].id.get_offset()
        with open(path, "r+b") as fh:
            fh.seek(offset)
            b = fh.read(1)
            fh.seek(offset)
            fh.write(bytes([b[0] ^ 0xFF]))
    dist.barrier()
    with Checkpointer(root / "damaged", engine="concurrent", every_steps=None) as ck:
        out["fallback"] = ck.register(**tiny_state(rank + 20))
    return out


def auto_interval(rank: int, root: Path) -> None:
    """Ranks whose own timings choose different intervals must still save at the same steps."""
    objs = tiny_state(rank)
    saved: list[int] = []
    with Checkpointer(root / "ckpt", engine="concurrent", every_steps="auto", keep=100) as ck:
        ck.register(**objs)
        auto = ck.policy.auto
        assert auto is not None
        auto.first_after_steps = 2
        if rank == 0:  # slow steps: any save is cheap, the interval falls to 1
            real_step = auto.observe_step
            auto.observe_step = lambda dt: real_step(1000.0)  # type: ignore[method-assign]
        else:  # costly saves: the interval grows to max_steps
            real_save = auto.observe_save
            auto.observe_save = lambda stall, persist: real_save(1000.0, persist)  # type: ignore[method-assign]
        real_save_call = ck.save

        def save(**kwargs):  # type: ignore[no-untyped-def]
            saved.append(ck.step)
            return real_save_call(**kwargs)

        ck.save = save  # type: ignore[method-assign]
        for _ in ck.steps(8):
            train_step(objs)
            ck.engine.drain()  # type: ignore[attr-defined]  # the next boundary settles the save
        committed = ck.committed_step
    (root / f"auto-{rank}.json").write_text(json.dumps({"saved": saved, "committed_step": committed,
                                                         "interval": auto.report()["interval"]}))


if __name__ == "__main__":
    main()
