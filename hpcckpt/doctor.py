"""``hpcckpt doctor``: checks that a job will survive its next warning, each a small function.

A check takes a ``DoctorContext`` and returns ``Check`` results. ``Check`` is the one
finding type of the project: other parts plug in their own checks through a module
exposing ``checks() -> list[Check]`` (e.g. ``hpcckpt.criu.doctor``) listed in
``PROVIDERS``; a plug-in that fails, or returns something else, is itself a finding.

The checks follow the job's mode (``DoctorContext.run_mode``: ``doctor --mode``, else the
script's ``hpcckpt run --mode``): in-process (the ``Checkpointer``), CRIU, or a script
that keeps its own checkpoints (``own``), each told only what applies to it.

``Trial`` runs a command for a few seconds the way a job would, without side effects: in
private PID + mount namespaces where its working directory and every directory its
arguments name are overlays whose writes land in a scratch directory (discarded), with
Slurm's commands that act on a job blocked; ending it ends every process it started.
``own_trial`` (``doctor --mode own -- CMD``) and ``hpcckpt.criu.doctor.trial`` use it.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcckpt.cluster.env import JobEnv
from hpcckpt.cluster.scontrol import parse_duration_s, parse_records, run_slurm, show_config
from hpcckpt.config import env_value, parse_signal, parse_signals
from hpcckpt.errors import ClusterError, ConfigError
from hpcckpt.exitcodes import EXIT_REQUEUE
from hpcckpt.proc import tree as proctree

log = logging.getLogger("hpcckpt.doctor")

# slurmctld checks --signal deadlines on a coarse tick (observed up to ~60 s late).
SIGNAL_TICK_S = 60.0
PROVIDERS = ("hpcckpt.criu.doctor",)


@dataclass(frozen=True, kw_only=True)
class Check:
    """One finding. ``level``: "ok" | "info" | "warn" | "fail"; ``fix`` says what to change."""

    name: str
    ok: bool
    detail: str
    fix: str = ""
    level: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def severity(self) -> str:
        return self.level or ("ok" if self.ok else "fail")

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "level": self.severity, "detail": self.detail,
                "fix": self.fix, **self.data}


@dataclass(frozen=True, kw_only=True)
class SignalSpec:
    """A parsed ``--signal=[{R|B}:]SIG[@TIME]``."""

    name: str
    lead_s: float
    batch_only: bool

    @classmethod
    def parse(cls, text: str) -> SignalSpec:
        """``--signal`` as sbatch reads it; a value sbatch or hpcckpt cannot use is a ConfigError."""
        flags, _, rest = text.rpartition(":")
        sig, _, lead = rest.partition("@")
        try:
            lead_s = float(lead or 60)
            name = parse_signal(sig).name.removeprefix("SIG")
        except (ValueError, ConfigError) as err:
            raise ConfigError(f"#SBATCH --signal={text} in the script is invalid: {err}; "
                              "e.g. #SBATCH --signal=B:USR2@180") from None
        if not math.isfinite(lead_s) or lead_s < 0:
            raise ConfigError(f"#SBATCH --signal={text}: the lead time must be seconds >= 0; "
                              "e.g. #SBATCH --signal=B:USR2@180")
        return cls(name=name, lead_s=lead_s, batch_only="B" in flags.upper())


@dataclass(frozen=True, kw_only=True)
class OwnSettings:
    """How ``hpcckpt run --mode own`` tells this script to stop (its ``--notice``, ``--lead-s``,
    ``--end-poll-s``, ``--requeue-on``)."""

    notice: str = "TERM"
    lead_s: float = 180.0
    end_poll_s: float = 10.0
    requeue_on: frozenset[int] = frozenset({EXIT_REQUEUE})

    @property
    def notice_signal(self) -> signal.Signals | None:
        """The notice's signal; None for a file notice (or one hpcckpt run would refuse)."""
        if self.notice.strip().lower().startswith("file"):
            return None
        try:
            return parse_signal(self.notice)
        except ConfigError:
            return None

    @property
    def notice_name(self) -> str:
        sig = self.notice_signal
        return sig.name.removeprefix("SIG") if sig is not None else self.notice


@dataclass(frozen=True, kw_only=True)
class DoctorContext:
    """What the checks look at; every part is optional (doctor runs on login nodes too).

    ``mode`` is ``doctor --mode`` (else the script's ``hpcckpt run --mode`` decides,
    ``run_mode``); ``notice``, ``lead_s``, ``requeue_on``: ``doctor --notice/--lead-s/--requeue-on``
    over the script's; ``save_s``: a save time the user knows (``--save-s``);
    ``own_exits_s``: how long the command took to exit after a notice, from the records
    in ``--dir``; ``trial_save_s``, ``notice_caught``, ``term_disposition``: what a trial saw."""

    script: Path | None = None
    script_text: str | None = None
    ckpt_dir: Path | None = None
    env: JobEnv = field(default_factory=JobEnv)
    save_costs_s: tuple[float, ...] = ()
    slurm_config: dict[str, str] | None = None
    partitions: tuple[dict[str, str], ...] = ()
    mode: str | None = None
    notice: str | None = None
    lead_s: float | None = None
    requeue_on: frozenset[int] | None = None
    save_s: float | None = None
    own_exits_s: tuple[float, ...] = ()
    trial_save_s: float | None = None
    notice_caught: bool | None = None
    term_disposition: str | None = None

    @property
    def signal(self) -> SignalSpec | None:
        value = sbatch_option(self.script_text or "", "signal")
        return SignalSpec.parse(value) if value else None

    @property
    def uses_srun(self) -> bool:
        return bool(re.search(r"^\s*[^#\n]*\bsrun\b", self.script_text or "", re.M))

    @property
    def worst_save_s(self) -> float | None:
        return max(self.save_costs_s) if self.save_costs_s else None

    @property
    def run_args(self) -> list[str] | None:
        return run_args(self.script_text or "")

    @property
    def run_mode(self) -> str | None:
        """The mode: "own", "criu", "app" (``hpcckpt run``), or None: in-process (``Checkpointer``)."""
        if self.mode:
            return self.mode
        words = self.run_args
        if words is None:
            return None
        return option_value(words, "mode") or "criu"  # hpcckpt run's default

    @property
    def own(self) -> OwnSettings:
        words = self.run_args or []
        notice = self.notice or option_value(words, "notice") or "TERM"
        lead = self.lead_s if self.lead_s is not None else _float(option_value(words, "lead-s"))
        if lead is None:
            spec = self.signal
            lead = spec.lead_s if spec is not None else 180.0
        poll = _float(option_value(words, "end-poll-s"))
        if poll is None:
            try:
                poll = float(env_value("poll_s", 10.0, self.env.environ))
            except (ConfigError, ValueError):
                poll = 10.0
        codes = self.requeue_on
        if codes is None:
            try:
                codes = frozenset(int(c) for c in (option_value(words, "requeue-on") or "75").split(",") if c.strip())
            except ValueError:
                codes = frozenset({EXIT_REQUEUE})
        return OwnSettings(notice=notice, lead_s=lead, end_poll_s=poll, requeue_on=codes)

    def own_save(self) -> tuple[float | None, str]:
        """The script's save time (really: from the notice to its exit) and where it comes from."""
        if self.save_s is not None:
            return self.save_s, "given (--save-s)"
        if self.trial_save_s is not None:
            return self.trial_save_s, "measured: the trial's command exited that long after its notice"
        if self.own_exits_s:
            return max(self.own_exits_s), "measured: the longest exit after a notice in the run's records (--dir)"
        return None, "not known"

    @property
    def env_nodes(self) -> int:
        """SLURM_JOB_NUM_NODES (or SLURM_NNODES) where doctor runs inside a job; 1 outside."""
        raw = self.env.environ.get("SLURM_NNODES", "")
        return max(self.env.num_nodes, int(raw) if raw.isdigit() else 1)

    @property
    def nodes(self) -> int:
        """The most nodes the job may get: the script's --nodes/-N, or SLURM_NNODES where doctor
        runs inside the job."""
        most = self.env_nodes
        text = sbatch_option(self.script_text or "", "nodes") or _short_nodes(self.script_text or "")
        if text:
            try:
                most = max(most, *(int(n) for n in re.findall(r"\d+", text.partition(":")[0])))
            except ValueError:
                pass
        return most


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def _short_nodes(script: str) -> str | None:
    """The last ``#SBATCH -N VALUE``."""
    found = None
    for line in script.splitlines():
        match = re.search(r"\s-N\s*(\S+)", line) if line.startswith("#SBATCH") else None
        if match:
            found = match.group(1)
    return found


def run_args(script: str) -> list[str] | None:
    """The options of the script's ``hpcckpt run`` (up to its ``--``), None when it has none."""
    match = re.search(r"^[^#\n]*\bhpcckpt(?:\.cli)?\s+run\b((?:[^\n]*\\\n)*[^\n]*)", script, re.M)
    if match is None:
        return None
    text = match.group(1).replace("\\\n", " ")
    try:
        words = shlex.split(text)
    except ValueError:
        words = text.split()
    return words[:words.index("--")] if "--" in words else words


def option_value(words: list[str], name: str) -> str | None:
    """The last ``--name VALUE`` or ``--name=VALUE`` in ``words``."""
    found = None
    for i, word in enumerate(words):
        if word == f"--{name}" and i + 1 < len(words):
            found = words[i + 1]
        elif word.startswith(f"--{name}="):
            found = word.partition("=")[2]
    return found


def sbatch_option(script: str, name: str) -> str | None:
    """The last ``#SBATCH --name=value`` (or ``--name value``) in ``script``; "" for flags."""
    found = None
    for line in script.splitlines():
        if not line.startswith("#SBATCH"):
            continue
        match = re.search(rf"--{re.escape(name)}(?:[= ]\s*(\S+))?(?:\s|$)", line)
        if match:
            found = (match.group(1) or "").strip('"')
    return found


def build_context(*, script: Path | None, ckpt_dir: Path | None, mode: str | None = None,
                  notice: str | None = None, lead_s: float | None = None, save_s: float | None = None,
                  requeue_on: frozenset[int] | None = None) -> DoctorContext:
    text = script.read_text(encoding="utf-8", errors="replace") if script else None
    costs: tuple[float, ...] = ()
    exits: tuple[float, ...] = ()
    if ckpt_dir is not None:
        from hpcckpt.lifecycle.ledger import Ledger

        events = list(Ledger(ckpt_dir).events())
        costs = tuple(float(e["save_s"]) for e in events
                      if e.get("event") == "commit" and isinstance(e.get("save_s"), (int, float)))
        exits = tuple(float(e["exit_after_notice_s"]) for e in events
                      if e.get("event") == "stop" and e.get("mode") == "own"
                      and isinstance(e.get("exit_after_notice_s"), (int, float)) and e.get("exit_code") != 0)
    config: dict[str, str] | None = None
    partitions: tuple[dict[str, str], ...] = ()
    if shutil.which("scontrol"):
        try:
            config = show_config()
            partitions = tuple(parse_records(run_slurm(["scontrol", "show", "partition", "-o"])))
        except ClusterError as err:
            log.info("Slurm not reachable: %s", err)
    return DoctorContext(script=script, script_text=text, ckpt_dir=ckpt_dir, save_costs_s=costs,
                         slurm_config=config, partitions=partitions, mode=mode, notice=notice, lead_s=lead_s,
                         save_s=save_s, requeue_on=requeue_on, own_exits_s=exits)


def check_slurm(ctx: DoctorContext) -> list[Check]:
    if ctx.slurm_config is None:
        return [Check(name="slurm", ok=True, level="info",
                      detail="no Slurm answered (scontrol show config); Slurm checks skipped",
                      fix="run doctor where scontrol works (login node or inside the job)")]
    version = ctx.slurm_config.get("SLURM_VERSION", "?")
    from hpcckpt.cluster.pyslurm_backend import probe

    _, reason = probe()
    return [Check(name="slurm", ok=True, detail=f"Slurm {version}; backend: {reason}")]


def check_job_requeue(ctx: DoctorContext) -> list[Check]:
    out = []
    if ctx.slurm_config is not None:
        enabled = ctx.slurm_config.get("JobRequeue", "1") == "1"
        out.append(Check(
            name="JobRequeue", ok=enabled, level="ok" if enabled else "warn",
            detail=f"slurm.conf JobRequeue={ctx.slurm_config.get('JobRequeue', '?')}",
            fix="" if enabled else ("jobs must ask for it: add `#SBATCH --requeue` (without it hpcckpt "
                                    "submits a successor job with --dependency=afterany instead)")))
    if ctx.script_text is not None:
        no_requeue = sbatch_option(ctx.script_text, "no-requeue") is not None
        requeue = sbatch_option(ctx.script_text, "requeue") is not None
        out.append(Check(
            name="--requeue", ok=requeue and not no_requeue, level="ok" if requeue and not no_requeue else "warn",
            detail=("script asks for --requeue" if requeue and not no_requeue else
                    "script has --no-requeue" if no_requeue else "script does not say --requeue"),
            fix="" if requeue and not no_requeue else
            "add `#SBATCH --requeue` and `#SBATCH --open-mode=append` (a refused requeue costs a successor job)"))
    return out


def check_requeue_permission(ctx: DoctorContext) -> list[Check]:
    job_id = ctx.env.job_id
    if job_id is None or ctx.slurm_config is None:
        return []
    try:
        job = parse_records(run_slurm(["scontrol", "show", "job", "-o", job_id]))[0]
    except (ClusterError, IndexError) as err:
        return [Check(name="requeue permission", ok=False, detail=f"cannot read job {job_id}: {err}")]
    owner = job.get("UserId", "").partition("(")[2].rstrip(")")
    mine = os.geteuid() == 0 or owner == str(os.geteuid())
    requeueable = job.get("Requeue") == "1"
    ok = mine and requeueable
    return [Check(name="requeue permission", ok=ok, level="ok" if ok else "warn",
                  detail=f"job {job_id}: owner uid {owner}, Requeue={job.get('Requeue')}",
                  fix="" if ok else "submit the job as yourself with --requeue; otherwise hpcckpt "
                                    "falls back to a successor job")]


def check_signal_lead(ctx: DoctorContext) -> list[Check]:
    if ctx.script_text is None or ctx.run_mode == "own":
        return []  # own mode: check_own_lead (the supervisor times the notice, not slurmctld's tick)
    spec, save = ctx.signal, ctx.worst_save_s
    if spec is None:
        return [Check(name="--signal", ok=False, level="warn",
                      detail="no --signal: the job gets no warning before its time limit "
                             "(hpcckpt still polls the end time from Slurm)",
                      fix="add `#SBATCH --signal=B:USR2@180` (or without B: when ranks run under srun)")]
    need = (save or 10.0) * 2 + SIGNAL_TICK_S
    ok = spec.lead_s >= need
    basis = f"measured save cost {save:.1f}s" if save is not None else "no measured save cost yet (assumed 10 s)"
    return [Check(name="signal lead time", ok=ok, level="ok" if ok else "warn",
                  detail=f"--signal lead {spec.lead_s:.0f}s; {basis}; slurmctld may signal up to "
                         f"{SIGNAL_TICK_S:.0f}s late",
                  fix="" if ok else f"raise the lead: --signal={'B:' if spec.batch_only else ''}"
                                    f"{spec.name}@{int(need + 0.999)}")]


def check_signal_delivery(ctx: DoctorContext) -> list[Check]:
    spec = ctx.signal
    if spec is None or ctx.script_text is None:
        return []
    if spec.batch_only and ctx.uses_srun and "trap" not in ctx.script_text:
        return [Check(name="B: vs step delivery", ok=False,
                      detail="--signal=B: reaches only the batch shell, but training runs under srun "
                             "and the script does not forward the signal",
                      fix=f"drop B: (--signal={spec.name}@{spec.lead_s:.0f}) so every rank gets it, "
                          "or trap and forward it to srun (hpcckpt template ddp)")]
    if not spec.batch_only and not ctx.uses_srun:
        return [Check(name="B: vs step delivery", ok=False,
                      detail="--signal without B: goes to job steps only, and this script starts none "
                             "(no srun): the training process never hears the warning",
                      fix=f"use --signal=B:{spec.name}@{spec.lead_s:.0f} and `exec` the training "
                          "command (hpcckpt template single)")]
    mode = "batch shell (B:)" if spec.batch_only else "every task of every job step"
    return [Check(name="B: vs step delivery", ok=True, detail=f"signal goes to the {mode}; matches the launcher")]


def check_signal_choice(ctx: DoctorContext) -> list[Check]:
    spec = ctx.signal
    if spec is None or ctx.run_mode == "own":
        return []  # own mode: the warning stays with the supervisor; the script hears the notice
    out = []
    if spec.name == "USR1":
        out.append(Check(name="NCCL/USR1", ok=False, level="warn",
                         detail="USR1 is the warning signal; NCCL (and some MPI stacks) install USR1 "
                                "handlers that can swallow or misread it",
                         fix=f"use USR2: --signal={'B:' if spec.batch_only else ''}USR2@{spec.lead_s:.0f} "
                             "and HPCCKPT_SIGNALS=SIGUSR2,SIGTERM"))
    handled = os.environ.get("HPCCKPT_SIGNALS") or (
        re.search(r"HPCCKPT_SIGNALS=\"?([A-Za-z0-9,]+)", ctx.script_text or "") or [None, None])[1]
    try:
        names = {s.name.removeprefix("SIG") for s in parse_signals(handled or "SIGUSR2,SIGTERM")}
    except ConfigError as err:
        return [*out, Check(name="HPCCKPT_SIGNALS", ok=False, detail=f"HPCCKPT_SIGNALS={handled!r}: {err}",
                            fix="set HPCCKPT_SIGNALS=SIGUSR2,SIGTERM (match the script's --signal)")]
    ok = spec.name in names
    out.append(Check(name="signal handled", ok=ok,
                     detail=f"--signal sends {spec.name}; hpcckpt listens for {', '.join(sorted(names))}",
                     fix="" if ok else f"set HPCCKPT_SIGNALS=SIG{spec.name},SIGTERM"))
    return out


def notice_s(ctx: DoctorContext, grace_s: float | None = None) -> tuple[float, str]:
    """How late a GraceTime preemption may be noticed, and why: 0 when it sends the job's
    --signal (``send_user_signal``), else one read of the end time (``HPCCKPT_POLL_S``, 15 s;
    the CRIU and own-checkpoint supervisors: ``--end-poll-s``, by default HPCCKPT_POLL_S or
    10 s, at most a third of the partition's GraceTime)."""
    if ctx.slurm_config is not None and sends_user_signal(ctx.slurm_config):
        return 0.0, "its start sends the --signal"
    supervised = ctx.run_mode in ("criu", "own")
    words = ctx.run_args or []
    flag = _float(option_value(words, "end-poll-s")) if supervised else None
    try:
        poll = flag if flag is not None else float(env_value("poll_s", 10.0 if supervised else 15.0, ctx.env.environ))
    except (ConfigError, ValueError):
        poll = 10.0 if supervised else 15.0  # the bad setting is the job's own error, with its fix
    what = "--end-poll-s" if flag is not None or supervised else "HPCCKPT_POLL_S"
    if supervised and poll == 0:
        return math.inf, f"nothing reads the end time ({what}=0): a preemption is heard only at Slurm's TERM"
    if supervised and grace_s and grace_s / 3 < poll:
        poll = max(1.0, grace_s / 3)  # what the supervisors do (a third of the grace)
        return poll, f"it is noticed at the next read of the end time (every {poll:.1f}s: a third of the GraceTime)"
    return poll, f"it is noticed at the next read of the end time ({what}={poll:g}s)"


def kill_wait_s(ctx: DoctorContext) -> float | None:
    """slurm.conf KillWait (``30 sec``): from Slurm's TERM to its KILL."""
    match = re.match(r"\s*(\d+)", (ctx.slurm_config or {}).get("KillWait", ""))
    return float(match.group(1)) if match else None


def check_grace_time(ctx: DoctorContext) -> list[Check]:
    """GraceTime against what a preemption needs: being noticed (``notice_s``), then the
    final save (x1.5) and the requeue."""
    if ctx.run_mode == "own":
        return _own_grace_time(ctx)
    out = []
    save = ctx.worst_save_s or 10.0
    after = save * 1.5 + 2  # from the notice: the final save and the requeue
    criu = ctx.run_mode == "criu"
    for part in ctx.partitions:
        mode = part.get("PreemptMode", "OFF").upper()
        if mode in {"OFF", ""} or part.get("PriorityTier") is None:
            continue
        raw = part.get("GraceTime", "0")
        # Partitions print GraceTime in plain seconds; a clock form is read as a duration.
        grace = float(raw) if raw.isdigit() else (parse_duration_s(raw) or 0.0)
        notice, how = notice_s(ctx, grace)
        need = notice + after
        ok = grace >= need
        fixes = [f"ask the admins for GraceTime>={int(need + 1)} on this partition"]
        if 0 < notice < math.inf and grace >= after + 0.5:
            fixes.insert(0, f"read the end time more often: HPCCKPT_POLL_S={max(0.5, int(grace - after)):g} "
                            "(or fewer) in the job's environment" + (", or --end-poll-s" if criu else ""))
        fixes.append("take periodic images (`hpcckpt run --mode criu --dump-every SECONDS`) so little is lost"
                     if criu else "checkpoint more often (every_steps) so little is lost")
        out.append(Check(
            name=f"GraceTime {part.get('PartitionName')}", ok=ok, level="ok" if ok else "warn",
            detail=f"partition {part.get('PartitionName')}: PreemptMode={mode}, GraceTime={grace:.0f}s; a "
                   f"preemption needs ~{need:.0f}s: {how}, then the final save (~{save:.1f}s, x1.5) and the requeue",
            fix="" if ok else "; or ".join(fixes)))
    return out


def _grace_s(part: dict[str, str]) -> float | None:
    """A preemptable partition's GraceTime (seconds); None for one that is not preempted."""
    mode = part.get("PreemptMode", "OFF").upper()
    if mode in {"OFF", ""} or part.get("PriorityTier") is None:
        return None
    raw = part.get("GraceTime", "0")
    return float(raw) if raw.isdigit() else (parse_duration_s(raw) or 0.0)


def _own_grace_time(ctx: DoctorContext) -> list[Check]:
    """Own checkpoints: the supervisor's notice comes at the next read of the end time; the
    script's save must fit what is left of the grace, plus KillWait when Slurm's TERM does not
    end it (it catches or ignores TERM): at the grace's end TERM reaches every process."""
    out = []
    own = ctx.own
    save, basis = ctx.own_save()
    kill_wait = kill_wait_s(ctx)
    term = ctx.term_disposition or ("caught" if own.notice_name == "TERM" else None)
    survives_term = term in ("caught", "ignored")
    kill = f"KILL KillWait={kill_wait:.0f}s later" if kill_wait is not None else "KILL KillWait later"
    term_note = (f"the script {'catches' if term == 'caught' else 'ignores'} TERM, so its save may run on until "
                 "the KILL" if survives_term
                 else "TERM ends the script at once (it has no handler)" if term == "default"
                 else "whether TERM ends the script is not known (a trial tells: doctor --mode own -- CMD)")
    for part in ctx.partitions:
        grace = _grace_s(part)
        if grace is None:
            continue
        name = part.get("PartitionName")
        if part.get("PreemptMode", "").upper().startswith("CANCEL"):
            out.append(Check(name=f"GraceTime {name}", ok=True, level="info",
                             detail=f"partition {name}: PreemptMode=CANCEL: a preemption there cancels the job "
                                    f"(after GraceTime={grace:.0f}s); it is not requeued, whatever the script saves"))
            continue
        notice, how = notice_s(ctx, grace) if grace > 0 else (0.0, "")
        left = max(0.0, grace - notice)
        head = (f"partition {name}: GraceTime={grace:.0f}s; {how}, and the notice ({own.notice_name}) leaves the script "
                f"~{left:.0f}s of the grace for its save; then Slurm's TERM reaches it, and {kill}: {term_note}"
                if grace > 0 else
                f"partition {name}: GraceTime=0s: no notice comes before Slurm's TERM (the supervisor's "
                f"{own.notice_name} follows it at once), and {kill}: {term_note}")
        if save is None:
            out.append(Check(name=f"GraceTime {name}", ok=True, level="info",
                             detail=f"{head}. Its save time is {basis}",
                             fix="measure it: hpcckpt doctor --mode own -- CMD (a trial that sends the notice), or "
                                 "--save-s"))
            continue
        need = save * 1.5 + 2
        avail = left + (kill_wait if (survives_term and kill_wait is not None) else 0.0)
        ok = avail >= need
        grace_needed = min(need + own.end_poll_s, need * 1.5) if own.end_poll_s > 0 else need
        fixes = [f"ask the admins for GraceTime>={math.ceil(grace_needed)} on partition {name}",
                 "make the save on the notice shorter, or save more often in the script so a stop loses less"]
        if not survives_term and kill_wait:
            fixes.insert(0, f"let the script catch TERM too (a handler that lets its save finish: KillWait="
                            f"{kill_wait:.0f}s more)")
        out.append(Check(
            name=f"GraceTime {name}", ok=ok, level="ok" if ok else "warn",
            detail=f"{head}; its save and exit take ~{save:.1f}s ({basis}), x1.5: ~{avail:.0f}s for ~{need:.0f}s",
            fix="" if ok else "; or ".join(fixes)))
    return out


def protected_symlinks(ctx: DoctorContext, proc: Path = Path("/proc/sys/fs")) -> list[Check]:
    """fs.protected_symlinks (and _regular, _fifos): the kernel's guard for root's hooks in a
    shared sticky staging root; the hooks do not rely on it, but it is a second line."""
    values: dict[str, str] = {}
    for name in ("protected_symlinks", "protected_regular", "protected_fifos"):
        try:
            values[name] = (proc / name).read_text().strip()
        except OSError:
            values[name] = "unknown"
    ok = values["protected_symlinks"] == "1"
    return [Check(name="fs.protected_symlinks", ok=ok, level="ok" if ok else "warn",
                  detail=", ".join(f"fs.{k}={v}" for k, v in values.items()),
                  fix="" if ok else "ask the admins for sysctl fs.protected_symlinks=1 (and protected_regular=2, "
                                    "protected_fifos=2) on nodes whose staging root is a shared sticky directory",
                  data={"sysctl": values})]


def slurm_version(ctx: DoctorContext) -> tuple[int, int] | None:
    from .cluster.scontrol import major_minor
    return major_minor((ctx.slurm_config or {}).get("SLURM_VERSION"))


def sends_user_signal(config: dict[str, str]) -> bool:
    """``PreemptParameters=send_user_signal`` (Slurm >= 23.02), or its older spelling
    ``SchedulerParameters=preempt_send_user_signal`` (22.05 and before)."""
    return ("send_user_signal" in config.get("PreemptParameters", "").split(",")
            or "preempt_send_user_signal" in config.get("SchedulerParameters", "").split(","))


def check_preempt_signal(ctx: DoctorContext) -> list[Check]:
    """What a GraceTime preemption sends, and what that means for each mode."""
    if ctx.slurm_config is None:
        return []
    kill_wait = ctx.slurm_config.get("KillWait", "?")
    on = sends_user_signal(ctx.slurm_config)
    mode = ctx.run_mode
    said = ("PreemptParameters=send_user_signal is set: a GraceTime preemption sends the job's --signal at its "
            "start" if on else
            "PreemptParameters=send_user_signal is not set: a GraceTime preemption sends nothing at its start, "
            "it only pulls the job's end time in")
    modes = {
        None: ("In-process (Checkpointer, --mode app): the job stops at the next step on the --signal, on the moved "
               "end time (read every HPCCKPT_POLL_S, 15 s) or on TERM, and its final save must fit GraceTime."),
        "criu": ("CRIU (--mode criu): the supervisor dumps on the --signal, on the moved end time (read every "
                 "--end-poll-s, at most a third of the GraceTime) or on TERM (the job starts with TERM ignored; "
                 f"a dump that starts at TERM must fit KillWait={kill_wait} s). A job that catches TERM itself, or "
                 "has processes that die of it, hears that TERM too: no image is made of it, and its own end "
                 "decides (exit 75 after its own save: requeued, it resumes from that save; otherwise requeued "
                 "from the newest committed image)."),
        "own": ("Own checkpoints (--mode own): the supervisor sends the script its notice on the --signal, on the "
                "moved end time (read every --end-poll-s, at most a third of the GraceTime) or at the lead before "
                "the time limit, and the script's own save must fit what is left of the grace; Slurm's TERM "
                f"reaches the script too, and a script that catches it has KillWait={kill_wait} more."),
    }
    modes["app"] = modes[None]
    known = ctx.mode is not None or bool(ctx.script_text)  # else: say what each mode does
    told = modes[mode] if known and mode in modes else " ".join(modes[m] for m in (None, "criu", "own"))
    detail = (f"{said}; at the grace's end (and at the time limit) every process gets TERM, then KILL "
              f"KillWait={kill_wait} later. {told}")
    return [Check(name="preemption signal", ok=True, level="ok" if on else "info", detail=detail,
                  fix="" if on else "ask the admins for PreemptParameters=send_user_signal (Slurm 22.05: "
                                    "SchedulerParameters=preempt_send_user_signal); hpcckpt works without it",
                  data={"send_user_signal": on})]


def check_requeue_expedite(ctx: DoctorContext) -> list[Check]:
    version = slurm_version(ctx)
    if version is None:
        return []
    ok = version >= (25, 11)
    return [Check(name="--requeue=expedite", ok=True, level="ok" if ok else "info",
                  detail=(f"Slurm {version[0]}.{version[1]} " + ("supports --requeue=expedite (a requeued job "
                          "starts again first)" if ok else "has no --requeue=expedite (25.11+); templates use "
                          "plain --requeue")),
                  data={"expedite": ok})]


def check_criu_script(ctx: DoctorContext) -> list[Check]:
    """A CRIU-mode batch script must dump on TERM: that is what a preemption sends."""
    text = ctx.script_text or ""
    match = re.search(r"hpcckpt(?:\.cli)?\s+run\b[^\n]*(?:\\\n[^\n]*)*", text)
    if match is None or ctx.run_mode != "criu":
        return []
    sig = re.search(r"--signal[= ]\s*\"?(?:\$\{[A-Z_]+:-)?([A-Z0-9,]+)", match.group(0))
    names = {n.removeprefix("SIG") for n in (sig.group(1).split(",") if sig else ["USR2", "TERM"])}
    ok = "TERM" in names
    return [Check(name="criu dump signals", ok=ok, level="ok" if ok else "warn",
                  detail=f"hpcckpt run --mode criu dumps on {','.join(sorted(names))}",
                  fix="" if ok else "add TERM: `--signal USR2,TERM` (a preemption and the time limit send TERM; "
                                    "without it the job is lost at a preemption)")]


def check_own_notice(ctx: DoctorContext) -> list[Check]:
    """Own checkpoints: how the script hears the stop, and whether it listens (a trial's SigCgt)."""
    if ctx.run_mode != "own":
        return []
    own = ctx.own
    sig = own.notice_signal
    if sig is None and not own.notice.strip().lower().startswith("file"):
        return [Check(name="own notice", ok=False,
                      detail=f"--notice {own.notice!r} is neither a signal nor file[:PATH]: hpcckpt run refuses it",
                      fix="--notice TERM (or USR1, USR2, INT; or file[:PATH] for a script that polls a file)")]
    if sig is None:
        return [Check(name="own notice", ok=True, level="info",
                      detail=f"the script hears the stop as a file (--notice {own.notice}): it must poll HPCCKPT_NOTICE_FILE "
                             "(hpcckpt.own.should_stop() does) between steps, save, and exit "
                             f"{','.join(map(str, sorted(own.requeue_on)))}",
                      fix="")]
    name = own.notice_name
    if ctx.notice_caught is None:
        return [Check(name="own notice", ok=True, level="info",
                      detail=f"the script hears the stop as {name} (--notice): only its processes that catch {name} "
                             "are sent it (a process without a handler would die of it), so a script with no "
                             f"{name} handler gets no notice and loses what it trained since its last save",
                      fix=f"see whether it catches {name}: hpcckpt doctor --mode own -- CMD")]
    return [Check(name="own notice", ok=ctx.notice_caught, level="ok" if ctx.notice_caught else "warn",
                  detail=(f"the script catches {name}, its notice" if ctx.notice_caught else
                          f"no process of the command catches {name}, its notice: the supervisor sends it none, and "
                          "it trains on until Slurm ends it, then comes back from its own last save"),
                  fix="" if ctx.notice_caught else
                  f"give the script a {name} handler that saves and exits 75 (or call hpcckpt.own.should_stop() "
                  "at each step), or name the signal it does catch: --notice")]


def check_own_lead(ctx: DoctorContext) -> list[Check]:
    """Own checkpoints: the notice's lead against the script's save (from the notice to its exit)."""
    if ctx.run_mode != "own":
        return []
    own = ctx.own
    late = own.end_poll_s if own.end_poll_s > 0 else SIGNAL_TICK_S
    how_late = (f"at most {late:g}s late (one read of the end time, --end-poll-s)" if own.end_poll_s > 0 else
                f"from the --signal alone (--end-poll-s 0), which slurmctld may send up to {late:.0f}s late")
    limit = parse_duration_s(sbatch_option(ctx.script_text or "", "time") or "") if ctx.script_text else None
    lead = own.lead_s if not limit else min(own.lead_s, limit / 4)
    capped = f" (a quarter of --time; --lead-s is {own.lead_s:g})" if lead < own.lead_s else ""
    save, basis = ctx.own_save()
    if save is None:
        return [Check(name="own notice lead", ok=True, level="info",
                      detail=f"the notice comes {lead:.0f}s before the end{capped}, {how_late}; the script's save "
                             "is not known: the lead must cover its save, its exit, and the time to reach the point "
                             "where it checks for the notice (a step, or an epoch's end)",
                      fix="measure it: hpcckpt doctor --mode own -- CMD (sends the notice in a trial and times the "
                          "exit), or --dir RUN/hpcckpt after a run, or tell it: --save-s SECONDS")]
    need = 2 * save + late
    ok = lead >= need
    fixes = [f"raise the lead: LEAD_S={math.ceil(need)} (hpcckpt template own), i.e. #SBATCH "
             f"--signal=B:USR2@{math.ceil(need)} and hpcckpt run --lead-s {math.ceil(need)}"]
    if capped:
        fixes.append("a longer --time (the lead is at most a quarter of the allocation)")
    return [Check(name="own notice lead", ok=ok, level="ok" if ok else "warn",
                  detail=f"the notice comes {lead:.0f}s before the end{capped}, {how_late}; the script's save and "
                         f"exit take {save:.1f}s ({basis}); it needs ~{need:.0f}s (twice that, plus the late read)",
                  fix="" if ok else "; or ".join(fixes))]


def check_criu_nodes(ctx: DoctorContext) -> list[Check]:
    """CRIU mode takes one node: the supervisor runs a job on several untouched (no image)."""
    if ctx.run_mode != "criu":
        return []
    nodes = ctx.nodes
    if nodes <= 1:
        return []
    from hpcckpt.criu.options import multi_node_refusal

    where = "SLURM_NNODES" if ctx.env_nodes > 1 else "the script's --nodes"
    return [Check(name="criu one node", ok=False,
                  detail=f"{where}: {multi_node_refusal(nodes)}; hpcckpt run --mode criu runs such a job untouched "
                         "and makes no image: a stop loses what it did since its own last save, if it keeps one",
                  fix="#SBATCH --nodes=1 for CRIU mode, or hpcckpt template ddp / torchrun with the Checkpointer")]


CHECKS: list[Callable[[DoctorContext], list[Check]]] = [
    check_slurm, check_job_requeue, check_requeue_permission, check_criu_nodes, check_signal_lead,
    check_signal_delivery, check_signal_choice, check_own_notice, check_own_lead, check_grace_time,
    check_preempt_signal, check_requeue_expedite, check_criu_script, protected_symlinks,
]


def plugin_checks(providers: Iterable[str] = PROVIDERS) -> list[Check]:
    out: list[Check] = []
    for name in providers:
        try:
            found = list(importlib.import_module(name).checks())
        except Exception as err:  # a broken plug-in is itself a finding, not a crash
            out.append(Check(name=name, ok=False, level="warn", detail=f"could not run its checks: {err}"))
            continue
        for item in found:
            out.append(item if isinstance(item, Check) else Check(
                name=name, ok=False, level="warn",
                detail=f"returned a {type(item).__name__}, not an hpcckpt.doctor.Check: {item!r}"))
    return out


def run_checks(ctx: DoctorContext, *, plugins: bool = True) -> list[Check]:
    results = [c for check in CHECKS for c in check(ctx)]
    # A script with its own checkpoints needs no criu: its checks would only be noise (or a failure).
    providers = tuple(p for p in PROVIDERS if not (ctx.run_mode == "own" and p == "hpcckpt.criu.doctor"))
    return results + (plugin_checks(providers) if plugins else [])


# -- Trials: the command run for a few seconds, with no effect on the real job -------------------

class TrialRefused(Exception):
    """A trial doctor would not (or could not) run without side effects; nothing was started."""


# Where a command's writes are never redirected (and where a working directory is refused).
SYSTEM_DIRS = ("/proc", "/sys", "/dev", "/run", "/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64",
               "/libx32", "/boot", "/var/run", "/var/lock", "/snap")
# Mounts under a redirected directory that are shown as they are (bound back), never overlaid.
PSEUDO_FS = frozenset({"proc", "sysfs", "devpts", "devtmpfs", "cgroup", "cgroup2", "autofs", "mqueue", "bpf",
                       "tracefs", "debugfs", "securityfs", "pstore", "fusectl", "configfs", "hugetlbfs",
                       "binfmt_misc", "nsfs", "efivarfs", "rpc_pipefs", "nfsd"})
# Filesystems an overlay's upper layer cannot live on (the trial's scratch goes elsewhere).
NO_UPPER_FS = ("overlay", "nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "fuse", "9p", "beegfs", "ceph")
# Slurm commands that act on a job: blocked in a trial (a script's own handler may requeue itself).
SLURM_SHIMS = ("scontrol", "scancel", "sbatch")
SCONTROL_ACTIONS = ("requeue", "requeuehold", "update", "hold", "uhold", "release", "suspend", "resume", "notify",
                    "reboot", "shutdown", "reconfigure", "create", "delete", "takeover", "top", "cancel_reboot")
# Launchers whose work runs elsewhere: killed, they leave it running there (an allocation
# and its step on every node until the time limit); sent TERM, they cancel it and return.
REMOTE_LAUNCHERS = ("srun", "salloc")
LAUNCHERS_END_S = 20.0  # srun waits for its step's tasks (KillWait, then a few seconds) before it returns
START_S = 30.0  # how long the namespaces and the overlays may take to be ready

# PID 2 of the trial's namespaces, before the command: opens every layer (as O_PATH fds, so a
# later overlay cannot hide one), mounts an overlay on each redirected directory (parents
# first; pseudo filesystems below them bound back as they are), enters the working directory
# again (now the overlay), says "ok" or why not in the status file, and exec's the command.
_SANDBOX_INIT = r'''
import ctypes, json, os, signal, sys
spec = json.loads(sys.argv[1])
cmd = sys.argv[3:]
status = os.open(spec["status"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
libc = ctypes.CDLL(None, use_errno=True)

def mount(src, target, fstype, flags, data):
    if libc.mount(src.encode(), target.encode(), fstype.encode(), ctypes.c_ulong(flags),
                  data.encode() if data else None):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)

try:
    held = [(m, [os.open(m[k], os.O_PATH | os.O_DIRECTORY) for k in ("lower", "upper", "work") if k in m])
            for m in spec["mounts"]]
    for m, fds in held:
        paths = ["/proc/self/fd/%d" % fd for fd in fds]
        if m["kind"] == "bind":
            mount(paths[0], m["target"], "", 4096 | 16384, None)  # MS_BIND | MS_REC
            continue
        data = "lowerdir=%s,upperdir=%s,workdir=%s" % tuple(paths)
        try:
            mount("overlay", m["target"], "overlay", 0, data)
        except OSError as first:
            try:
                mount("overlay", m["target"], "overlay", 0, data + ",userxattr")  # in a user namespace
            except OSError:
                raise first
    os.chdir(spec["cwd"])
except OSError as exc:
    os.write(status, ("failed %s\n" % exc).encode())
    os._exit(126)
os.write(status, b"ok\n")
os.close(status)
for name in spec["default"]:
    signal.signal(getattr(signal, name), signal.SIG_DFL)
try:
    os.execvp(cmd[0], cmd)
except OSError as exc:
    sys.stderr.write("hpcckpt doctor: cannot run %r: %s\n" % (cmd[0], exc))
    os._exit(127)
'''


def _unescape(text: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def mount_table(path: Path = Path("/proc/self/mountinfo")) -> list[tuple[str, str]]:
    """(mount point, filesystem type) of every mount, in mount order."""
    out = []
    for line in path.read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) > 4 and right:
            out.append((_unescape(fields[4]), right.split()[0]))
    return out


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _fs_of(path: str, table: list[tuple[str, str]]) -> str:
    best, fstype = "", ""
    for point, kind in table:
        if _under(path, point) and len(point) >= len(best):
            best, fstype = point, kind
    return fstype


def _excluded(path: str, program: str | None) -> bool:
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    return (path == "/" or any(_under(path, d) for d in SYSTEM_DIRS)
            or any(_under(path, p) for p in prefixes if p and p != "/")
            or (program is not None and path == program))


def _named_paths(cmd: list[str], env: Mapping[str, str], cwd: str) -> list[str]:
    """Paths the command names outside its working directory: its arguments (``/x``,
    ``../x``, ``--opt=/x``) and the run directory of the job's environment."""
    out = []
    for word in cmd[1:]:
        for part in dict.fromkeys((word, word.rpartition("=")[2])):
            if part.startswith("/") or part.startswith("../") or part == "..":
                path = os.path.normpath(os.path.join(cwd, part))
                if not _under(path, cwd):
                    out.append(path)
                break
    out += [env[k] for k in ("HPCCKPT_RUN_DIR", "HPCCKPT_DIR") if env.get(k, "").startswith("/")]
    return out


def _existing_dir(path: str) -> str:
    """``path`` if it is a directory, its directory if it is a file, else its nearest existing ancestor."""
    p = Path(os.path.realpath(path))
    if p.is_dir():
        return str(p)
    if p.exists():
        return str(p.parent)
    while not p.exists():
        p = p.parent
    return str(p)


def redirected_dirs(cmd: list[str], cwd: Path, env: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(directories a trial redirects, named paths it cannot redirect): the working directory
    and the directory of every path the command names, outermost only. System and Python
    directories are left alone (a command does not write there); a path whose only existing
    parent is / cannot be redirected (an overlay on / is not made)."""
    here = os.path.realpath(cwd)
    if _excluded(here, None):
        raise TrialRefused(f"the working directory {here} is a system directory: run doctor from the job's own "
                           "working directory")
    program = shutil.which(cmd[0], path=env.get("PATH")) if cmd else None
    program_dir = os.path.dirname(os.path.realpath(program)) if program else None
    chosen, left = [here], []
    for path in _named_paths(cmd, env, here):
        d = _existing_dir(path)
        if d == "/":
            left.append(path)
        elif not _excluded(d, program_dir):
            chosen.append(d)
    outermost: list[str] = []
    for d in sorted(set(chosen), key=lambda x: (x.count("/"), x)):
        if not any(_under(d, top) for top in outermost):
            outermost.append(d)
    return outermost, left


def end_launchers(init_pid: int, *, wait_s: float = LAUNCHERS_END_S) -> list[int]:
    """TERM to every remote launcher of a trial (``srun``, ``salloc``), and wait for them to
    return (bounded) before its namespace is killed; returns the pids sent TERM. Nothing else
    of the trial is signalled here."""
    sent = []
    for pid in proctree.tree(init_pid)[1:]:
        if proctree.status_field(pid, "Name") in REMOTE_LAUNCHERS:
            try:
                os.kill(pid, signal.SIGTERM)
                sent.append(pid)
            except ProcessLookupError:
                continue
    deadline = time.monotonic() + wait_s
    while any(proctree.alive(pid) for pid in sent) and time.monotonic() < deadline:
        time.sleep(0.2)
    return sent


def _shim(name: str, real: str | None, calls: Path) -> str:
    blocked = "blocked=1" if name != "scontrol" else (
        'blocked=\nfor a in "$@"; do case "$a" in ' + "|".join(SCONTROL_ACTIONS) + ") blocked=1;; esac; done")
    run_real = f'exec {shlex.quote(real)} "$@"' if real else f'echo "{name}: not found" >&2; exit 127'
    return (f"#!/bin/sh\n# hpcckpt doctor: during a trial Slurm is asked, never told to act on a job\n{blocked}\n"
            f'if [ -n "$blocked" ]; then\n'
            f'    printf "%s\\n" "{name} $*" >> {shlex.quote(str(calls))}\n'
            f'    echo "hpcckpt doctor: \'{name} $*\' is not run during a trial" >&2\n    exit 1\nfi\n{run_real}\n')


def _rmtree(path: Path) -> None:
    def retry(func: Callable[..., Any], name: str, _exc: Any) -> None:
        try:
            os.chmod(os.path.dirname(name), 0o700)
            os.chmod(name, 0o700)
        except OSError:
            pass
        try:
            func(name)
        except OSError:
            pass

    shutil.rmtree(path, onerror=retry)  # an overlay's work directory is left mode 000


class Trial:
    """``cmd`` run as PID 2 of private PID + mount namespaces (a user namespace too when not
    root), under hpcckpt's nsinit as CRIU mode starts a job, with no effect on the real job:

    - its working directory and the directory of every path it names are overlays there:
      what it writes (appends to a log, checkpoints) lands in a scratch directory that is
      removed at the end, and the real files stay as they were;
    - ``scontrol`` (acting verbs), ``scancel`` and ``sbatch`` are shims that refuse and note
      the call (a script's own handler may requeue its job);
    - ``end()`` ends every process it started: remote launchers (srun, salloc) get TERM and
      time to give their allocation back, then the namespace's init is killed.

    ``ignore``: signals the command starts with ignored (CRIU mode: USR2, TERM);
    ``restore_signals``: start it with SIGPIPE and SIGXFSZ at their defaults, as
    ``subprocess`` starts a command (the own-checkpoint supervisor does)."""

    def __init__(self, cmd: list[str], *, cwd: Path | None = None, env: Mapping[str, str] | None = None,
                 ignore: tuple[signal.Signals, ...] = (), restore_signals: bool = False,
                 scratch_base: Path | None = None) -> None:
        if not cmd:
            raise TrialRefused("no command given")
        self.cmd = list(cmd)
        self.cwd = Path(os.path.realpath(cwd or Path.cwd()))
        self.env = dict(os.environ if env is None else env)
        self.ignore = ignore
        self.restore_signals = restore_signals
        self.scratch_base = scratch_base
        self.dirs, self.left_alone = redirected_dirs(self.cmd, self.cwd, self.env)
        self.scratch: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.init_pid: int | None = None
        self.app_pid: int | None = None
        self.layers: list[tuple[str, Path]] = []  # (directory, its upper layer)
        self.started_at = 0.0
        self.leftovers: list[int] = []

    # -- paths ------------------------------------------------------------------------------
    @property
    def stdout(self) -> Path:
        assert self.scratch is not None
        return self.scratch / "out"

    @property
    def stderr(self) -> Path:
        assert self.scratch is not None
        return self.scratch / "err"

    @property
    def slurm_calls(self) -> list[str]:
        assert self.scratch is not None
        try:
            return (self.scratch / "slurm-calls").read_text().splitlines()
        except OSError:
            return []

    def _scratch_base(self, table: list[tuple[str, str]]) -> Path:
        candidates = [self.scratch_base] if self.scratch_base else []
        candidates += [Path(tempfile.gettempdir()), Path("/var/tmp"), Path("/dev/shm")]
        for base in candidates:
            real = os.path.realpath(base)
            if (os.path.isdir(real) and os.access(real, os.W_OK | os.X_OK)
                    and not any(_under(real, d) for d in self.dirs)  # an upper layer inside its lower: refused
                    and not _fs_of(real, table).startswith(NO_UPPER_FS)):
                return Path(real)
        raise TrialRefused("no scratch directory for the trial's writes: it must be a local disk outside "
                           f"{', '.join(self.dirs)} (tried {', '.join(str(c) for c in candidates)})")

    def _plan(self, table: list[tuple[str, str]]) -> list[dict[str, str]]:
        assert self.scratch is not None
        mounts: list[dict[str, str]] = []
        for top in self.dirs:
            below: dict[str, str] = {}
            for point, fstype in table:  # the last mount on a point is the one seen
                if point != top and _under(point, top):
                    below[point] = fstype
            entries = [(top, "")] + sorted(below.items(), key=lambda kv: (kv[0].count("/"), kv[0]))
            bound: list[str] = []
            for point, fstype in entries:
                if any(_under(point, b) for b in bound):
                    continue  # inside a pseudo filesystem bound back whole
                if fstype in PSEUDO_FS:
                    mounts.append({"kind": "bind", "lower": point, "target": point})
                    bound.append(point)
                    continue
                n = len(self.layers)
                upper, work = self.scratch / "upper" / str(n), self.scratch / "work" / str(n)
                upper.mkdir(parents=True)
                work.mkdir(parents=True)
                self.layers.append((point, upper))
                mounts.append({"kind": "overlay", "lower": point, "target": point, "upper": str(upper),
                               "work": str(work)})
        return mounts

    # -- the run ----------------------------------------------------------------------------
    def start(self) -> None:
        from hpcckpt.criu import ops

        table = mount_table()
        self.scratch = Path(tempfile.mkdtemp(prefix="hpcckpt-doctor-trial-", dir=self._scratch_base(table)))
        os.chmod(self.scratch, 0o755)  # a user namespace's root must reach it too
        mounts = self._plan(table)
        bin_dir = self.scratch / "bin"
        bin_dir.mkdir()
        for name in SLURM_SHIMS:
            shim = bin_dir / name
            shim.write_text(_shim(name, shutil.which(name, path=self.env.get("PATH")), self.scratch / "slurm-calls"))
            shim.chmod(0o755)
        self.env["PATH"] = f"{bin_dir}{os.pathsep}{self.env.get('PATH', os.defpath)}"
        # hpcckpt's own records (own.saved(), a Checkpointer's ledger) and a notice file stay in the scratch
        (self.scratch / "hpcckpt").mkdir()
        self.env["HPCCKPT_DIR"] = str(self.scratch / "hpcckpt")
        self.env["HPCCKPT_NOTICE_FILE"] = str(self.scratch / "STOP-NOTICE")
        if self.env.get("HPCCKPT_NOTICE") == "file":
            self.env["HPCCKPT_NOTICE"] = f"file {self.scratch / 'STOP-NOTICE'}"  # as the supervisor says it
        spec = {"status": str(self.scratch / "status"), "mounts": mounts, "cwd": str(self.cwd),
                "default": ["SIGPIPE", "SIGXFSZ"] if self.restore_signals else []}
        try:
            argv = ops.unshare_argv()
        except Exception as exc:  # noqa: BLE001 - no unshare: the trial cannot run
            raise TrialRefused(str(exc)) from None
        if os.geteuid() != 0:
            argv[1:1] = ["--user", "--map-root-user"]  # private mounts without root
        ignored = "--ignore=" + ",".join(str(int(s)) for s in self.ignore)
        argv += [sys.executable, "-I", "-S", str(ops.NSINIT), "start", ignored, str(self.stdout), str(self.stderr),
                 "--", sys.executable, "-I", "-S", "-c", _SANDBOX_INIT, json.dumps(spec), "--", *self.cmd]
        with open(self.scratch / "log", "ab") as log_f:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_f, stderr=log_f, env=self.env,
                                         cwd=self.cwd, start_new_session=True)
        self.started_at = time.monotonic()
        deadline = self.started_at + START_S
        self.init_pid = self._inner_child(self.proc.pid, 1, deadline)
        self.app_pid = self._inner_child(self.init_pid, 2, deadline) if self.init_pid else None
        status = ""
        while time.monotonic() < deadline:
            status = self._read(self.scratch / "status")
            if status or self.proc.poll() is not None:
                break
            time.sleep(0.05)
        if not status:
            status = self._read(self.scratch / "status")
        if status.startswith("ok"):
            return
        self.end()
        why = status.partition(" ")[2].strip() if status else (
            f"its namespaces did not start: {self._read(self.scratch / 'log').strip()[-400:] or 'no output'}")
        raise TrialRefused(f"its writes could not be redirected ({why}); nothing was run")

    def _inner_child(self, parent: int, inner: int, deadline: float) -> int | None:
        assert self.proc is not None
        while time.monotonic() < deadline:
            for kid in proctree.children(parent):
                if proctree.inner_pid(kid) == inner:
                    return kid
            if self.proc.poll() is not None:
                return None
            time.sleep(0.01)
        return None

    @staticmethod
    def _read(path: Path) -> str:
        try:
            return path.read_text(errors="replace")
        except OSError:
            return ""

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait(self, timeout_s: float) -> int | None:
        """The command's exit status (nsinit passes it on; 128+N when a signal ended it), or None."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=max(0.0, timeout_s))
        except subprocess.TimeoutExpired:
            return None

    def stderr_tail(self, chars: int = 300) -> str:
        return " | ".join(self._read(self.stderr).strip().splitlines()[-4:])[-chars:]

    def tree(self) -> list[int]:
        """The command's processes (host PIDs), root first."""
        return proctree.tree(self.app_pid) if self.app_pid and self.running() else []

    def end(self) -> list[int]:
        """End every process of the trial; returns the PIDs still there after (none, normally)."""
        if self.proc is None:
            return []
        seen = proctree.tree(self.init_pid) if self.init_pid else []
        if self.proc.poll() is None:
            if self.init_pid:
                end_launchers(self.init_pid)
                try:
                    os.kill(self.init_pid, signal.SIGKILL)  # the namespace's init: every process in it dies
                except ProcessLookupError:
                    pass
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # unshare, and anything it started before the namespace
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10
        while any(proctree.alive(p) for p in seen) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.leftovers = [p for p in seen if proctree.alive(p)]
        return self.leftovers

    def written(self, limit: int = 6) -> tuple[list[str], int]:
        """What the command wrote (kept out of the real directories): up to ``limit`` paths, and
        how many in all."""
        found = []
        for top, upper in self.layers:
            for root, _dirs, files in os.walk(upper):
                for name in files:
                    found.append(os.path.join(top, os.path.relpath(os.path.join(root, name), upper)))
        found.sort()
        return found[:limit], len(found)

    def close(self) -> None:
        self.end()
        if self.scratch is not None:
            _rmtree(self.scratch)

    def __enter__(self) -> Trial:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def sandbox_check(self, name: str) -> Check:
        """What the trial wrote, where it went, and that nothing of it is left running."""
        shown, total = self.written()
        wrote = (f"it wrote {total} file(s) ({', '.join(shown)}{', ...' if total > len(shown) else ''}), kept "
                 "out of the real directories and discarded" if total else "it wrote nothing there")
        exposed = self.left_alone
        left = (f"; paths it names that doctor could not redirect (their only existing parent is /), so the trial "
                f"may have written them for real: {', '.join(exposed)}" if exposed else "")
        calls = self.slurm_calls
        asked = (f"; it asked Slurm to act (blocked during the trial): {'; '.join(calls)}" if calls else "")
        ok = not self.leftovers and not exposed
        fixes = ([f"end them: kill {' '.join(map(str, self.leftovers))}"] if self.leftovers else []) + (
            [f"look at {', '.join(exposed)}, and create their parent directory before a trial"] if exposed else [])
        return Check(name=name, ok=ok, level="ok" if ok else "warn",
                     detail=f"ran with writes under {', '.join(self.dirs)} redirected to a scratch overlay: {wrote}"
                            f"{left}{asked}; " + ("every process it started has ended" if not self.leftovers else
                                                  f"PIDs {', '.join(map(str, self.leftovers))} are still there"),
                     fix="; ".join(fixes),
                     data={"redirected": self.dirs, "written": total, "slurm_calls": calls,
                           "leftovers": self.leftovers})


def catching(root: int, sig: int) -> list[int]:
    """The processes a notice ``sig`` goes to, as the own-checkpoint supervisor sends it: the
    root if it catches it, else those below it that do (a process without a handler dies of it)."""
    if proctree.catches(root, sig):
        return [root]
    return [p for p in proctree.tree(root)[1:] if proctree.catches(p, sig)]


def dispositions(pids: Iterable[int], sig: int) -> dict[int, str]:
    """What each process does with ``sig``: "caught", "ignored", "default" (gone ones left out)."""
    out = {}
    for pid in pids:
        how = proctree.disposition(pid, sig)
        if how is not None:
            out[pid] = how
    return out


def _who(pid: int) -> str:
    """A process as a message names it: its PID in its own namespace, and its command."""
    inner = proctree.inner_pid(pid)
    return f"PID {inner if inner else pid} ({proctree.command(pid, limit=60)})"


@dataclass(frozen=True, kw_only=True)
class TrialResult:
    """A trial's findings, and the facts later checks use (``DoctorContext`` fields)."""

    checks: list[Check]
    save_s: float | None = None
    notice_caught: bool | None = None
    term_disposition: str | None = None


def own_trial(cmd: list[str], *, notice: str = "TERM", wait_s: float = 20.0, stop_wait_s: float = 60.0,
              requeue_on: frozenset[int] = frozenset({EXIT_REQUEUE}), cwd: Path | None = None,
              scratch_base: Path | None = None) -> TrialResult:
    """``hpcckpt doctor --mode own -- CMD``: start CMD as ``hpcckpt run --mode own`` would, without
    side effects (``Trial``), give it ``wait_s`` to set itself up, read whether it catches the
    notice signal (SigCgt) and what TERM does to it, then send it the notice as the supervisor
    does and time its exit (its save) for up to ``stop_wait_s`` (0: no notice), and end it."""
    settings = OwnSettings(notice=notice, requeue_on=requeue_on)
    sig = settings.notice_signal
    is_file = notice.strip().lower().startswith("file")
    if sig is None and not is_file:
        return TrialResult(checks=[Check(name="own trial", ok=False, detail=f"--notice {notice!r} is neither a "
                                         "signal nor file[:PATH]", fix="--notice TERM (or USR1, USR2, file)")])
    # what the supervisor tells the command: how the notice comes (own.should_stop() listens for it)
    env = {**os.environ, "HPCCKPT_NOTICE": "file" if is_file else (sig.name if sig is not None else notice)}
    try:
        trial = Trial(cmd, cwd=cwd, env=env, restore_signals=True, scratch_base=scratch_base)
    except TrialRefused as exc:
        return TrialResult(checks=[Check(name="own trial", ok=False, level="warn", detail=f"not run: {exc}")])
    codes = ",".join(map(str, sorted(requeue_on)))
    try:
        try:
            trial.start()
        except TrialRefused as exc:
            return TrialResult(checks=[Check(name="own trial", ok=False, level="warn", detail=f"not run: {exc}",
                                             fix="run doctor as root, or where user namespaces are allowed, with "
                                                 "TMPDIR on a local disk")])
        return _own_look(trial, cmd, settings, wait_s=wait_s, stop_wait_s=stop_wait_s, codes=codes)
    finally:
        trial.close()


def _own_look(trial: Trial, cmd: list[str], settings: OwnSettings, *, wait_s: float, stop_wait_s: float,
              codes: str) -> TrialResult:
    assert trial.scratch is not None and trial.app_pid is not None
    text = " ".join(cmd)
    deadline = time.monotonic() + wait_s
    while trial.running() and time.monotonic() < deadline:
        time.sleep(0.2)
    if not trial.running():
        code = trial.wait(0)
        trial.end()
        return TrialResult(checks=[
            Check(name="own trial", ok=True, level="info",
                  detail=f"{text!r} ended (status {code}) within {wait_s:.0f} s, before it could be looked at; its "
                         f"last output: {trial.stderr_tail() or '(none)'}",
                  fix="give it longer: --trial-s"),
            trial.sandbox_check("own trial sandbox")])
    checks: list[Check] = []
    sig = settings.notice_signal
    root = trial.app_pid
    term = proctree.disposition(root, signal.SIGTERM)
    targets = catching(root, sig) if sig is not None else []
    if sig is not None:
        name = settings.notice_name
        where = ("its root process" if targets == [root] else
                 ", ".join(_who(p) for p in targets) if targets else "")
        caught = bool(targets)
        checks.append(Check(
            name="own notice heard", ok=caught, level="ok" if caught else "warn",
            detail=(f"after {wait_s:.0f} s {where} catches {name} (SigCgt): the notice goes to it" if caught else
                    f"after {wait_s:.0f} s no process of {text!r} catches {name} (SigCgt): the supervisor sends it no "
                    "notice (it would die of it); it trains on until Slurm ends it and comes back from its own last "
                    "save"),
            fix="" if caught else f"give the script a {name} handler that saves and exits 75 (or call "
                                  "hpcckpt.own.should_stop() at each step), or name the signal it catches: --notice"
                                  + _other_caught(root, sig),
            data={"notice": name, "caught_by": targets}))
    if sig != signal.SIGTERM:
        dies = term == "default"
        checks.append(Check(
            name="own TERM", ok=not dies, level="warn" if dies else "ok",
            detail=(f"its root process {'dies of' if dies else 'catches' if term == 'caught' else 'ignores'} TERM: "
                    "at the deadline (a grace's end, a GraceTime=0 preemption, the time limit) Slurm's TERM reaches "
                    "it " + ("and ends it at once, mid-save if it is saving" if dies else
                             "and it has KillWait to finish its save")),
            fix="" if not dies else "catch TERM as well (a handler that lets the save finish), or use --notice TERM"))
    save_s = None
    if stop_wait_s > 0 and (targets or sig is None):
        save_s, check = _own_rehearse(trial, settings, targets, stop_wait_s=stop_wait_s, codes=codes)
        checks.append(check)
    checks.extend(_saved_reports(trial))
    trial.end()
    checks.append(trial.sandbox_check("own trial sandbox"))
    return TrialResult(checks=checks, save_s=save_s, notice_caught=bool(targets) if sig is not None else None,
                       term_disposition=term)


def _other_caught(root: int, sig: int) -> str:
    others = [s for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
              if s != sig and any(proctree.catches(p, s) for p in proctree.tree(root))]
    return f" (it catches {', '.join(s.name.removeprefix('SIG') for s in others)})" if others else ""


def _own_rehearse(trial: Trial, settings: OwnSettings, targets: list[int], *, stop_wait_s: float,
                  codes: str) -> tuple[float | None, Check]:
    """The notice, as the supervisor sends it, and how long the command takes to exit after it."""
    assert trial.scratch is not None
    sig = settings.notice_signal
    if sig is None:
        path = trial.env.get("HPCCKPT_NOTICE_FILE", "")
        told = "wrote its notice file (HPCCKPT_NOTICE_FILE)"
        Path(path).write_text(f"doctor {time.time():.3f}\n")
    else:
        for pid in targets:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        told = f"sent {settings.notice_name} to PID {', '.join(str(proctree.inner_pid(p) or p) for p in targets)}"
    t0 = time.monotonic()
    code = trial.wait(stop_wait_s)
    took = time.monotonic() - t0
    if code is None:
        return None, Check(
            name="own notice rehearsal", ok=False, level="warn",
            detail=f"{told}; it had not exited {stop_wait_s:.0f} s later: the notice comes LEAD seconds before the end, "
                   "and at the end Slurm's TERM, then KILL, stop it; it comes back from its own last save",
            fix=f"save and exit {codes} soon after the notice (check for it at every step), or give the trial longer: "
                "--stop-wait-s", data={"exit_code": None})
    if code in settings.requeue_on:
        return took, Check(
            name="own notice rehearsal", ok=True,
            detail=f"{told}; it exited {code} {took:.1f} s later: hpcckpt requeues it and it resumes from its own save",
            data={"exit_code": code, "exit_after_notice_s": round(took, 3)})
    if code == 0:
        return None, Check(
            name="own notice rehearsal", ok=False, level="warn",
            detail=f"{told}; it exited 0 {took:.1f} s later: after a notice, status 0 says the run is finished, and "
                   "hpcckpt does not requeue it (the job ends with its training cut short)",
            fix=f"exit {codes} after the save on the notice (or declare the status it uses: --requeue-on)",
            data={"exit_code": 0})
    return None, Check(
        name="own notice rehearsal", ok=True, level="info",
        detail=f"{told}; it exited {code} {took:.1f} s later{' (killed by a signal)' if code > 128 else ''}: hpcckpt "
               f"requeues it all the same, and it comes back from its last own save; a status in --requeue-on ({codes}) "
               "says it saved first",
        fix="", data={"exit_code": code})


def _saved_reports(trial: Trial) -> list[Check]:
    """Whether the command reported its saves (``hpcckpt.own.saved``) in the trial's records."""
    assert trial.scratch is not None
    ledger = trial.scratch / "hpcckpt" / "ledger.jsonl"
    try:
        saved = [json.loads(line) for line in ledger.read_text().splitlines() if '"saved"' in line]
    except (OSError, ValueError):
        saved = []
    if not saved:
        return []
    last = saved[-1]
    return [Check(name="own saves reported", ok=True,
                  detail=f"it reports its saves (hpcckpt.own.saved): {len(saved)} in the trial, the last of step "
                         f"{last.get('step')} at {last.get('path')}; history counts what a stop loses from them")]
