"""``hpcckpt doctor``: checks that a job will survive its next warning, each a small function.

A check takes a ``DoctorContext`` and returns ``Check`` results. ``Check`` is the one
finding type of the project: other parts plug in their own checks through a module
exposing ``checks() -> list[Check]`` (e.g. ``hpcckpt.criu.doctor``) listed in
``PROVIDERS``; a plug-in that fails, or returns something else, is itself a finding.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcckpt.cluster.env import JobEnv
from hpcckpt.cluster.scontrol import parse_duration_s, parse_records, run_slurm, show_config
from hpcckpt.config import env_value, parse_signal, parse_signals
from hpcckpt.errors import ClusterError, ConfigError

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
class DoctorContext:
    """What the checks look at; every part is optional (doctor runs on login nodes too)."""

    script: Path | None = None
    script_text: str | None = None
    ckpt_dir: Path | None = None
    env: JobEnv = field(default_factory=JobEnv)
    save_costs_s: tuple[float, ...] = ()
    slurm_config: dict[str, str] | None = None
    partitions: tuple[dict[str, str], ...] = ()

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


def build_context(*, script: Path | None, ckpt_dir: Path | None) -> DoctorContext:
    text = script.read_text(encoding="utf-8", errors="replace") if script else None
    costs: tuple[float, ...] = ()
    if ckpt_dir is not None:
        from hpcckpt.ledger import Ledger

        costs = tuple(float(e["save_s"]) for e in Ledger(ckpt_dir).events()
                      if e.get("event") == "commit" and isinstance(e.get("save_s"), (int, float)))
    config: dict[str, str] | None = None
    partitions: tuple[dict[str, str], ...] = ()
    if shutil.which("scontrol"):
        try:
            config = show_config()
            partitions = tuple(parse_records(run_slurm(["scontrol", "show", "partition", "-o"])))
        except ClusterError as err:
            log.info("Slurm not reachable: %s", err)
    return DoctorContext(script=script, script_text=text, ckpt_dir=ckpt_dir, save_costs_s=costs,
                         slurm_config=config, partitions=partitions)


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
    if ctx.script_text is None:
        return []
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
    if spec is None:
        return []
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


def notice_s(ctx: DoctorContext) -> tuple[float, str]:
    """How late a GraceTime preemption may be noticed, and why: 0 when it sends the job's
    --signal (``send_user_signal``), else one read of the end time (``HPCCKPT_POLL_S``, 15 s;
    CRIU mode: ``--end-poll-s``, by default HPCCKPT_POLL_S or 10 s)."""
    if ctx.slurm_config is not None and sends_user_signal(ctx.slurm_config):
        return 0.0, "its start sends the --signal"
    criu = _is_criu(ctx)
    flag = re.search(r"--end-poll-s[= ]([0-9.]+)", ctx.script_text or "") if criu else None
    try:
        poll = float(flag.group(1)) if flag else env_value("poll_s", 10.0 if criu else 15.0, ctx.env.environ)
    except (ConfigError, ValueError):
        poll = 10.0 if criu else 15.0  # the bad setting is the job's own error, with its fix
    what = "--end-poll-s" if flag else "HPCCKPT_POLL_S"
    return poll, f"it is noticed at the next read of the end time ({what}={poll:g}s)"


def check_grace_time(ctx: DoctorContext) -> list[Check]:
    """GraceTime against what a preemption needs: being noticed (``notice_s``), then the
    final save (x1.5) and the requeue."""
    out = []
    save = ctx.worst_save_s or 10.0
    after = save * 1.5 + 2  # from the notice: the final save and the requeue
    notice, how = notice_s(ctx)
    criu = _is_criu(ctx)
    for part in ctx.partitions:
        mode = part.get("PreemptMode", "OFF").upper()
        if mode in {"OFF", ""} or part.get("PriorityTier") is None:
            continue
        raw = part.get("GraceTime", "0")
        # Partitions print GraceTime in plain seconds; a clock form is read as a duration.
        grace = float(raw) if raw.isdigit() else (parse_duration_s(raw) or 0.0)
        need = notice + after
        ok = grace >= need
        fixes = [f"ask the admins for GraceTime>={int(need + 1)} on this partition"]
        if notice > 0 and grace >= after + 0.5:
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


def _is_criu(ctx: DoctorContext) -> bool:
    return bool(re.search(r"--mode[= ]criu", ctx.script_text or ""))


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
    said = ("PreemptParameters=send_user_signal is set: a GraceTime preemption sends the job's --signal at its "
            "start" if on else
            "PreemptParameters=send_user_signal is not set: a GraceTime preemption sends nothing at its start, "
            "it only pulls the job's end time in")
    detail = (f"{said}; at the grace's end (and at the time limit) every process gets TERM, then KILL "
              f"KillWait={kill_wait} later. In-process (Checkpointer, --mode app): the job stops at the next "
              "step on the --signal, on the moved end time (read every HPCCKPT_POLL_S, 15 s) or on TERM, and its "
              "final save must "
              "fit GraceTime. CRIU (--mode criu): the supervisor dumps on the --signal, on the moved end time "
              "(read every --end-poll-s) or on TERM (the job itself ignores TERM); a dump that starts at TERM "
              f"must fit KillWait={kill_wait} s.")
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
    if match is None or "--mode app" in match.group(0):
        return []
    sig = re.search(r"--signal[= ]\s*\"?(?:\$\{[A-Z_]+:-)?([A-Z0-9,]+)", match.group(0))
    names = {n.removeprefix("SIG") for n in (sig.group(1).split(",") if sig else ["USR2", "TERM"])}
    ok = "TERM" in names
    return [Check(name="criu dump signals", ok=ok, level="ok" if ok else "warn",
                  detail=f"hpcckpt run --mode criu dumps on {','.join(sorted(names))}",
                  fix="" if ok else "add TERM: `--signal USR2,TERM` (a preemption and the time limit send TERM; "
                                    "without it the job is lost at a preemption)")]


CHECKS: list[Callable[[DoctorContext], list[Check]]] = [
    check_slurm, check_job_requeue, check_requeue_permission, check_signal_lead,
    check_signal_delivery, check_signal_choice, check_grace_time, check_preempt_signal,
    check_requeue_expedite, check_criu_script, protected_symlinks,
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
    return results + (plugin_checks() if plugins else [])
