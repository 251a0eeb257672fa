"""Slurm command-line backend: scontrol/squeue/sbatch, parsed as plain text.

Slurm 22.05 has no ``--json`` for ``scontrol show``, so the one-line ``-o`` form is
parsed. Free-text values (job name, paths) may contain spaces, quotes and ``=``;
the parser splits only at keys Slurm itself prints, which keeps those values whole.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from hpcckpt.cluster.base import Cause, ClusterBase, Reservation, RequeueOutcome, node_is_draining
from hpcckpt.cluster.budget import charge
from hpcckpt.config import env_value
from hpcckpt.exitcodes import EXIT_REQUEUE
from hpcckpt.errors import ClusterError

log = logging.getLogger("hpcckpt.cluster")

COMMAND_TIMEOUT_S = 30.0
# Set by the multi-node templates: ranks inside srun leave the requeue to the batch
# script, so that no rank is still running when Slurm kills the job.
REQUEUE_FROM_BATCH_VAR = "HPCCKPT_REQUEUE_FROM_BATCH"


def _ledger_note(state_dir: Path, **fields: object) -> None:
    from hpcckpt.ledger import Ledger

    try:
        Ledger(state_dir).append("requeue", **fields)
    except OSError as err:  # the requeue matters more than its record
        log.warning("could not record the requeue in %s: %s", state_dir, err)

# Keys `scontrol show job/node/reservation/partition -o` prints (Slurm 22.05-24.x).
# Splitting only at these keeps a job name like 'a b=c; "d"' in one value.
KNOWN_KEYS = frozenset("""
JobId ArrayJobId ArrayTaskId ArrayTaskThrottle JobName UserId GroupId MCS_label Priority
Nice Account QOS JobState Reason Dependency Requeue Restarts BatchFlag Reboot ExitCode
DerivedExitCode RunTime TimeLimit TimeMin SubmitTime EligibleTime AccrueTime StartTime
EndTime Deadline PreemptEligibleTime PreemptTime SuspendTime SecsPreSuspend LastSchedEval
Scheduler Partition AllocNode:Sid ReqNodeList ExcNodeList NodeList BatchHost NumNodes
NumCPUs NumTasks CPUs/Task ReqB:S:C:T TRES Socks/Node NtasksPerN:B:S:C CoreSpec
MinCPUsNode MinMemoryNode MinMemoryCPU MinTmpDiskNode Features DelayBoot OverSubscribe
Contiguous Licenses Network Command WorkDir StdErr StdIn StdOut Power Comment
AdminComment Reservation TresPerNode TresPerTask CpusPerTres MemPerTres TresPerJob
KillOOMOnStep MailUser MailType NtasksPerTRES Container ContainerID SiblingsActive
SiblingsViable HetJobId HetJobOffset HetJobIdSet
NodeName Arch CoresPerSocket CPUAlloc CPUEfctv CPUTot CPULoad AvailableFeatures
ActiveFeatures Gres NodeAddr NodeHostName Version OS RealMemory AllocMem FreeMem Sockets
Boards State ThreadsPerCore TmpDisk Weight Owner Partitions BootTime SlurmdStartTime
LastBusyTime CfgTRES AllocTRES CapWatts CurrentWatts AveWatts ExtSensorsJoules
ExtSensorsWatts ExtSensorsTemp ResumeAfterTime
ReservationName Duration Nodes NodeCnt CoreCnt PartitionName Flags Users Groups
Accounts BurstBuffer Watts MaxStartDelay
AllowGroups AllowAccounts AllowQos AllocNodes Default DefaultTime DisableRootJobs
ExclusiveUser GraceTime Hidden MaxNodes MaxTime MinNodes LLN MaxCPUsPerNode PriorityJobFactor
PriorityTier RootOnly ReqResv OverTimeLimit PreemptMode TotalCPUs TotalNodes
SelectTypeParameters JobDefaults DefMemPerNode MaxMemPerNode DefMemPerCPU MaxMemPerCPU
""".split())

_KEY_RE = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_:/]*)=")


def parse_kv_line(line: str) -> dict[str, str]:
    """Parse one ``scontrol show ... -o`` line into {key: value} (values stripped)."""
    found = [m for m in _KEY_RE.finditer(line) if m.group(1) in KNOWN_KEYS]
    # A free-text value that contains the very next key (a job name ending in
    # " UserId=x") shows up as that key twice in a row: the last one is Slurm's.
    cuts = [m for i, m in enumerate(found)
            if i + 1 >= len(found) or found[i + 1].group(1) != m.group(1)]
    out: dict[str, str] = {}
    for i, match in enumerate(cuts):
        end = cuts[i + 1].start() if i + 1 < len(cuts) else len(line)
        value = line[match.end():end]
        # A single space separates pairs; any other whitespace belongs to the value.
        out.setdefault(match.group(1), value[:-1] if value.endswith(" ") else value)
    return out


def parse_records(text: str) -> list[dict[str, str]]:
    """Parse ``-o`` output with one record per line; blank lines and banners are skipped."""
    return [parse_kv_line(line) for line in text.splitlines() if "=" in line]


def parse_duration_s(text: str) -> float | None:
    """Slurm durations: ``[D-]HH:MM:SS``, ``MM:SS``, ``MM``; None for UNLIMITED/NONE/N/A."""
    text = text.strip()
    if not text or text.upper() in {"UNLIMITED", "INFINITE", "NONE", "N/A", "NOT_SET", "INVALID"}:
        return None
    days, _, clock = text.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if len(parts) == 1:
        seconds = parts[0] * (3600 if days else 60)
    elif len(parts) == 2:
        seconds = parts[0] * 60 + parts[1] if not days else parts[0] * 3600 + parts[1] * 60
    else:
        seconds = parts[0] * 3600 + parts[1] * 60 + parts[2]
    return float(seconds + (int(days) * 86400 if days else 0))


def parse_slurm_time(text: str) -> float | None:
    """Slurm timestamps (``2026-11-21T00:02:16``, local time) -> epoch s; None for Unknown/None."""
    text = text.strip()
    if not text or text in {"Unknown", "None", "N/A", "(null)", "NONE"}:
        return None
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def parse_reservations(text: str, *, expand: object = None) -> list[Reservation]:
    """Parse ``scontrol show reservation -o``; "No reservations in the system" -> []."""
    from submitit.slurm.slurm import _parse_node_list

    out = []
    for rec in parse_records(text):
        if "ReservationName" not in rec:
            continue
        nodes = rec.get("Nodes", "")
        node_names = tuple(_parse_node_list(nodes)) if nodes and nodes != "(null)" else ()
        out.append(Reservation(
            name=rec["ReservationName"],
            start_s=parse_slurm_time(rec.get("StartTime", "")) or 0.0,
            end_s=parse_slurm_time(rec.get("EndTime", "")) or float("inf"),
            nodes=node_names,
            flags=tuple(f for f in rec.get("Flags", "").split(",") if f)))
    return out


def parse_config(text: str) -> dict[str, str]:
    """Parse ``scontrol show config`` ("Key = Value" lines)."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and " " not in key.strip():
            out[key.strip()] = value.strip()
    return out


def run_slurm(args: Sequence[str], *, timeout_s: float = COMMAND_TIMEOUT_S,
              environ: Mapping[str, str] | None = None) -> str:
    """Run a Slurm command; its stdout, or ClusterError naming the command and Slurm's words."""
    if shutil.which(args[0]) is None:
        raise ClusterError(f"'{args[0]}' is not on PATH; install the Slurm client tools "
                           "(slurm/install-deps) or run outside Slurm")
    try:
        proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout_s,
                              env=dict(environ) if environ is not None else None, check=False)
    except subprocess.TimeoutExpired as err:
        raise ClusterError(f"'{' '.join(args)}' did not answer within {timeout_s:.0f}s; "
                           "is slurmctld up (scontrol ping)?") from err
    if proc.returncode != 0:
        raise ClusterError(f"'{' '.join(args)}' failed (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def show_job(job_id: str) -> dict[str, str]:
    """``scontrol show job -o ID`` as a dict; ClusterError when Slurm no longer knows the job."""
    recs = parse_records(run_slurm(["scontrol", "show", "job", "-o", job_id]))
    if not recs:
        raise ClusterError(f"scontrol knows no job {job_id} (finished longer than MinJobAge ago?)")
    return recs[0]


def show_config() -> dict[str, str]:
    return parse_config(run_slurm(["scontrol", "show", "config"]))


def slurm_version() -> str | None:
    """The running Slurm's version (from the client tools), None when Slurm is absent."""
    try:
        out = run_slurm(["scontrol", "--version"])
    except ClusterError:
        return None
    match = re.search(r"(\d+\.\d+(?:\.\d+)?)", out)
    return match.group(1) if match else None


def successor_environment(environ: Mapping[str, str], predecessor: str) -> dict[str, str]:
    """The environment a successor job is submitted with.

    This job's SLURM_* variables are dropped (sbatch would otherwise read them as
    options and the successor would inherit a stale job id or restart count); the
    Slurm configuration and everything else, the checkpoint directory included, stays.
    """
    keep = {"SLURM_CONF"}
    env = {k: v for k, v in environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))
           or k in keep}
    env["HPCCKPT_PREDECESSOR_JOB_ID"] = predecessor
    generation = env_value("successor_generation", 0, environ)
    env["HPCCKPT_SUCCESSOR_GENERATION"] = str(generation + 1)
    return env


def successor_sbatch_args(job: Mapping[str, str], script: Path, dependency_job_id: str) -> list[str]:
    """sbatch arguments that resubmit ``job`` (a ``show_job`` dict) after ``dependency_job_id``."""
    args = ["sbatch", "--parsable", f"--dependency=afterany:{dependency_job_id}",
            "--export=ALL", "--open-mode=append"]
    simple = {"JobName": "--job-name", "Partition": "--partition", "NumNodes": "--nodes",
              "NumTasks": "--ntasks", "WorkDir": "--chdir", "StdOut": "--output",
              "StdErr": "--error"}
    for key, flag in simple.items():
        value = job.get(key, "")
        if value and value not in {"(null)", "N/A"}:
            args.append(f"{flag}={value}")
    limit = parse_duration_s(job.get("TimeLimit", ""))
    if limit is not None:
        args.append(f"--time={max(1, int(limit // 60))}")
    if job.get("Requeue") == "1":
        args.append("--requeue")
    args.append(str(script))
    return args


def refine_cause(cause: str, job: Mapping[str, str] | None) -> str:
    """Slurm's own view of why the job must stop, when it knows better than the caller.

    A preemption sets ``PreemptTime`` and pulls ``EndTime`` in to now + GraceTime, so
    a job that noticed the moved end time ("deadline") was in truth preempted.
    """
    if job is None:
        return cause
    if job.get("PreemptTime", "None") not in {"None", "", "N/A", "Unknown"}:
        return Cause.PREEMPTION.value
    if slurm_is_requeueing(job) and Cause.parse(cause) in {Cause.SIGNAL, Cause.UNKNOWN}:
        # Requeued by Slurm while still running, with TERM: PreemptMode=REQUEUE.
        return Cause.PREEMPTION.value
    return cause


# States in which Slurm has already taken the job off its nodes for a requeue.
_REQUEUEING_STATES = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "PREEMPTED",
                      "COMPLETING", "RESV_DEL_HOLD"}


def slurm_is_requeueing(job: Mapping[str, str]) -> bool:
    """True when the job we run in is already being requeued by Slurm itself (preemption
    with PreemptMode=REQUEUE marks it PENDING while its processes get TERM and GraceTime)."""
    return job.get("JobState", "RUNNING").split("+")[0] in _REQUEUEING_STATES


def _already_requeued(message: str) -> bool:
    text = message.lower()
    return "pending execution" in text or "already" in text


class SlurmCli(ClusterBase):
    """Cluster backend over the Slurm command-line tools (the path that always works)."""

    name = "slurm-cli"

    def _job_id(self) -> str:
        job_id = self.env.job_id
        if job_id is None:
            raise ClusterError("SLURM_JOB_ID is not set: this process is not a Slurm job; "
                               "use the local backend (hpcckpt.cluster.detect()) outside Slurm")
        return job_id

    def requeue(self, cause: str, state_dir: Path, *, committed_step: int | None = None) -> RequeueOutcome:
        """Coordinator only, after the final checkpoint is durable: ``scontrol requeue``
        kills this job at once. If Slurm refuses, a successor job is submitted instead."""
        job_id = self._job_id()
        if self.env.in_step and os.environ.get(REQUEUE_FROM_BATCH_VAR) == "1":
            return RequeueOutcome(
                requeued=True, method="batch-script", cause=Cause.parse(cause).value, job_id=job_id,
                detail=(f"{REQUEUE_FROM_BATCH_VAR}=1: every rank exits {EXIT_REQUEUE}; the batch "
                        "script runs `hpcckpt requeue` once srun has returned"))
        job = self._job_record(job_id)
        cause = refine_cause(cause, job)
        attempt = f"{job_id}:{self.env.restart_count}"
        decision = charge(state_dir, cause, attempt=attempt, committed_step=committed_step,
                          options=self._budget)
        cause_value = Cause.parse(cause).value
        if not decision.allowed:
            log.warning("not requeueing job %s: %s", job_id, decision.reason)
            return RequeueOutcome(requeued=False, method="none", detail=decision.reason,
                                  cause=cause_value, job_id=job_id)
        if job is not None and slurm_is_requeueing(job):
            return self._slurm_outcome(job_id, cause_value, f"JobState={job.get('JobState')}", state_dir)
        log.warning("requeueing job %s (cause %s; %s)", job_id, cause_value, decision.reason)
        # scontrol requeue ends this process at once: the ledger learns of it first.
        _ledger_note(state_dir, method="scontrol", cause=cause_value, job_id=job_id,
                     detail=f"scontrol requeue {job_id} issued ({decision.reason})")
        try:
            run_slurm(["scontrol", "requeue", job_id])
        except ClusterError as err:
            if _already_requeued(str(err)):
                return self._slurm_outcome(job_id, cause_value, str(err), state_dir)
            return self._successor_outcome(job_id, cause_value, err)
        return RequeueOutcome(requeued=True, method="scontrol", cause=cause_value,
                              detail=f"scontrol requeue {job_id} ({decision.reason})", job_id=job_id)

    @staticmethod
    def _slurm_outcome(job_id: str, cause: str, evidence: str, state_dir: Path) -> RequeueOutcome:
        detail = (f"Slurm is already requeueing job {job_id} ({evidence}; PreemptMode=REQUEUE "
                  "preemption or an operator's requeue); no successor needed")
        log.warning("%s", detail)
        _ledger_note(state_dir, method="slurm", cause=cause, job_id=job_id, detail=detail)
        return RequeueOutcome(requeued=True, method="slurm", cause=cause, detail=detail, job_id=job_id)

    @staticmethod
    def _job_record(job_id: str) -> dict[str, str] | None:
        try:
            return show_job(job_id)
        except ClusterError as err:
            log.info("could not read job %s before requeueing (%s)", job_id, err)
            return None

    def _successor_outcome(self, job_id: str, cause: str, err: ClusterError) -> RequeueOutcome:
        log.warning("scontrol requeue refused for job %s (%s); submitting a successor", job_id, err)
        successor = self.submit_successor(dependency_job_id=job_id)
        return RequeueOutcome(
            requeued=True, method="successor", cause=Cause.parse(cause).value, job_id=job_id,
            successor_job_id=successor,
            detail=(f"requeue refused ({err}); submitted successor job {successor} "
                    f"with --dependency=afterany:{job_id}"))

    def submit_successor(self, *, dependency_job_id: str | None = None) -> str:
        """Coordinator only: resubmit this job's batch script, same options and environment."""
        job_id = self.env.raw_job_id or self._job_id()
        after = dependency_job_id or job_id
        job = show_job(job_id)
        script = self._saved_batch_script(job_id, Path(job.get("WorkDir") or "."))
        args = successor_sbatch_args(job, script, after)
        out = run_slurm(args, environ=successor_environment(os.environ, job_id))
        successor = out.strip().split(";")[0]
        log.warning("submitted successor job %s (afterany:%s): %s", successor, after, " ".join(args))
        return successor

    @staticmethod
    def _saved_batch_script(job_id: str, workdir: Path) -> Path:
        # `scontrol write batch_script` returns the script exactly as submitted,
        # #SBATCH lines included; it is kept beside the job's outputs for the record.
        target_dir = workdir if os.access(workdir, os.W_OK) else Path.cwd()
        target = target_dir / f".hpcckpt-successor-of-{job_id}.sbatch"
        run_slurm(["scontrol", "write", "batch_script", job_id, str(target)])
        return target

    def end_time(self) -> float | None:
        job = show_job(self._job_id())
        if parse_duration_s(job.get("TimeLimit", "")) is None:
            return None
        return parse_slurm_time(job.get("EndTime", ""))

    def reservations(self) -> list[Reservation]:
        text = run_slurm(["scontrol", "show", "reservation", "-o"])
        now, end = time.time(), self.end_time() or float("inf")
        nodes = self.env.hostnames
        return [r for r in parse_reservations(text)
                if r.is_maintenance and r.overlaps(nodes=nodes, start_s=now, end_s=end)]

    def node_state(self) -> str:
        node = self.env.node_name
        if not node:
            return ""
        recs = parse_records(run_slurm(["scontrol", "show", "node", "-o", node]))
        return recs[0].get("State", "") if recs else ""

    def node_draining(self) -> bool:
        return node_is_draining(self.node_state())
