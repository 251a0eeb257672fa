"""Why did a run stop? Slurm's own records, read three ways, best first:

1. ``sacct --duplicates`` (one row per run of a requeued job) where slurmdbd runs;
2. the ``jobcomp/filetxt`` log (``JobCompLoc``): one line per ended run, kept even
   without accounting, which is what slurm/localcluster configures;
3. ``scontrol show job`` while slurmctld still remembers the job (``PreemptTime``).

The ledger then refines the answer: a stop the job itself decided (deadline,
maintenance, drain) names its cause, and a requeue the job issued in reaction to
a signal shows up in Slurm as a plain requeue, so the signal and timing decide.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hpcckpt.cluster.base import Cause
from hpcckpt.cluster.scontrol import parse_duration_s, parse_slurm_time, run_slurm, show_config
from hpcckpt.errors import ClusterError

# Slurm job states (sacct/jobcomp spelling) -> cause of the stop.
STATE_CAUSE: dict[str, Cause] = {
    "PREEMPTED": Cause.PREEMPTION,
    "TIMEOUT": Cause.TIME_LIMIT,
    "DEADLINE": Cause.TIME_LIMIT,
    "NODE_FAIL": Cause.NODE_FAILURE,
    "BOOT_FAIL": Cause.NODE_FAILURE,
    "CANCELLED": Cause.USER_CANCEL,
    "FAILED": Cause.FAILURE,
    "OUT_OF_MEMORY": Cause.FAILURE,
    "COMPLETED": Cause.DONE,
}

# jobcomp/filetxt writes "Key=Value" pairs in this fixed order; the free-text
# Name= value is everything between " Name=" and " JobState=".
_JOBCOMP_KEYS = ("JobId", "UserId", "GroupId", "Name", "JobState", "Partition", "TimeLimit",
                 "StartTime", "EndTime", "NodeList", "NodeCnt", "ProcCnt", "WorkDir",
                 "ReservationName", "Tres", "Account", "QOS", "WcKey", "Cluster", "SubmitTime",
                 "EligibleTime", "DerivedExitCode", "ExitCode")


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """One run (allocation) of a job as Slurm recorded its end."""

    job_id: str
    state: str
    start_s: float | None
    end_s: float | None
    time_limit_s: float | None
    source: str

    @property
    def cause(self) -> Cause | None:
        return STATE_CAUSE.get(self.state.split()[0].upper()) if self.state else None


def parse_jobcomp_line(line: str) -> dict[str, str]:
    """Parse one jobcomp/filetxt line; names and paths may hold spaces, quotes, '='."""
    out: dict[str, str] = {}
    positions: list[tuple[str, int]] = []
    for key in _JOBCOMP_KEYS:
        marker = f"{key}=" if key == "JobId" else f" {key}="
        start = line.find(marker, positions[-1][1] if positions else 0)
        if start < 0:
            continue
        positions.append((key, start + len(marker)))
    for i, (key, value_start) in enumerate(positions):
        end = (line.find(f" {positions[i + 1][0]}=", value_start) if i + 1 < len(positions)
               else len(line.rstrip("\n")))
        out[key] = line[value_start:end].strip() if key != "Name" else line[value_start:end]
    return out


def _jobcomp_minutes(text: str) -> float | None:
    # jobcomp prints TimeLimit in minutes ("525600" for unlimited, "UNLIMITED" too).
    if not text or text.upper() in {"UNLIMITED", "NONE", "N/A"}:
        return None
    try:
        minutes = float(text)
    except ValueError:
        return parse_duration_s(text)
    return None if minutes >= 525600 else minutes * 60


def runs_from_jobcomp(lines: Iterable[str], job_ids: set[str]) -> list[RunRecord]:
    runs = []
    for line in lines:
        rec = parse_jobcomp_line(line)
        if rec.get("JobId") not in job_ids:
            continue
        runs.append(RunRecord(job_id=rec["JobId"], state=rec.get("JobState", ""),
                              start_s=parse_slurm_time(rec.get("StartTime", "")),
                              end_s=parse_slurm_time(rec.get("EndTime", "")),
                              time_limit_s=_jobcomp_minutes(rec.get("TimeLimit", "")),
                              source="jobcomp"))
    return runs


def parse_sacct(text: str) -> list[RunRecord]:
    """Parse ``sacct -P -n -D -X -o JobID,State,Start,End,Timelimit``."""
    runs = []
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) < 5 or "." in parts[0]:
            continue
        runs.append(RunRecord(job_id=parts[0], state=parts[1], start_s=parse_slurm_time(parts[2]),
                              end_s=parse_slurm_time(parts[3]),
                              time_limit_s=parse_duration_s(parts[4]), source="sacct"))
    return runs


def slurm_runs(job_ids: set[str], *, jobcomp_path: Path | None = None) -> list[RunRecord]:
    """Every recorded run of ``job_ids``, from sacct if it works, else the jobcomp log."""
    if not job_ids:
        return []
    try:
        text = run_slurm(["sacct", "-P", "-n", "-D", "-X", "-o", "JobID,State,Start,End,Timelimit",
                          "-j", ",".join(sorted(job_ids))])
        runs = parse_sacct(text)
        if runs:
            return runs
    except ClusterError:
        pass  # no slurmdbd: "Slurm accounting storage is disabled"
    path = jobcomp_path or _jobcomp_location()
    if path is None:
        return []
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return runs_from_jobcomp(fh, job_ids)
    except OSError:
        return []


def _jobcomp_location() -> Path | None:
    try:
        conf = show_config()
    except ClusterError:
        return None
    if conf.get("JobCompType", "") != "jobcomp/filetxt":
        return None
    loc = conf.get("JobCompLoc", "")
    return Path(loc) if loc and loc != "(null)" else None


def match_run(runs: Iterable[RunRecord], job_id: str | None, when_s: float | None,
              slack_s: float = 5.0) -> RunRecord | None:
    """The run of ``job_id`` that was active at ``when_s`` (a signal or stop time)."""
    best = None
    for run in runs:
        if run.job_id != job_id:
            continue
        if when_s is None or run.start_s is None:
            best = run
            continue
        end = run.end_s if run.end_s is not None else float("inf")
        if run.start_s - slack_s <= when_s <= end + 60.0:
            if best is None or (best.start_s or 0) < run.start_s:
                best = run
    return best


def classify(stop: Mapping[str, object] | None, signame: str | None, signal_time_s: float | None,
             run: RunRecord | None, requeue_cause: str | None = None, *, requeued: bool = False) -> Cause:
    """The cause of one interruption from the ledger's stop and Slurm's run record.

    ``requeue_cause`` is what the requeue recorded after asking Slurm (a preemption
    shows there even when the job stopped early on the moved end time; an operator's
    ``scontrol requeue`` as the job pending again without a preemption; Slurm's own
    TIMEOUT). ``requeued``: the job was confirmed to run again (requeue or successor),
    so a run Slurm recorded as FAILED (the exit status 75) did not fail.
    """
    reason = str(stop.get("reason", "")) if stop else ""
    told = {Cause.PREEMPTION, Cause.NODE_FAILURE, Cause.MAINTENANCE, Cause.RANK_FAILURE,
            Cause.OPERATOR_REQUEUE, Cause.TIME_LIMIT, Cause.SUPERSEDED}
    if requeue_cause and Cause.parse(requeue_cause) in told:
        said = Cause.parse(requeue_cause)
        # At requeue time a job Slurm had already put back (its record pending again, no
        # PreemptTime left) looks like an operator's requeue; Slurm's own record of the run
        # (PREEMPTED in jobcomp or sacct) knows better.
        if said is Cause.OPERATOR_REQUEUE and run is not None and run.cause is Cause.PREEMPTION:
            return Cause.PREEMPTION
        return said
    if reason == "superseded":
        return Cause.SUPERSEDED
    if reason in {"deadline", "time_limit"}:
        return Cause.TIME_LIMIT
    if reason in {"maintenance", "drain"}:
        return Cause.MAINTENANCE
    if reason == "rank_failure":
        return Cause.RANK_FAILURE
    if run is not None and run.cause not in (None, Cause.DONE, Cause.FAILURE):
        return run.cause
    if signame in {"SIGTERM", "TERM"}:
        # Slurm sends TERM on preemption (GraceTime) and on scancel; a job that requeues
        # itself within the grace time is recorded as a requeue, not as PREEMPTED.
        return Cause.PREEMPTION
    if run is not None and run.time_limit_s and run.start_s and signal_time_s:
        remaining = run.start_s + run.time_limit_s - signal_time_s
        if remaining <= max(120.0, 0.1 * run.time_limit_s):
            return Cause.TIME_LIMIT
    if reason == "error" or (run is not None and run.cause is Cause.FAILURE and not requeued):
        return Cause.FAILURE
    if signame:
        return Cause.SIGNAL
    if stop is None:
        return Cause.UNKNOWN if run is None else (run.cause or Cause.UNKNOWN)
    return Cause.SIGNAL if reason == "signal" else Cause.UNKNOWN
