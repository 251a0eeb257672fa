"""Slurm adapter: the job environment plus verbs (requeue, end time, reservations...).

``detect()`` picks the backend: pyslurm when it imports and matches the running
Slurm, the Slurm command-line tools otherwise, and the local backend (requeue =
exit 75 for the local supervisor) outside Slurm. The choice and its reason are
logged once.
"""

from __future__ import annotations

import logging
import shutil

from hpcckpt.cluster.base import Cause, Cluster, RequeueOutcome, Reservation, node_is_draining
from hpcckpt.cluster.env import JobEnv
from hpcckpt.cluster.local import LocalCluster
from hpcckpt.cluster.scontrol import SlurmCli
from hpcckpt.config import env_value
from hpcckpt.exitcodes import EXIT_REQUEUE

__all__ = ["EXIT_REQUEUE", "Cause", "Cluster", "JobEnv", "LocalCluster", "RequeueOutcome",
           "Reservation", "SlurmCli", "detect", "node_is_draining"]

log = logging.getLogger("hpcckpt.cluster")


def detect(env: JobEnv | None = None) -> Cluster:
    """The backend for this process. ``HPCCKPT_CLUSTER=local|slurm-cli|pyslurm`` forces one."""
    env = env or JobEnv()
    forced = env_value("cluster", "")
    if forced == "local" or (not forced and not env.in_slurm):
        log.info("cluster backend: local (%s)", "forced" if forced else "no SLURM_JOB_ID")
        return LocalCluster(env)
    if forced == "slurm-cli" or shutil.which("scontrol") is None:
        log.info("cluster backend: slurm-cli")
        return SlurmCli(env)
    from hpcckpt.cluster.pyslurm_backend import PySlurmCluster, probe

    module, reason = probe()
    log.info("cluster backend: %s (%s)", "pyslurm" if module else "slurm-cli", reason)
    return PySlurmCluster(module, env) if module is not None else SlurmCli(env)
