"""pyslurm backend: used only when pyslurm imports AND was built for the running Slurm.

pyslurm's major.minor must equal Slurm's (its C API changes every release); no
pyslurm release matches Debian 12's Slurm 22.05, so there the CLI backend serves.
Reads that pyslurm makes cheap (job record, reservations, node state) go through
it; requeue and successor submission reuse the CLI backend's tested path.
"""

from __future__ import annotations

import importlib
import time
from types import ModuleType

from hpcckpt.cluster.base import Reservation
from hpcckpt.cluster.env import JobEnv
from hpcckpt.cluster.scontrol import SlurmCli, slurm_version


def _major_minor(version: str) -> tuple[int, int] | None:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def probe() -> tuple[ModuleType | None, str]:
    """(pyslurm module or None, the reason for the choice, for the log and doctor)."""
    try:
        module = importlib.import_module("pyslurm")
    except ImportError as err:
        return None, f"pyslurm not importable ({err}); using the Slurm CLI"
    py_version = str(getattr(module, "__version__", ""))
    running = slurm_version()
    if running is None:
        return None, "pyslurm imports but no Slurm answers (scontrol --version); using the Slurm CLI"
    if _major_minor(py_version) != _major_minor(running):
        return None, (f"pyslurm {py_version} was built for another Slurm than the running "
                      f"{running}; using the Slurm CLI (install pyslurm=={running.rsplit('.', 1)[0]}.*)")
    return module, f"pyslurm {py_version} matches Slurm {running}"


class PySlurmCluster(SlurmCli):
    """SlurmCli with pyslurm for job reads; verbs that change the job stay on the CLI."""

    name = "pyslurm"
    remote = True

    def __init__(self, module: ModuleType, env: JobEnv | None = None) -> None:
        super().__init__(env)
        self._pyslurm = module

    def end_time(self) -> float | None:
        job = self._pyslurm.Job.load(int(self.env.raw_job_id or self._job_id().split("_")[0]))
        end = getattr(job, "end_time", None)
        return float(end) if end else None

    def reservations(self) -> list[Reservation]:
        now, end = time.time(), self.end_time() or float("inf")
        out = []
        for name, res in self._pyslurm.Reservations.load().items():
            flags = tuple(str(f).upper() for f in (getattr(res, "flags", None) or ()))
            nodes = tuple(getattr(res, "nodes", None) or ())
            r = Reservation(name=str(name), start_s=float(res.start_time or 0),
                            end_s=float(res.end_time or float("inf")), nodes=nodes, flags=flags)
            if r.is_maintenance and r.overlaps(nodes=self.env.hostnames, start_s=now, end_s=end):
                out.append(r)
        return out
