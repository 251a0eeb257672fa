"""torchrun under sbatch: did this run's ranks stop for a requeue?

torchrun does not pass its workers' exit codes on: a worker that stopped with
``EXIT_REQUEUE`` (75) after its final checkpoint makes torchrun exit 1, and a
preemption's TERM makes the agent itself exit 1 after the workers stopped. So the
batch script (template ``torchrun``) asks the ledger instead, once srun has returned::

    python -m hpcckpt.integrations.torchrun should-requeue --dir "$HPCCKPT_DIR" \\
        && exec hpcckpt requeue --dir "$HPCCKPT_DIR"

Exit 0: the newest run (``lifecycle.history.newest_run``) ended with a stop that asked for a
requeue and its final checkpoint committed; 1: it did not (finished, failed, or never
started). The ranks themselves take their rank and world size from torchrun's
environment (``RANK``, ``WORLD_SIZE``) through ``torch.distributed``; only global rank
0 requeues the job and records it; ``hpcckpt requeue`` in the batch script then finds
it done and does nothing more.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..lifecycle.history import newest_run
from ..lifecycle.ledger import Ledger


def should_requeue(ckpt_dir: Path) -> tuple[bool, str]:
    """Whether the newest run stopped for a requeue with its final checkpoint committed, and why."""
    # headless=False: records before the first run's opener are no run of this job's ("never started")
    run = newest_run(Ledger(ckpt_dir).events(), headless=False)
    if not run:
        return False, f"no run recorded in {ckpt_dir}/ledger.jsonl"
    stop = next((e for e in reversed(run) if e.get("event") == "stop"), None)
    if stop is None:
        return False, "the newest run recorded no stop (it failed or was killed before its final checkpoint)"
    if not stop.get("requeue"):
        return False, f"the newest run stopped with reason {stop.get('reason')!r} and no requeue"
    if stop.get("committed_step") != stop.get("step"):
        return False, (f"the newest run stopped at step {stop.get('step')} but its last committed checkpoint "
                       f"is step {stop.get('committed_step')}")
    return True, f"stopped at step {stop.get('step')} ({stop.get('reason')}); final checkpoint committed"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpcckpt.integrations.torchrun", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("verb", choices=["should-requeue"])
    p.add_argument("--dir", type=Path, required=True, help="the checkpoint directory ($HPCCKPT_DIR)")
    args = p.parse_args(argv)
    ok, why = should_requeue(args.dir)
    print(f"hpcckpt: {'requeue' if ok else 'no requeue'}: {why}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
