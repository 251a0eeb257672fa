#!/usr/bin/env python3
"""hpcckpt template "submitit": submit a @preemptible training run through submitit.

submitit launches the function under srun with --signal=USR2@<slurm_signal_delay_s>
(step delivery: the task itself gets USR2) and --open-mode=append; Slurm's
JobRequeue=1 default makes the job requeueable. hpcckpt's Checkpointer
installs its own recording handlers for USR2 and TERM while training runs, takes
the final checkpoint at the next step boundary, runs `scontrol requeue` and exits;
on the next allocation submitit calls the same pickled callable again, which
resumes from the checkpoint directory. If USR2 arrives while no Checkpointer is
active (during imports, after training), submitit's own handler applies the
Checkpointable contract: ``checkpoint()`` resubmits the same callable, which is
all hpcckpt needs because its state lives on disk, not in the pickle.

    python submitit_launcher.py --run-dir RUN_DIR [--steps N]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import submitit


class Train(submitit.helpers.Checkpointable):
    """The job: the demo training (replace ``__call__`` with your own @preemptible code)."""

    def __init__(self, run_dir: str, steps: int, step_sleep_s: float = 0.0) -> None:
        self.run_dir = run_dir
        self.steps = steps
        self.step_sleep_s = step_sleep_s

    def __call__(self) -> str:
        from hpcckpt.demo.train import main

        main(["--dir", self.run_dir, "--steps", str(self.steps), "--step-sleep", str(self.step_sleep_s)])
        return str(Path(self.run_dir) / "result.json")

    def checkpoint(self, *args: object, **kwargs: object) -> submitit.helpers.DelayedSubmission:
        # hpcckpt already committed (or will resume from) the checkpoint directory.
        return submitit.helpers.DelayedSubmission(Train(self.run_dir, self.steps, self.step_sleep_s))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="slow the demo down (seconds per step)")
    parser.add_argument("--wait", action="store_true", help="wait for the result")
    args = parser.parse_args()
    executor = submitit.AutoExecutor(folder=Path(args.run_dir) / "submitit")
    executor.update_parameters(
        name="hpcckpt-train",
        timeout_min=240,
        nodes=1,
        tasks_per_node=1,
        cpus_per_task=1,
        slurm_signal_delay_s=180,
        slurm_setup=["export HPCCKPT_SIGNALS=SIGUSR2,SIGTERM"],
    )
    job = executor.submit(Train(str(Path(args.run_dir).resolve()), args.steps, args.step_sleep))
    print(job.job_id)
    if args.wait:
        print(job.result())


if __name__ == "__main__":
    main()
