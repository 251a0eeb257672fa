"""The job's environment: a table from logical names to ``SLURM_*`` variables.

The table extends submitit's (``submitit.slurm.slurm.SlurmJobEnvironment._env``)
so that a job launched by submitit and one launched by a plain sbatch script read
the same variables the same way. Values are read on every access, never cached:
a requeued job is a new process with a new environment, but tests and the local
supervisor change ``os.environ`` in place.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from submitit.slurm.slurm import SlurmJobEnvironment, _parse_node_list

from hpcckpt.errors import ConfigError

# Logical name -> variable, submitit's names first. Where Slurm sets several
# spellings (srun steps vs the batch shell) the first present one wins.
SLURM_VARS: dict[str, tuple[str, ...]] = {
    **{name: (var,) for name, var in SlurmJobEnvironment._env.items()},
    "job_id": ("SLURM_JOB_ID", "SLURM_JOBID"),
    "nodes": ("SLURM_JOB_NODELIST", "SLURM_NODELIST"),
    "num_tasks": ("SLURM_NTASKS", "SLURM_NPROCS"),
    "restart_count": ("SLURM_RESTART_COUNT",),
    "node_name": ("SLURMD_NODENAME",),
    "job_name": ("SLURM_JOB_NAME",),
    "partition": ("SLURM_JOB_PARTITION",),
    "submit_dir": ("SLURM_SUBMIT_DIR",),
    "submit_host": ("SLURM_SUBMIT_HOST",),
    "end_time": ("SLURM_JOB_END_TIME",),
    "step_id": ("SLURM_STEP_ID", "SLURM_STEPID"),
    "cluster_name": ("SLURM_CLUSTER_NAME",),
    "tasks_per_node": ("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"),
}

STAGING_ROOT_DEFAULT = Path("/tmp/hpcckpt-staging")
STAGING_ROOT_FILE = "hpcckpt-staging-root"


@dataclass(frozen=True, kw_only=True)
class JobEnv:
    """Typed view of one process's Slurm variables (``environ`` defaults to ``os.environ``)."""

    environ: Mapping[str, str] = field(default_factory=lambda: os.environ)

    def raw(self, name: str) -> str | None:
        """The value of logical variable ``name``, or None when Slurm did not set it."""
        for var in SLURM_VARS[name]:
            value = self.environ.get(var)
            if value not in (None, ""):
                return value
        return None

    def _int(self, name: str, default: int | None) -> int | None:
        value = self.raw(name)
        if value is None:
            return default
        try:
            return int(value)
        except ValueError as err:
            raise ConfigError(
                f"{SLURM_VARS[name][0]}={value!r} is not an integer; "
                "unset it or run under Slurm"
            ) from err

    @property
    def in_slurm(self) -> bool:
        return self.raw("job_id") is not None

    @property
    def in_step(self) -> bool:
        """True inside an srun step (rank variables are meaningful), False in the batch shell."""
        return self.raw("step_id") is not None and self.environ.get("SLURM_PROCID") is not None

    @property
    def job_id(self) -> str | None:
        """The id to act on: ``<array_job_id>_<task>`` for array tasks, else SLURM_JOB_ID."""
        array_job, task = self.array_job_id, self.array_task_id
        if array_job is not None and task is not None:
            return f"{array_job}_{task}"
        return self.raw("job_id")

    @property
    def raw_job_id(self) -> str | None:
        return self.raw("job_id")

    @property
    def array_job_id(self) -> str | None:
        return self.raw("array_job_id")

    @property
    def array_task_id(self) -> str | None:
        return self.raw("array_task_id")

    @property
    def restart_count(self) -> int:
        return self._int("restart_count", 0) or 0

    @property
    def global_rank(self) -> int:
        return self._int("global_rank", 0) or 0

    @property
    def local_rank(self) -> int:
        return self._int("local_rank", 0) or 0

    @property
    def world_size(self) -> int:
        return self._int("num_tasks", 1) or 1

    @property
    def num_nodes(self) -> int:
        return self._int("num_nodes", 1) or 1

    @property
    def node_index(self) -> int:
        return self._int("node", 0) or 0

    @property
    def node_list(self) -> str | None:
        return self.raw("nodes")

    @property
    def hostnames(self) -> list[str]:
        """The job's nodes, expanded (``n[1-2]`` -> ``["n1", "n2"]``)."""
        nodes = self.node_list
        return _parse_node_list(nodes) if nodes else []

    @property
    def node_name(self) -> str | None:
        return self.raw("node_name")

    @property
    def job_name(self) -> str | None:
        return self.raw("job_name")

    @property
    def partition(self) -> str | None:
        return self.raw("partition")

    @property
    def submit_dir(self) -> Path | None:
        value = self.raw("submit_dir")
        return Path(value) if value else None

    @property
    def end_time(self) -> float | None:
        """End time from the environment (Slurm >= 23.02 sets it); None when absent.

        Only a start-time snapshot: preemption or ``scontrol update`` can move the real
        end time, which is why ``Cluster.end_time()`` asks Slurm instead.
        """
        value = self._int("end_time", None)
        return float(value) if value else None

    @property
    def is_coordinator(self) -> bool:
        return self.global_rank == 0

    def staging_dir(self) -> Path | None:
        """Node-local staging prepared by slurm/prolog for this job; None outside Slurm or when
        the prolog did not make it.

        The prolog's rule, checked here too: a real directory (not a symlink) of this
        process's user, private (no group/other bits), in a root owned by root or by us
        that others may not write in unless it is sticky. A directory another user
        planted (or a 0777 one) is never handed to the job.
        """
        import stat
        job_id = self.raw_job_id
        if job_id is None or not job_id.isdigit():
            return None
        path = staging_root(self.environ) / f"job-{job_id}"
        try:
            st, root = os.lstat(path), os.lstat(path.parent)
        except OSError:
            return None
        mine = stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077
        safe_root = (stat.S_ISDIR(root.st_mode) and root.st_uid in (0, os.getuid())
                     and (not root.st_mode & 0o022 or bool(root.st_mode & stat.S_ISVTX)))
        return path if mine and safe_root else None


def without_slurm(environ: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``environ`` without Slurm's variables: for processes that must not take
    themselves for a step of the surrounding job (local ranks, reference runs)."""
    return {k: v for k, v in environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}


def staging_root(environ: Mapping[str, str]) -> Path:
    """Where slurm/prolog puts per-job staging directories.

    Same rule as the prolog: $HPCCKPT_STAGING_ROOT, else the path written in
    ``hpcckpt-staging-root`` beside $SLURM_CONF, else /tmp/hpcckpt-staging; a
    literal ``%n`` stands for the node name.
    """
    root = str(STAGING_ROOT_DEFAULT)
    explicit = environ.get("HPCCKPT_STAGING_ROOT")
    conf = environ.get("SLURM_CONF")
    if explicit:
        root = explicit
    elif conf:
        try:
            text = (Path(conf).parent / STAGING_ROOT_FILE).read_text(encoding="utf-8")
        except OSError:
            text = ""
        root = text.splitlines()[0] if text.strip() else root
    node = environ.get("SLURMD_NODENAME") or os.uname().nodename
    return Path(root.replace("%n", node))
