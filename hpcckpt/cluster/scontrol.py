"""Slurm command-line backend: scontrol/squeue/sbatch, parsed as plain text.

Slurm 22.05 has no ``--json`` for ``scontrol show``. A job's name, comment and paths are
its user's words and may hold anything (spaces, ``=``, newlines, a whole forged record), so
what decisions read of a job comes from ``squeue`` fields that hold none of them
(``show_job``), and each free-text value a successor needs is read alone, exactly. Other
records (nodes, reservations, partitions) are parsed from the one-line ``-o`` form, split only
at keys Slurm itself prints.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from hpcckpt.cluster.base import Cause, ClusterBase, RequeueOutcome, Reservation, node_is_draining
from hpcckpt.config import INTERNAL_PREFIX, env_value, internal_source, internal_var, read_internal
from hpcckpt.errors import ClusterError

log = logging.getLogger("hpcckpt.cluster")

COMMAND_TIMEOUT_S = 30.0

# Keys `scontrol show job/node/reservation/partition -o` prints (Slurm 22.05-24.x).
# Splitting only at these keeps a job name like 'a b=c; "d"' in one value.
KNOWN_KEYS = frozenset(["JobId", "ArrayJobId", "ArrayTaskId", "ArrayTaskThrottle", "JobName", "UserId", "GroupId", "MCS_label", "Priority", "Nice", "Account", "QOS", "JobState", "Reason", "Dependency", "Requeue", "Restarts", "BatchFlag", "Reboot", "ExitCode", "DerivedExitCode", "RunTime", "TimeLimit", "TimeMin", "SubmitTime", "EligibleTime", "AccrueTime", "StartTime", "EndTime", "Deadline", "PreemptEligibleTime", "PreemptTime", "SuspendTime", "SecsPreSuspend", "LastSchedEval", "Scheduler", "Partition", "AllocNode:Sid", "ReqNodeList", "ExcNodeList", "NodeList", "BatchHost", "NumNodes", "NumCPUs", "NumTasks", "CPUs/Task", "ReqB:S:C:T", "TRES", "Socks/Node", "NtasksPerN:B:S:C", "CoreSpec", "MinCPUsNode", "MinMemoryNode", "MinMemoryCPU", "MinTmpDiskNode", "Features", "DelayBoot", "OverSubscribe", "Contiguous", "Licenses", "Network", "Command", "WorkDir", "StdErr", "StdIn", "StdOut", "Power", "Comment", "AdminComment", "Reservation", "TresPerNode", "TresPerTask", "CpusPerTres", "MemPerTres", "TresPerJob", "KillOOMOnStep", "MailUser", "MailType", "NtasksPerTRES", "Container", "ContainerID", "SiblingsActive", "SiblingsViable", "HetJobId", "HetJobOffset", "HetJobIdSet", "NodeName", "Arch", "CoresPerSocket", "CPUAlloc", "CPUEfctv", "CPUTot", "CPULoad", "AvailableFeatures", "ActiveFeatures", "Gres", "NodeAddr", "NodeHostName", "Version", "OS", "RealMemory", "AllocMem", "FreeMem", "Sockets", "Boards", "State", "ThreadsPerCore", "TmpDisk", "Weight", "Owner", "Partitions", "BootTime", "SlurmdStartTime", "LastBusyTime", "CfgTRES", "AllocTRES", "CapWatts", "CurrentWatts", "AveWatts", "ExtSensorsJoules", "ExtSensorsWatts", "ExtSensorsTemp", "ResumeAfterTime", "ReservationName", "Duration", "Nodes", "NodeCnt", "CoreCnt", "PartitionName", "Flags", "Users", "Groups", "Accounts", "BurstBuffer", "Watts", "MaxStartDelay", "AllowGroups", "AllowAccounts", "AllowQos", "AllocNodes", "Default", "DefaultTime", "DisableRootJobs", "ExclusiveUser", "GraceTime", "Hidden", "MaxNodes", "MaxTime", "MinNodes", "LLN", "MaxCPUsPerNode", "PriorityJobFactor", "PriorityTier", "RootOnly", "ReqResv", "OverTimeLimit", "PreemptMode", "TotalCPUs", "TotalNodes", "SelectTypeParameters", "JobDefaults", "DefMemPerNode", "MaxMemPerNode", "DefMemPerCPU", "MaxMemPerCPU"])

_KEY_RE = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_:/]*)=")


def parse_kv_line(line: str, *, exact: Mapping[str, str] | None = None) -> dict[str, str]:
    """Parse one ``scontrol show ... -o`` line into {key: value} (values stripped).

    ``exact``: free-text values known exactly (``show_job`` reads them alone): the parse steps
    over each whole, so a key written inside one (a job named 'x JobState=PENDING') is never
    taken for Slurm's. Without it, a free-text value is cut at the next key Slurm prints."""
    exact = exact or {}
    found = [m for m in _KEY_RE.finditer(line) if m.group(1) in KNOWN_KEYS]
    # A free-text value that contains the very next key (a job name ending in
    # " UserId=x") shows up as that key twice in a row: the last one is Slurm's.
    cuts = [m for i, m in enumerate(found)
            if i + 1 >= len(found) or found[i + 1].group(1) != m.group(1)]
    out: dict[str, str] = {}
    skip_to = 0
    for i, match in enumerate(cuts):
        key = match.group(1)
        if match.start() < skip_to:
            continue  # inside a free-text value read exactly
        known = exact.get(key)
        if known is not None and key not in out and line.startswith(known, match.end()):
            out[key] = known
            skip_to = match.end() + len(known)
            continue
        end = next((m.start() for m in cuts[i + 1:] if m.start() >= match.end()), len(line))
        # A single space separates pairs; any other whitespace belongs to the value.
        out.setdefault(key, line[match.end():end].removesuffix(" "))
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


_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("hpcckpt_slurm_deadline", default=None)


@contextlib.contextmanager
def within(seconds: float) -> Iterator[None]:
    """Every Slurm command this thread runs in the block ends within ``seconds`` of its start, all
    of them together (an outer bound that ends sooner stays): the stop path's calls fit the
    time the job has left, however slow or absent slurmctld is."""
    outer = _DEADLINE.get()
    deadline = time.monotonic() + max(0.0, seconds)
    token = _DEADLINE.set(deadline if outer is None else min(outer, deadline))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def run_slurm(args: Sequence[str], *, timeout_s: float = COMMAND_TIMEOUT_S,
              environ: Mapping[str, str] | None = None) -> str:
    """Run a Slurm command; its stdout, or ClusterError naming the command and Slurm's words."""
    if shutil.which(args[0]) is None:
        raise ClusterError(f"'{args[0]}' is not on PATH; install the Slurm client tools "
                           "(slurm/install-deps) or run outside Slurm")
    deadline = _DEADLINE.get()
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0.05:
            raise ClusterError(f"'{' '.join(args)}' not run: the time this stop had for Slurm's answers is spent; "
                               "is slurmctld up (scontrol ping)?")
        timeout_s = min(timeout_s, left)
    try:
        proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout_s,
                              env=dict(environ) if environ is not None else None, check=False)
    except subprocess.TimeoutExpired as err:
        raise ClusterError(f"'{' '.join(args)}' did not answer within {timeout_s:.1f}s; "
                           "is slurmctld up (scontrol ping)?") from err
    if proc.returncode != 0:
        raise ClusterError(f"'{' '.join(args)}' failed (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


_REFUSALS = ("disabled", "pending", "completing", "completed", "denied", "not permitted", "invalid job")


def unanswered(error: str) -> bool:
    """Whether a failed Slurm command's ``ClusterError`` is not a refusal of the request by the
    controller (its words for one: the operation disabled, the job pending or completing
    already, permission): no answer in time (``run_slurm``'s timeout, "Socket timed out"), or
    a garbled one ("Zero Bytes were transmitted or received"). The request may then have
    been carried out."""
    low = error.lower()
    return not any(word in low for word in _REFUSALS)


# What every decision reads of a job (its state, restarts, times, partition), from ``squeue``:
# none of these fields holds text a user chose, and '|' occurs in none of them, so a job name,
# comment or path can never forge one (``scontrol show job`` prints the name among them: a job
# named 'x JobState=PENDING' reads as pending there). Keys are scontrol's, for one vocabulary.
_SQUEUE_FIELDS = (("JobId", "JobID"), ("JobState", "State"), ("Reason", "Reason"), ("Restarts", "RestartCnt"),
                  ("SubmitTime", "SubmitTime"), ("StartTime", "StartTime"), ("EndTime", "EndTime"),
                  ("PreemptTime", "PreemptTime"), ("Partition", "Partition"), ("TimeLimit", "TimeLimit"),
                  ("ArrayJobId", "ArrayJobID"), ("ArrayTaskId", "ArrayTaskID"), ("NumNodes", "NumNodes"),
                  ("NumCPUs", "NumCPUs"), ("Requeue", "Requeue"), ("BatchFlag", "BatchFlag"),
                  ("NodeList", "NodeList"))
# Free-text fields (a job's own words) the successor needs: each read alone, so its value is
# all of squeue's answer (less the final newline) whatever it holds, newlines and '=' included.
# The output paths are not among them: squeue shows their patterns ('%j'), scontrol the paths
# this job wrote, which the successor appends to; they follow every field read exactly.
_FREE_TEXT = (("JobName", "Name"), ("Command", "Command"), ("WorkDir", "WorkDir"), ("Comment", "Comment"))


def parse_squeue_fields(text: str) -> dict[str, str] | None:
    """One ``squeue -h -O F1:|,F2:|,...`` line of ``_SQUEUE_FIELDS`` -> {scontrol key: value};
    None when squeue printed no job."""
    line = text.strip("\n").split("\n")[0] if text.strip() else ""
    values = line.split("|")
    if len(values) < len(_SQUEUE_FIELDS):
        return None
    return {key: value.strip() for (key, _), value in zip(_SQUEUE_FIELDS, values)}


def _squeue(job_id: str, fmt: str, timeout_s: float) -> str:
    return run_slurm(["squeue", "-h", "--states=all", "-j", job_id, "-O", fmt], timeout_s=timeout_s)


def show_job(job_id: str, *, free_text: bool = False, timeout_s: float = COMMAND_TIMEOUT_S) -> dict[str, str]:
    """The job's record as a dict of scontrol's keys, read so that nothing in it can be forged by
    the job's own words (``_SQUEUE_FIELDS``); with ``free_text``, ``scontrol show job``'s
    record (what a successor is submitted with, in scontrol's spelling: ``TimeLimit`` of an
    unlimited job is its 365 days there), parsed stepping over its free-text values, each read
    exactly on its own. ClusterError when Slurm no longer knows the job."""
    fmt = ",".join(f"{field}:|" for _, field in _SQUEUE_FIELDS)
    record = parse_squeue_fields(_squeue(job_id, fmt, timeout_s))
    if record is None:
        raise ClusterError(f"Slurm knows no job {job_id} (finished longer than MinJobAge ago?)")
    if not free_text:
        return record
    exact = {key: _squeue(job_id, f"{field}:0", timeout_s).removesuffix("\n") for key, field in _FREE_TEXT}
    line = next((ln for ln in run_slurm(["scontrol", "show", "job", "-o", job_id], timeout_s=timeout_s).split("\n")
                 if ln.startswith("JobId=")), "")
    return {**record, **parse_kv_line(line, exact=exact), **exact}


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


def major_minor(version: str | None) -> tuple[int, int] | None:
    """``(major, minor)`` of a Slurm version string ("25.11.2" -> (25, 11)); None when it says none."""
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def successor_environment(environ: Mapping[str, str], predecessor: str) -> dict[str, str]:
    """The environment a successor job is submitted with.

    This job's SLURM_* variables are dropped (sbatch would otherwise read them as
    options and the successor would inherit a stale job id or restart count); the
    Slurm configuration and everything else, the checkpoint directory included, stays.
    """
    keep = {"SLURM_CONF"}
    env = {k: v for k, v in environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))
           or k in keep}
    for key in [k for k in env if k.startswith((BATCH_ARGS_PREFIX, LEGACY_BATCH_ARGS_PREFIX))]:
        del env[key]  # this job's arguments: the successor gets them on its command line
    generation = env_value("successor_generation", 0, environ)
    for name in ("PREDECESSOR_JOB_ID", "SUCCESSOR_GENERATION"):
        env.pop(f"HPCCKPT_{name}", None)  # the names older versions set
    env[internal_var("PREDECESSOR_JOB_ID")] = predecessor
    env[internal_var("SUCCESSOR_GENERATION")] = str(generation + 1)
    return env


# The templates export the batch script's arguments ("$@"): _HPCCKPT_BATCH_ARGS_JOB (the
# SLURM_JOB_ID they belong to), _HPCCKPT_BATCH_ARGC and _HPCCKPT_BATCH_ARG_1..N, one variable
# per argument, so any argument (blanks, quotes, newlines) comes back exactly. A job whose
# stored script came from an older template exports them without the leading underscore.
BATCH_ARGS_PREFIX = INTERNAL_PREFIX + "BATCH_ARG"  # _1.._N after it
LEGACY_BATCH_ARGS_PREFIX = "HPCCKPT_BATCH_ARG"


def batch_script_args(environ: Mapping[str, str], raw_job_id: str | None, *,
                      proc_root: Path = Path("/proc"), pid: int | None = None) -> list[str] | None:
    """The arguments the batch script was started with (what followed it on the sbatch
    command line), or None when they cannot be known.

    Slurm passes them again to a requeued job but shows them nowhere (``scontrol show job``'s
    Command is the script alone), so a successor must be given them. Read from what the
    templates export (above), else from the batch shell's command line in ``/proc``
    (``bash .../job<ID>/slurm_script ARGS...``) when this process descends from it."""
    var, job = internal_source("BATCH_ARGS_JOB", environ)
    if raw_job_id is not None and job == raw_job_id:
        prefix = BATCH_ARGS_PREFIX if var.startswith(INTERNAL_PREFIX) else LEGACY_BATCH_ARGS_PREFIX
        try:
            count = int(read_internal("BATCH_ARGC", environ) or "")
            return [environ[f"{prefix}_{i}"] for i in range(1, count + 1)]
        except (ValueError, KeyError):
            log.info("%s* are incomplete; reading the batch shell's command line instead", prefix)
    return _batch_shell_args(proc_root, os.getpid() if pid is None else pid)


def _batch_shell_args(proc_root: Path, pid: int) -> list[str] | None:
    # slurmstepd runs the stored script as <SlurmdSpoolDir>/job<ID>/slurm_script; only this
    # job's own batch shell can be above this process.
    for _ in range(64):  # up the process tree, at most this many parents
        try:
            cmdline = (proc_root / str(pid) / "cmdline").read_bytes()
            stat = (proc_root / str(pid) / "stat").read_text()
        except OSError:
            return None
        argv = [os.fsdecode(a) for a in cmdline.removesuffix(b"\0").split(b"\0")] if cmdline else []
        for i, arg in enumerate(argv[:4]):  # the script follows the interpreter and its options
            script = Path(arg)
            if script.name == "slurm_script" and script.parent.name.startswith("job"):
                return argv[i + 1:]
        parent = int(stat.rpartition(")")[2].split()[1])
        if parent <= 1:
            return None
        pid = parent
    return None


def _given(value: str | None) -> bool:
    return bool(value) and value not in {"(null)", "N/A", "None", "NONE", "*", "0", "Unknown"}


# `scontrol show job` key -> sbatch option: what the original allocation asked for.
_SAME_AS = {"JobName": "--job-name", "Partition": "--partition", "Account": "--account", "QOS": "--qos",
            "NumNodes": "--nodes", "NumTasks": "--ntasks", "CPUs/Task": "--cpus-per-task",
            "Features": "--constraint", "Comment": "--comment", "WorkDir": "--chdir",
            "StdOut": "--output", "StdErr": "--error", "Reservation": "--reservation",
            "Licenses": "--licenses", "ReqNodeList": "--nodelist", "ExcNodeList": "--exclude",
            "MailUser": "--mail-user", "MailType": "--mail-type", "TimeMin": "--time-min"}


def successor_sbatch_args(job: Mapping[str, str], script: Path, dependency_job_id: str,
                          script_args: Sequence[str] = ()) -> list[str]:
    """sbatch arguments that resubmit ``job`` (a ``show_job`` dict) as the same job after
    ``dependency_job_id``: every option of its allocation Slurm shows, for an array task
    its index (``--array=T``: ``SLURM_ARRAY_TASK_ID`` and ``%a`` stay the same), and the
    batch script's own arguments after the script (``batch_script_args``)."""
    args = ["sbatch", "--parsable", f"--dependency=afterany:{dependency_job_id}",
            "--export=ALL", "--open-mode=append"]
    for key, flag in _SAME_AS.items():
        value = job.get(key, "").strip()
        if _given(value):
            args.append(f"{flag}={_numeric(key, value)}")
    args += _memory_args(job) + _tres_args(job)
    limit = job.get("TimeLimit", "")
    if parse_duration_s(limit) is not None:
        args.append(f"--time={limit}")
    args.append("--requeue" if job.get("Requeue") == "1" else "--no-requeue")
    per_node = job.get("NtasksPerN:B:S:C", "0").split(":")[0]
    if _given(per_node):
        args.append(f"--ntasks-per-node={per_node}")
    if job.get("OverSubscribe") == "NO":
        args.append("--exclusive")
    if _given(job.get("StdIn")) and job.get("StdIn") != "/dev/null":
        args.append(f"--input={job['StdIn']}")
    if _given(job.get("ArrayTaskId")):
        args.append(f"--array={job['ArrayTaskId']}")
    args.append(str(script))
    return args + list(script_args)


def _numeric(key: str, value: str) -> str:
    # NumNodes may read "1-1" or "2"; a comment keeps its own text.
    return value.split("-")[0] if key == "NumNodes" else value


def _memory_args(job: Mapping[str, str]) -> list[str]:
    if _given(job.get("MinMemoryNode")):
        return [f"--mem={job['MinMemoryNode']}"]
    if _given(job.get("MinMemoryCPU")):
        return [f"--mem-per-cpu={job['MinMemoryCPU']}"]
    return []


def _tres_args(job: Mapping[str, str]) -> list[str]:
    """GRES/TRES requests (``TresPerNode=gres:gpu:1`` -> ``--gres=gpu:1``)."""
    out = []
    for key, flag in (("TresPerNode", "--gres"), ("TresPerTask", "--tres-per-task")):
        value = job.get(key, "")
        if _given(value):
            out.append(f"{flag}={','.join(p.removeprefix('gres:').removeprefix('gres/') for p in value.split(','))}")
    return out


def refine_cause(cause: str, job: Mapping[str, str] | None, restarts_before: int | None = None) -> str:
    """Slurm's own view of why the job must stop, when it knows better than the caller.

    A preemption sets ``PreemptTime`` and pulls ``EndTime`` in to now + GraceTime, so
    a job that noticed the moved end time ("deadline") was in truth preempted; a job
    Slurm timed out hit its limit; a job pending again that was not preempted was
    requeued by someone (``scontrol requeue``), whatever signal the job saw.
    """
    if job is None:
        return cause
    if job.get("PreemptTime", "None") not in {"None", "", "N/A", "Unknown"}:
        return Cause.PREEMPTION.value
    if job_state(job) == "PREEMPTED":
        return Cause.PREEMPTION.value
    if job_state(job) in {"TIMEOUT", "DEADLINE"} or job.get("Reason") == "TimeLimit":
        return Cause.TIME_LIMIT.value  # a job being ended shows COMPLETING, with the reason
    if job_state(job) == "NODE_FAIL":
        return Cause.NODE_FAILURE.value
    if cancelled(job, restarts_before):
        return Cause.USER_CANCEL.value
    requeued = job_state(job) in REQUEUED_STATES or (
        restarts_before is not None and requeue_evidence(job, restarts_before) is not None)
    if requeued and Cause.parse(cause) in {Cause.SIGNAL, Cause.UNKNOWN, Cause.TIME_LIMIT}:
        return Cause.OPERATOR_REQUEUE.value  # requeued while running, and not by a preemption
    if not requeued and Cause.parse(cause) is Cause.PREEMPTION and job_state(job) == "RUNNING":
        return Cause.TIME_LIMIT.value  # an end time pulled in with no preemption: a shortened limit
    return cause


# States in which Slurm will run the job again: it has been requeued (a PENDING record of
# the job we run in is a requeue, e.g. PreemptMode=REQUEUE or an operator's requeue).
REQUEUED_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})
CONFIRM_WAIT_S = 3.0  # how long a requeue Slurm accepted may take to show in its record


def cancelled(job: Mapping[str, str] | None, restarts_before: int | None) -> bool:
    """Whether Slurm's record says the job was cancelled (``scancel``, by its user or an
    operator) and will not run again. A cancelled job reads CANCELLED, or COMPLETING while its
    processes end (Slurm prints that flag before the state), with no preemption (PreemptTime),
    no time limit (Reason=TimeLimit) and no requeue (pending again, or more restarts than this
    run started with: ``scontrol requeue`` reads COMPLETING too, with Restarts one higher).
    Without the restart count a COMPLETING record cannot be told from a requeue: False."""
    if job is None:
        return False
    state = job_state(job)
    if state == "CANCELLED":
        return True
    if state != "COMPLETING" or restarts_before is None:
        return False
    if job.get("PreemptTime", "None") not in {"None", "", "N/A", "Unknown"}:
        return False
    if job.get("Reason", "None") not in {"None", ""}:
        return False
    return requeue_evidence(job, restarts_before) is None


def job_state(job: Mapping[str, str]) -> str:
    return job.get("JobState", "").split("+")[0].split()[0] if job.get("JobState") else ""


def requeue_evidence(job: Mapping[str, str] | None, restarts_before: int) -> str | None:
    """What in Slurm's record shows the job will run again, or None: pending again, or a
    restart count above the one this run started with. COMPLETING, PREEMPTED, TIMEOUT
    are no such evidence: they are how a job that will NOT run again looks too."""
    if job is None:
        return None
    if job_state(job) in REQUEUED_STATES:
        return f"JobState={job.get('JobState')}"
    try:
        restarts = int(job.get("Restarts", "0") or 0)
    except ValueError:
        return None
    return f"Restarts={restarts} (this run started as {restarts_before})" if restarts > restarts_before else None


class SlurmCli(ClusterBase):
    """Cluster backend over the Slurm command-line tools (the path that always works)."""

    name = "slurm-cli"
    remote = True

    def _job_id(self) -> str:
        job_id = self.env.job_id
        if job_id is None:
            raise ClusterError("SLURM_JOB_ID is not set: this process is not a Slurm job; "
                               "use the local backend (hpcckpt.cluster.detect()) outside Slurm")
        return job_id

    def stop_cause(self, cause: str) -> str:
        return refine_cause(cause, self._job_record(self._job_id()), self._restarts())

    def requeue_job(self, cause: str) -> RequeueOutcome:
        """Coordinator only, after the final checkpoint is durable. Decided from Slurm's record,
        never from a transient state: already pending again -> nothing to do; else ``scontrol
        requeue`` (this job ends within KillWait), confirmed by the record; when Slurm refuses
        or the requeue cannot be confirmed, a successor job (the same job, after this one)."""
        job_id, before = self._job_id(), self._restarts()
        cause = Cause.parse(cause).value
        evidence = requeue_evidence(self._job_record(job_id), before)
        if evidence is not None:
            return RequeueOutcome(requeued=True, method="slurm", cause=cause, job_id=job_id, evidence=evidence,
                                  detail=f"Slurm has requeued job {job_id} itself ({evidence})")
        try:
            run_slurm(["scontrol", "requeue", job_id])
            refusal = None
        except ClusterError as err:
            refusal = str(err)
        evidence = self._confirm(job_id, before)
        if evidence is not None:
            # The record did not show it requeued just before the call: it is this call's doing,
            # unless Slurm answered with a refusal (then Slurm requeued it meanwhile). An answer
            # that never came (a loaded controller) says nothing of the kind.
            ours = refusal is None or unanswered(refusal)
            lost = "" if refusal is None or not ours else f" (its answer was lost: {refusal})"
            return RequeueOutcome(requeued=True, method="scontrol" if ours else "slurm", cause=cause, job_id=job_id,
                                  evidence=evidence, detail=f"scontrol requeue {job_id}: confirmed, {evidence}{lost}")
        why = refusal or (f"scontrol requeue {job_id} was accepted but Slurm's record does not show the "
                          f"job pending again within {CONFIRM_WAIT_S:.0f}s")
        return self._successor_outcome(job_id, cause, why)

    def _restarts(self) -> int:
        try:
            return self.env.restart_count
        except Exception:  # noqa: BLE001 - a malformed SLURM_RESTART_COUNT: any higher count is news
            return 0

    def _confirm(self, job_id: str, before: int) -> str | None:
        deadline = time.monotonic() + CONFIRM_WAIT_S
        while True:
            evidence = requeue_evidence(self._job_record(job_id), before)
            if evidence is not None or time.monotonic() >= deadline:
                return evidence
            time.sleep(0.2)

    @staticmethod
    def _job_record(job_id: str) -> dict[str, str] | None:
        try:
            return show_job(job_id)
        except ClusterError as err:
            log.info("could not read job %s (%s)", job_id, err)
            return None

    def _successor_outcome(self, job_id: str, cause: str, why: str) -> RequeueOutcome:
        log.warning("job %s is not requeued (%s); submitting a successor", job_id, why)
        try:
            successor = self.submit_successor(dependency_job_id=job_id)
        except ClusterError as err:
            return RequeueOutcome(requeued=False, method="none", cause=cause, job_id=job_id,
                                  detail=f"{why}; submitting a successor failed too ({err}): resubmit the "
                                         "job by hand, it resumes from its last checkpoint")
        record = self._job_record(successor)
        if record is None:
            return RequeueOutcome(requeued=False, method="none", cause=cause, job_id=job_id,
                                  successor_job_id=successor,
                                  detail=f"{why}; sbatch answered {successor!r} but Slurm knows no such job")
        return RequeueOutcome(
            requeued=True, method="successor", cause=cause, job_id=job_id, successor_job_id=successor,
            evidence=f"job {successor} {record.get('JobState', '?')}",
            detail=f"requeue not possible ({why}); submitted successor job {successor} "
                   f"with --dependency=afterany:{job_id}")

    def submit_successor(self, *, dependency_job_id: str | None = None) -> str:
        """Coordinator only: the same job again, after this one: its stored batch script and its
        arguments, every option of its allocation, its array index, and this environment (minus SLURM_*).
        Returns the successor's id as Slurm names it (``A_T`` for an array task)."""
        job_id = self._job_id()
        after = dependency_job_id or job_id
        job = show_job(job_id, free_text=True)
        script = self._saved_batch_script(job_id, Path(job.get("WorkDir") or "."))
        script_args = batch_script_args(self.env.environ, self.env.raw_job_id)
        if script_args is None:
            log.warning("the arguments job %s's batch script was started with are unknown (no _HPCCKPT_BATCH_ARG* "
                        "as `hpcckpt template` scripts export, and no batch shell above this process): "
                        "the successor is submitted without any", job_id)
        args = successor_sbatch_args(job, script, after, script_args or ())
        out = run_slurm(args, environ=successor_environment(os.environ, job_id))
        successor = out.strip().split(";")[0]
        if _given(job.get("ArrayTaskId")):
            successor = f"{successor}_{job['ArrayTaskId']}"
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

    def grace_time_s(self) -> float | None:
        partition = self.env.partition
        if not partition:
            return None
        recs = parse_records(run_slurm(["scontrol", "show", "partition", "-o", partition]))
        value = recs[0].get("GraceTime", "") if recs else ""
        return float(value) if value.isdigit() else None
