"""Tunables in one place. Each has an ``HPCCKPT_*`` environment override;
an explicit argument always beats the environment.

Every option and environment variable is validated here, once: its range, its
unit, and for signals whether it can be caught and makes sense as a stop warning.
A bad value is a ``ConfigError`` that names the option (or variable) and gives a
valid example; nothing invalid reaches an engine or the native core.
"""
from __future__ import annotations

import logging
import math
import os
import signal
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

from .errors import ConfigError

T = TypeVar("T")
log = logging.getLogger("hpcckpt.config")

ENGINES = ("sync", "concurrent")
# What Checkpointer(dir) and @preemptible use with no options: the concurrent engine (a save
# blocks training for milliseconds and persists near the disk's speed) with staging_bytes="auto"
# (a ring of a quarter of the state: never a second copy of the job's state). "sync"
# (torch.save + fsync) is the baseline, named explicitly.
DEFAULT_ENGINE = "concurrent"
DEFAULT_STAGING = "auto"
STAGING = ("auto", "full")  # staging_bytes besides a byte count
ON_BUSY = ("wait", "skip")
ON_CORRUPT = ("raise", "fresh")  # when every checkpoint is damaged: stop and say so, or start fresh as asked
CLUSTERS = ("local", "slurm-cli", "pyslurm")
# Which tensors are identical on every rank (written once, striped): registered DDP modules and
# their optimizers (auto), every registered module and its optimizers (models: the inner module
# of a DDP was registered), or nothing (none: every rank writes its own copy).
REPLICATED = ("auto", "models", "none")
DEFAULT_SIGNALS = ("SIGUSR2", "SIGTERM")
CHUNK_BYTES = 8 << 20  # concurrent engine: one writer thread's piece of a file (HPCCKPT_CHUNK_BYTES)
# Signals that a scheduler sends as a warning and a handler can catch. Excluded on
# purpose: KILL/STOP cannot be caught; SEGV/BUS/FPE/ILL/ABRT/TRAP/SYS are faults of
# the process itself; CHLD/CONT/WINCH/URG/PIPE/TSTP/TTIN/TTOU/PROF/VTALRM/IO are
# routine events that would stop training for no reason.
STOP_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGXCPU")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


# --- parsers: text -> value, ValueError with the rule on failure -----------------------------

def parse_signal(name: str | int | signal.Signals) -> signal.Signals:
    """'USR2', 'SIGUSR2', 12 or signal.SIGUSR2 -> signal.SIGUSR2; only ``STOP_SIGNALS``."""
    valid = ", ".join(s.removeprefix("SIG") for s in STOP_SIGNALS)
    try:
        if isinstance(name, int) or (isinstance(name, str) and name.strip().isdigit()):
            sig = signal.Signals(int(name))
        else:
            key = str(name).strip().upper()
            sig = signal.Signals[key if key.startswith("SIG") else "SIG" + key]
    except (KeyError, ValueError):
        raise ConfigError(f"unknown signal {name!r}; use one of {valid} (with or without SIG)") from None
    if sig.name not in STOP_SIGNALS:
        raise ConfigError(f"signal {sig.name} cannot serve as a stop warning (it cannot be caught, or it "
                          f"reports a fault or a routine event); use one of {valid}")
    return sig


def parse_signals(raw: str | tuple[str | int | signal.Signals, ...], *,
                  option: str | None = None) -> tuple[signal.Signals, ...]:
    """'SIGUSR2,SIGTERM' (or a tuple of names) -> signals, at least one, duplicates dropped.

    ``option`` (e.g. "--signal") is named in the error.
    """
    items = raw.split(",") if isinstance(raw, str) else list(raw)
    names = [s for s in items if not isinstance(s, str) or s.strip()]
    try:
        if not names:
            raise ConfigError(f"no signal named in {raw!r}; name at least one, e.g. SIGUSR2,SIGTERM")
        return tuple(dict.fromkeys(parse_signal(s) for s in names))
    except ConfigError as exc:
        if option is None:
            raise
        raise ConfigError(f"{option}={raw!r} is invalid: {exc}") from None


def parse_bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected one of 1/0, true/false, yes/no, on/off")


def parse_int(raw: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError("expected a whole number") from None


def parse_float(raw: str) -> float:
    value = float(raw.strip())
    if not math.isfinite(value):
        raise ValueError("expected a finite number")
    return value


def parse_steps(raw: str) -> tuple[int, ...]:
    """'12,40' -> (12, 40): step numbers, sorted, duplicates dropped."""
    try:
        return tuple(sorted({int(x) for x in raw.split(",") if x.strip()}))
    except ValueError:
        raise ValueError("expected step numbers separated by commas, e.g. 12,40") from None


def parse_bytes(raw: str) -> int:
    """'8388608', '8M', '8MiB', '1.5G' -> bytes (binary units)."""
    text = raw.strip().lower().removesuffix("ib").removesuffix("b")
    unit = text[-1] if text and text[-1] in _UNITS else ""
    try:
        number = float(text.removesuffix(unit) if unit else text)
    except ValueError:
        raise ValueError("expected a byte count such as 8388608, 8M or 2GiB") from None
    if not math.isfinite(number):
        raise ValueError("expected a finite byte count")
    return int(number * _UNITS[unit])


def parse_staging(raw: str) -> int | str:
    """'auto', 'full' or a byte count ('1GiB') -> the concurrent engine's staging_bytes."""
    low = raw.strip().lower()
    return low if low in STAGING else parse_bytes(raw)


def check_on_busy(value: str) -> str:
    """``value`` if it is a valid on_busy policy, else a ConfigError naming the choices."""
    if value not in ON_BUSY:
        raise ConfigError(f"on_busy={value!r}; use one of {', '.join(ON_BUSY)} (HPCCKPT_ON_BUSY)")
    return value


# --- the table: every HPCCKPT_* tunable with its rule and an example --------------------------

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class Tunable:
    """One option: ``env`` is its variable, ``rule`` says what is valid, ``ok`` tests a value."""

    env: str
    parse: Callable[[str], Any]
    ok: Callable[[Any], bool]
    rule: str
    example: str


def _is_path(v: Any) -> bool:
    return isinstance(v, str) and v.strip() != ""


# Every HPCCKPT_* variable the package reads is a row (tests/unit/test_options_table.py checks,
# and that README.md names each). Rows read outside resolve_options (paths, the CRIU mode's,
# the ones hpcckpt sets for its own processes) keep their readers; the row records rule and example.
TUNABLES: dict[str, Tunable] = {t.env.removeprefix("HPCCKPT_").lower(): t for t in (
    Tunable("HPCCKPT_DIR", str, _is_path, "a directory path (the checkpoint root, on a shared file system)",
            "/scratch/$USER/run1/ckpt"),
    Tunable("HPCCKPT_EVERY_STEPS", str, lambda v: isinstance(v, str),
            "a whole number of steps > 0, or auto (checked by resolve_options)", "100"),
    Tunable("HPCCKPT_ENGINE", str, lambda v: v in ENGINES, f"one of the valid engines: {', '.join(ENGINES)}",
            "concurrent"),
    Tunable("HPCCKPT_KEEP", parse_int, lambda v: _is_int(v) and v >= 1,
            "a whole number >= 1 (the newest verified checkpoint is always kept)", "3"),
    Tunable("HPCCKPT_OVERHEAD_BOUND", parse_float, lambda v: _is_num(v) and 0 < v <= 1,
            "a fraction of step time in (0, 1]", "0.03"),
    Tunable("HPCCKPT_DEADLINE_MARGIN_S", parse_float, lambda v: _is_num(v) and v >= 0,
            "seconds >= 0 before the job's end time to stop", "30"),
    Tunable("HPCCKPT_MAX_ASYNC", parse_int, lambda v: _is_int(v) and 1 <= v <= 64,
            "a whole number of checkpoints in flight, 1 to 64", "2"),
    Tunable("HPCCKPT_WRITER_THREADS", parse_int, lambda v: _is_int(v) and 0 <= v <= 1024,
            "a whole number of threads, 0 (one per core) to 1024", "4"),
    Tunable("HPCCKPT_ON_BUSY", str, lambda v: v in ON_BUSY, f"one of {', '.join(ON_BUSY)}", "skip"),
    Tunable("HPCCKPT_ON_CORRUPT", lambda s: s.strip().lower(), lambda v: v in ON_CORRUPT,
            f"one of {', '.join(ON_CORRUPT)} (what to do when every checkpoint is damaged)", "fresh"),
    Tunable("HPCCKPT_REPLICATED", lambda s: s.strip().lower(), lambda v: v in REPLICATED,
            f"one of {', '.join(REPLICATED)} (which registered state is identical on every rank)", "models"),
    Tunable("HPCCKPT_CHECK_REPLICAS", parse_bool, lambda v: isinstance(v, bool),
            "a boolean (1/0, true/false): checksum the replicated tensors at each save and compare ranks", "1"),
    Tunable("HPCCKPT_JIT", parse_bool, lambda v: isinstance(v, bool),
            "a boolean (1/0, true/false): survivors write a checkpoint when a rank dies or hangs", "1"),
    Tunable("HPCCKPT_JIT_TIMEOUT_S", parse_float, lambda v: v is None or (_is_num(v) and 0.5 <= v <= 3600),
            "seconds from 0.5 to 3600 a silent rank may take before it counts as failed", "5"),
    Tunable("HPCCKPT_MEMORY_BUDGET_BYTES", parse_bytes, lambda v: v is None or (_is_int(v) and v > 0),
            "a positive byte count (K, M, G, T suffixes are binary)", "4GiB"),
    Tunable("HPCCKPT_STAGING_BYTES", parse_staging, lambda v: v is None or v in STAGING or (_is_int(v) and v > 0),
            "auto (a quarter of the state, a full copy up to 64 MiB, within the node's available memory), "
            "full (a copy of the state per save in flight), or a positive byte count of host staging per rank, "
            "a ring when below the state's size", "1GiB"),
    Tunable("HPCCKPT_CHUNK_BYTES", parse_bytes, lambda v: _is_int(v) and 4096 <= v <= 1 << 32,
            "a byte count from 4 KiB to 4 GiB", "8M"),
    Tunable("HPCCKPT_RING_CHUNK_BYTES", parse_bytes, lambda v: v is None or (_is_int(v) and 8192 <= v <= 1 << 32),
            "a byte count of one staging ring chunk, 8 KiB to 4 GiB", "64M"),
    Tunable("HPCCKPT_RESTORE_CHUNK_BYTES", parse_bytes, lambda v: _is_int(v) and 8192 <= v <= 1 << 32,
            "a byte count of one pinned chunk of a restore onto the GPU, 8 KiB to 4 GiB", "128M"),
    Tunable("HPCCKPT_DIRECT", parse_bool, lambda v: isinstance(v, bool), "1/0, true/false, yes/no, on/off",
            "0"),
    Tunable("HPCCKPT_LOCAL_EVERY_STEPS", parse_int, lambda v: v is None or (_is_int(v) and v > 0),
            "a whole number of steps > 0: a node-local checkpoint (and a partner copy on another node) every "
            "this many steps; every_steps is then the shared level's interval, a multiple of it", "1"),
    Tunable("HPCCKPT_LOCAL_DIR", str, _is_path,
            "a node-local directory path for the node-local level (%n: the node name; default: the job's "
            "prolog-made staging, else /dev/shm)", "/local/$USER/hpcckpt"),
    Tunable("HPCCKPT_LOCAL_KEEP", parse_int, lambda v: _is_int(v) and v >= 1,
            "a whole number >= 1 of node-local checkpoints kept on each node", "2"),
    Tunable("HPCCKPT_PARTNER", parse_bool, lambda v: isinstance(v, bool),
            "a boolean (1/0): each node-local checkpoint is also copied to a partner node's node-local level",
            "1"),
    Tunable("HPCCKPT_SIGNALS", parse_signals, lambda v: bool(v), "catchable stop signals, comma-separated",
            "SIGUSR2,SIGTERM"),
    Tunable("HPCCKPT_CLUSTER", lambda s: s.strip().lower(), lambda v: v in CLUSTERS,
            f"one of {', '.join(CLUSTERS)}", "slurm-cli"),
    Tunable("HPCCKPT_SUCCESSOR_GENERATION", parse_int, lambda v: _is_int(v) and v >= 0,
            "a whole number >= 0 (set by hpcckpt on successor jobs)", "1"),
    Tunable("HPCCKPT_LOCAL_RESTART", parse_int, lambda v: _is_int(v) and v >= 0,
            "a whole number >= 0 (set by the local supervisor)", "1"),
    Tunable("HPCCKPT_STOP_AT_STEPS", parse_steps, lambda v: isinstance(v, tuple) and all(_is_int(s) and s > 0 for s in v),
            "step numbers > 0, comma-separated: stop there as on a signal (set by hpcckpt check)", "12,40"),
    Tunable("HPCCKPT_WARNING_WINDOW_S", parse_float, lambda v: _is_num(v) and v >= 0,
            "seconds >= 0: a warning signal with at most this much time left waits for the deadline "
            "(0: every warning stops at once)", "300"),
    Tunable("HPCCKPT_POLL_S", parse_float, lambda v: _is_num(v) and 0.5 <= v <= 600,
            "seconds from 0.5 to 600 between the job's reads of its end time, maintenance reservations "
            "and drain state from Slurm (keep it under the partition's GraceTime)", "5"),
    Tunable("HPCCKPT_NOTICE", str, lambda v: isinstance(v, str),
            "how a supervised script hears the stop: a signal name or 'file PATH' (set by hpcckpt run --mode own)",
            "SIGTERM"),
    Tunable("HPCCKPT_NOTICE_FILE", str, lambda v: isinstance(v, str),
            "a file path written at the stop's notice (set by hpcckpt run --mode own --notice file)",
            "/scratch/run/STOP-NOTICE"),
    Tunable("HPCCKPT_CHECK_TRACE", str, lambda v: isinstance(v, str),
            "a file path: each step's state digests are appended there (set by hpcckpt check)", "/tmp/trace.jsonl"),
    Tunable("HPCCKPT_STAGING_ROOT", str, _is_path,
            "a directory path for per-job node-local staging (%n: the node name; as slurm/prolog)",
            "/local/hpcckpt-staging"),
    Tunable("HPCCKPT_CRIU", str, _is_path, "the path of a criu >= 4 binary or wrapper (CRIU mode)",
            "/opt/hpcckpt/criu/bin/criu"),
    Tunable("HPCCKPT_CRIU_PREFIX", str, _is_path, "the prefix scripts/install-criu installed criu under",
            "/opt/hpcckpt/criu"),
    Tunable("HPCCKPT_CRIU_FALLBACK", str, lambda v: isinstance(v, str),
            "fresh: do not resume (set by `hpcckpt run --mode criu --on-restore-failure fresh`)", "fresh"),
    Tunable("HPCCKPT_LIBCUDA", str, _is_path, "the path of the NVIDIA driver library (CUDA checkpoint API)",
            "libcuda.so.1"),
    Tunable("HPCCKPT_BATCH_ARGS_JOB", str, lambda v: isinstance(v, str),
            "the SLURM_JOB_ID the exported batch arguments belong to (set by the templates)", "1234"),
    Tunable("HPCCKPT_BATCH_ARGC", parse_int, lambda v: _is_int(v) and v >= 0,
            "how many HPCCKPT_BATCH_ARG_<n> the templates exported (set by the templates)", "2"),
    Tunable("HPCCKPT_END_TIME", parse_float, lambda v: _is_num(v) and v > 0,
            "epoch seconds when the job will be stopped", "1767225600"),
    *(Tunable(f"HPCCKPT_REQUEUE_MAX_{key}", parse_int, lambda v: _is_int(v) and v >= 0,
              "a whole number of requeues >= 0", "10")
      for key in ("TIME_LIMIT", "PREEMPTION", "SIGNAL", "FAILURE", "RANK_FAILURE", "FAILURES_WITHOUT_PROGRESS")),
)}


def validate(option: str, value: T, *, source: str | None = None) -> T:
    """``value`` if valid for ``option`` (a key of TUNABLES), else a ConfigError naming it."""
    spec = TUNABLES[option]
    if spec.ok(value):
        return value
    where = source or f"{option}={value!r}"
    raise ConfigError(f"{where} is invalid: expected {spec.rule}; e.g. {option}={spec.example} "
                      f"or {spec.env}={spec.example}")


def from_env(name: str, default: T, parse: Callable[[str], T],
             environ: Mapping[str, str] | None = None) -> T:
    """Read ``HPCCKPT_<name>`` (from ``environ``, default ``os.environ``); a malformed or
    out-of-range value is an error naming the variable.

    Variables listed in TUNABLES are parsed and checked by their own rule (``parse`` is
    then only the fallback for names the table does not know).
    """
    raw = (os.environ if environ is None else environ).get(f"HPCCKPT_{name}")
    if raw is None or raw.strip() == "":
        return default
    spec = TUNABLES.get(name.lower())
    try:
        value = (spec.parse if spec else parse)(raw)
    except (ValueError, KeyError, ConfigError) as exc:
        hint = f"; e.g. HPCCKPT_{name}={spec.example}" if spec else ""
        raise ConfigError(f"environment variable HPCCKPT_{name}={raw!r} is invalid: {exc}{hint}") from None
    if spec is not None:
        validate(name.lower(), value, source=f"environment variable HPCCKPT_{name}={raw!r}")
    return value


def env_value(option: str, default: T, environ: Mapping[str, str] | None = None) -> T:
    """The validated ``HPCCKPT_<OPTION>`` for a key of TUNABLES, or ``default`` when unset."""
    spec = TUNABLES[option]
    return from_env(spec.env.removeprefix("HPCCKPT_"), default, spec.parse, environ)


def pick(explicit: T | None, name: str, default: T, parse: Callable[[str], T]) -> T:
    """An explicit argument if given (checked by its rule), else the environment, else the default."""
    if explicit is None:
        return from_env(name, default, parse)
    return validate(name.lower(), explicit) if name.lower() in TUNABLES else explicit


# --- the options ------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """Where, how and how often to checkpoint (resolved; see ``resolve``)."""

    dir: Path
    engine: str = DEFAULT_ENGINE
    every_steps: int | None = None
    auto_interval: bool = False
    overhead_bound: float = 0.03
    keep: int = 3
    signals: tuple[signal.Signals, ...] = field(default_factory=lambda: parse_signals(DEFAULT_SIGNALS))
    deadline_margin_s: float = 30.0
    max_async: int = 1
    writer_threads: int = 0
    # concurrent engine: what a save does while max_async are in flight; staging cap; O_DIRECT writes
    on_busy: str = "wait"
    memory_budget_bytes: int | None = None
    # concurrent engine: "auto" (a ring of a quarter of the state; a full copy of a small one),
    # "full" (a full copy per save in flight; None too) or a byte count (a ring when below the state)
    staging_bytes: int | str | None = DEFAULT_STAGING
    direct: bool = True
    on_corrupt: str = "raise"
    replicated: str = "auto"
    check_replicas: bool = False  # debug: compare checksums of the replicated tensors across ranks at each save
    jit: bool = False  # just-in-time checkpoint by the survivors when a rank dies or hangs (hpcckpt.jit)
    jit_timeout_s: float | None = None  # how long a silent rank may take before it counts as failed
    chunk_bytes: int = CHUNK_BYTES  # concurrent engine: one writer thread's piece of a file
    ring_chunk_bytes: int | None = None  # concurrent engine: one staging ring chunk (None: the engine's size)
    # multi-level checkpoints (hpcckpt.levels): node-local (+ partner) every local_every_steps;
    # every_steps is then the shared level's interval (drained from the node-local copy)
    local_every_steps: int | None = None
    local_dir: str | None = None
    local_keep: int = 2
    partner: bool = True

    def __post_init__(self) -> None:
        if self.every_steps is not None and not (_is_int(self.every_steps) and self.every_steps > 0):
            raise ConfigError(f"every_steps={self.every_steps!r} is invalid: use a positive integer, 'auto' "
                              "or None; e.g. every_steps=100 or HPCCKPT_EVERY_STEPS=100")
        for option in ("engine", "overhead_bound", "keep", "deadline_margin_s", "max_async", "writer_threads",
                       "on_busy", "memory_budget_bytes", "staging_bytes", "direct", "on_corrupt", "replicated",
                       "check_replicas", "jit", "jit_timeout_s", "chunk_bytes", "ring_chunk_bytes",
                       "local_every_steps", "local_keep", "partner"):
            validate(option, getattr(self, option))
        if self.local_dir is not None:
            validate("local_dir", self.local_dir)
        if self.local_every_steps is not None:
            if self.auto_interval:
                raise ConfigError("every_steps='auto' does not combine with local_every_steps: give the shared "
                                  "level's interval in steps, e.g. every_steps=100, local_every_steps=10")
            if self.every_steps is not None and self.every_steps % self.local_every_steps:
                raise ConfigError(f"every_steps={self.every_steps} (the shared level) is not a multiple of "
                                  f"local_every_steps={self.local_every_steps}: the shared level is drained from "
                                  f"a node-local checkpoint; e.g. every_steps={self.local_every_steps * 10}")
        if not self.signals:
            raise ConfigError("signals=() leaves no stop signal; e.g. signals=('SIGUSR2', 'SIGTERM') "
                              "or HPCCKPT_SIGNALS=SIGUSR2,SIGTERM")
        for sig in self.signals:
            parse_signal(sig)


def _every(raw: int | str | None) -> tuple[int | None, bool]:
    """(every_steps, auto) from an argument or HPCCKPT_EVERY_STEPS: N, 'auto' or None."""
    every = raw if raw is not None else from_env("EVERY_STEPS", None, str)
    if isinstance(every, str) and every.strip().lower() == "auto":
        return None, True
    try:
        n = None if every is None else int(every)
    except ValueError:
        n = 0
    if n is not None and (n <= 0 or isinstance(every, (bool, float))):
        where = "every_steps" if raw is not None else "environment variable HPCCKPT_EVERY_STEPS"
        raise ConfigError(f"{where}={every!r} is invalid: use a positive integer, 'auto', or None; "
                          "e.g. every_steps=100 or HPCCKPT_EVERY_STEPS=auto")
    return n, False


def warn_if_shared(root: Path) -> bool:
    """Warn (once per call) when ``root`` exists and other users may write in it.

    In a world-writable checkpoint directory another user can hold ``.hpcckpt.lock``
    (stalling every commit) or plant files beside the checkpoints.
    """
    try:
        mode = root.stat().st_mode
    except OSError:
        return False
    if not stat.S_ISDIR(mode) or not mode & stat.S_IWOTH:
        return False
    log.warning("hpcckpt: checkpoint directory %s is writable by every user (mode %o): another user "
                "could hold its lock and stall commits; use a private directory (chmod o-w %s, or "
                "a subdirectory created with mode 0700)", root, stat.S_IMODE(mode), root)
    return True


def _staging(explicit: int | str | None) -> int | str:
    """``staging_bytes`` as given, else HPCCKPT_STAGING_BYTES, else ``DEFAULT_STAGING``."""
    default: int | str = DEFAULT_STAGING
    return pick(explicit, "STAGING_BYTES", default, parse_staging)


def resolve_options(
    dir: str | os.PathLike[str] | None = None,
    *,
    engine: str | None = None,
    every_steps: int | str | None = None,
    keep: int | None = None,
    overhead_bound: float | None = None,
    signals: tuple[str | int | signal.Signals, ...] | None = None,
    deadline_margin_s: float | None = None,
    max_async: int | None = None,
    writer_threads: int | None = None,
    on_busy: str | None = None,
    memory_budget_bytes: int | None = None,
    staging_bytes: int | str | None = None,
    direct: bool | None = None,
    on_corrupt: str | None = None,
    replicated: str | None = None,
    check_replicas: bool | None = None,
    jit: bool | None = None,
    jit_timeout_s: float | None = None,
    chunk_bytes: int | None = None,
    ring_chunk_bytes: int | None = None,
    local_every_steps: int | None = None,
    local_dir: str | os.PathLike[str] | None = None,
    local_keep: int | None = None,
    partner: bool | None = None,
) -> CheckpointOptions:
    """Build options from arguments, then ``HPCCKPT_*`` variables, then defaults."""
    raw_dir = dir if dir is not None else os.environ.get("HPCCKPT_DIR")
    if raw_dir is None or not str(raw_dir).strip():
        raise ConfigError("no checkpoint directory: pass dir=... or set HPCCKPT_DIR, e.g. "
                          "HPCCKPT_DIR=/scratch/$USER/run1/ckpt")
    sigs = parse_signals(signals) if signals is not None else from_env(
        "SIGNALS", parse_signals(DEFAULT_SIGNALS), parse_signals)
    every_n, auto = _every(every_steps)
    root = Path(raw_dir).expanduser().absolute()
    if root.exists() and not root.is_dir():
        raise ConfigError(f"checkpoint directory {root} is a file, not a directory; pass a directory, "
                          "e.g. dir=/scratch/$USER/run1/ckpt")
    warn_if_shared(root)
    return CheckpointOptions(
        dir=root,
        engine=pick(engine, "ENGINE", DEFAULT_ENGINE, str),
        every_steps=every_n,
        auto_interval=auto,
        overhead_bound=pick(overhead_bound, "OVERHEAD_BOUND", 0.03, parse_float),
        keep=pick(keep, "KEEP", 3, parse_int),
        signals=sigs,
        deadline_margin_s=pick(deadline_margin_s, "DEADLINE_MARGIN_S", 30.0, parse_float),
        max_async=pick(max_async, "MAX_ASYNC", 1, parse_int),
        writer_threads=pick(writer_threads, "WRITER_THREADS", 0, parse_int),
        on_busy=pick(on_busy, "ON_BUSY", "wait", str),
        memory_budget_bytes=pick(memory_budget_bytes, "MEMORY_BUDGET_BYTES", None, parse_bytes),
        staging_bytes=_staging(staging_bytes),
        direct=pick(direct, "DIRECT", True, parse_bool),
        on_corrupt=pick(on_corrupt, "ON_CORRUPT", "raise", str),
        replicated=pick(replicated, "REPLICATED", "auto", str),
        check_replicas=pick(check_replicas, "CHECK_REPLICAS", False, parse_bool),
        jit=pick(jit, "JIT", False, parse_bool),
        jit_timeout_s=pick(jit_timeout_s, "JIT_TIMEOUT_S", None, parse_float),
        chunk_bytes=pick(chunk_bytes, "CHUNK_BYTES", CHUNK_BYTES, parse_bytes),
        ring_chunk_bytes=pick(ring_chunk_bytes, "RING_CHUNK_BYTES", None, parse_bytes),
        local_every_steps=pick(local_every_steps, "LOCAL_EVERY_STEPS", None, parse_int),
        local_dir=pick(None if local_dir is None else str(local_dir), "LOCAL_DIR", None, str),
        local_keep=pick(local_keep, "LOCAL_KEEP", 2, parse_int),
        partner=pick(partner, "PARTNER", True, parse_bool),
    )


#: the concurrent engine's keyword arguments that HPCCKPT_* variables set, with their defaults
_CONCURRENT_FROM_ENV: dict[str, Any] = {"on_busy": "wait", "memory_budget_bytes": None, "staging_bytes": DEFAULT_STAGING,
                                        "direct": True, "chunk_bytes": CHUNK_BYTES, "ring_chunk_bytes": None}


def concurrent_options(**given: Any) -> dict[str, Any]:
    """Keyword arguments for a concurrent engine made outside a Checkpointer (the benchmarks).

    Each of ``given`` that is not None as it is; the engine's other settings from their
    ``HPCCKPT_*`` variables, else their defaults. The engine itself reads no environment.
    """
    out = {k: v for k, v in given.items() if v is not None}
    for option, default in _CONCURRENT_FROM_ENV.items():
        if option not in out:
            out[option] = env_value(option, default)
    return out
