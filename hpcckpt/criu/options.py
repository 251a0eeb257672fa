"""What a CRIU-mode run is given (``RunOptions``), what it reports (``CriuOutcome``), and the
tools it finds when first needed (``Tools``: criu, the CUDA checkpoint driver)."""
from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from . import ops
from .locate import Criu, find_criu

MODES = ("criu",)
FALLBACKS = ("app", "fresh", "fail")
NS_LAYOUT = 2  # images of the job tree at PID 2, dumped from inside its namespaces


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    dir: Path
    cmd: tuple[str, ...]
    mode: str = "criu"
    dump_signals: tuple[signal.Signals, ...] = (signal.SIGUSR2, signal.SIGTERM)
    keep: int = 2
    dump_every_s: float = 0.0  # periodic images (criu dump --leave-running); 0: only at a stop
    end_poll_s: float = 10.0  # under Slurm: how often the end time is read (a preemption pulls it in)
    lead_s: float | None = None  # the --signal lead of the batch script (an early warning waits for it)
    on_restore_failure: str = "app"
    dump: ops.DumpOptions = field(default_factory=ops.DumpOptions)
    cuda_lock_timeout_ms: int = 60_000
    criu_path: str | None = None
    json_stdout: bool = False  # our stdout carries --json: the job's stdout is copied to stderr

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"unknown --mode {self.mode!r}; valid: {', '.join(MODES)} (--mode app: "
                              "hpcckpt.app.run_app)")
        if self.on_restore_failure not in FALLBACKS:
            raise ConfigError(f"unknown --on-restore-failure {self.on_restore_failure!r}; "
                              f"valid: {', '.join(FALLBACKS)}")
        bad = [s.name for s in self.dump_signals if s in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD)]
        if bad or not self.dump_signals:
            raise ConfigError(f"--signal {','.join(bad) or '(empty)'} cannot trigger a dump; use a catchable "
                              "signal such as USR2 (and `#SBATCH --signal=B:USR2@LEAD`)")
        if self.keep < 1:
            raise ConfigError(f"--keep must be >= 1 (got {self.keep})")
        if not self.cmd:
            raise ConfigError("no command given: use `hpcckpt run [options] -- CMD ARGS`")


@dataclass(kw_only=True)
class CriuOutcome:
    exit_code: int
    action: str  # "exited" | "requeue" | "restore-failed"
    restored_from: str | None = None
    images: list[str] = field(default_factory=list)
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"exit_code": self.exit_code, "action": self.action, "restored_from": self.restored_from,
                "images": self.images, "detail": self.detail}


class Tools:
    """criu and the CUDA checkpoint driver of one run, each found when first needed.
    ``cuda_driver``: the CudaCheckpoint factory (a seam for fault tests)."""

    def __init__(self, criu_path: str | None, cuda_driver: Callable[[], Any] | None = None) -> None:
        self.criu_path = criu_path
        self.found: Criu | None = None
        self._cuda_driver = cuda_driver

    def criu(self) -> Criu:
        if self.found is None:
            self.found = find_criu(self.criu_path)
        return self.found

    def cuda(self) -> Any:
        if self._cuda_driver is None:
            from ..cuda import CudaCheckpoint

            self._cuda_driver = CudaCheckpoint
        return self._cuda_driver()


def multi_node_refusal(nodes: int) -> str:
    """Why CRIU mode does not take a job on several nodes (the one message of the template, the
    supervisor and doctor)."""
    return (f"this job has {nodes} nodes, and CRIU mode dumps the process tree of one node: the other nodes' "
            "ranks run under slurmstepd outside it, so no image holds the job. For several nodes use the "
            "in-process templates (hpcckpt template ddp, or torchrun) with hpcckpt's Checkpointer")


def first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
