"""One rank of a 2-rank gloo job driving the concurrent engine, with a fault on rank 1.

Run by tests/unit/test_two_ranks.py: ``python -m tests.unit.two_rank_worker RANK PORT ROOT``.
Phase 1: Checkpointer saves every 2 steps; rank 1 cannot start the save of step 4
(injected ENOSPC while staging). Phase 2: the ranks name different steps in one save.
Writes ROOT/result-RANK.json with what each save reported on this rank.
"""
from __future__ import annotations

import errno
import json
import sys
from pathlib import Path

import torch.distributed as dist

from hpcckpt.api import Checkpointer
from tests.helpers import tiny_state, train_step


def main() -> None:
    rank, port, root = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
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
        for step in ck.steps(8):
            train_step(objs)
            engine.drain()  # type: ignore[attr-defined]
        for h in list(ck._handles):  # settled at the boundaries: nothing may be left
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
    (root / f"result-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
