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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

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


# --- the table: every HPCCKPT_* variable, with its default, its rule and an example ------------

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_path(v: Any) -> bool:
    return isinstance(v, str) and v.strip() != ""


@dataclass(frozen=True)
class Tunable:
    """One row of the table.

    ``env`` is its variable; ``default`` its value when neither an argument nor the variable
    gives one; ``parse`` reads the variable's text; ``rule`` says in words what is valid and
    ``ok`` tests a value; ``example`` is a valid one. ``group`` names the options dataclass the
    row is a field of ("" for a variable with no keyword); ``coerce`` makes an explicit
    argument a value (names of signals into signals) before the rule is applied.
    """

    env: str
    parse: Callable[[str], Any]
    ok: Callable[[Any], bool]
    rule: str
    example: str
    default: Any = None
    group: str = ""
    coerce: Callable[[Any], Any] | None = None


_ROW = "hpcckpt.option"  # the metadata key of a dataclass field that is a row of the table


def option(default: Any, parse: Callable[[str], Any], ok: Callable[[Any], bool], rule: str, example: str, *,
           coerce: Callable[[Any], Any] | None = None) -> Any:
    """A field of an options dataclass that is a row of ``TUNABLES``: its keyword is the field's
    name, its variable ``HPCCKPT_<NAME>``, its default ``default``. Nothing else lists it."""
    return field(default=default, metadata={_ROW: Tunable("", parse, ok, rule, example, default, coerce=coerce)})


def parse_every(raw: str) -> int | str:
    """'100' -> 100, 'auto' -> 'auto' (every_steps)."""
    if raw.strip().lower() == "auto":
        return "auto"
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError("expected a whole number of steps > 0 or auto") from None


def _every_arg(value: Any) -> Any:
    """An explicit every_steps: a number, or text ('100', 'auto') read as the variable is."""
    return parse_every(value) if isinstance(value, str) else value


def _stop_signals_ok(value: Any) -> bool:
    if not isinstance(value, tuple) or not value:
        return False
    try:
        for sig in value:
            parse_signal(sig)
    except ConfigError:
        return False
    return True


@dataclass(frozen=True, kw_only=True)
class _Rows:
    """Options made of rows: each field that is a row is checked by its rule, then each class's
    ``_rules`` (what involves several fields) runs, base classes first."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if _ROW in f.metadata:
                validate(f.name, getattr(self, f.name))
        for cls in reversed(type(self).__mro__):
            rules = cls.__dict__.get("_rules")
            if rules is not None:
                rules(self)


@dataclass(frozen=True, kw_only=True)
class SaveOptions(_Rows):
    """What a save is and how often it is made."""

    engine: str = option(DEFAULT_ENGINE, str, lambda v: v in ENGINES, f"one of the valid engines: {', '.join(ENGINES)}",
                         "sync")
    # One meaning, with or without levels: how often a checkpoint reaches the checkpoint
    # directory. local_every_steps adds node-local checkpoints between those.
    every_steps: int | None = option(
        None, parse_every, lambda v: v is None or v == "auto" or (_is_int(v) and v > 0),
        "a whole number of steps > 0, or auto: a checkpoint is committed to the checkpoint directory every this "
        "many steps (auto: an interval measured to cost at most overhead_bound); unset: only at a stop. "
        "With local_every_steps, node-local checkpoints come in between", "100", coerce=_every_arg)
    keep: int = option(3, parse_int, lambda v: _is_int(v) and v >= 1,
                       "a whole number >= 1 (the newest verified checkpoint is always kept)", "5")
    overhead_bound: float = option(0.03, parse_float, lambda v: _is_num(v) and 0 < v <= 1,
                                   "a fraction of step time in (0, 1]", "0.05")
    replicated: str = option("auto", lambda s: s.strip().lower(), lambda v: v in REPLICATED,
                             f"one of {', '.join(REPLICATED)} (which registered state is identical on every rank)",
                             "models")
    check_replicas: bool = option(  # debug: compare checksums of the replicated tensors across ranks at each save
        False, parse_bool, lambda v: isinstance(v, bool),
        "a boolean (1/0, true/false): checksum the replicated tensors at each save and compare ranks", "1")


@dataclass(frozen=True, kw_only=True)
class StopOptions(_Rows):
    """When a run stops: the signals it takes as a warning, the margin before its end time."""

    signals: tuple[signal.Signals, ...] = option(parse_signals(DEFAULT_SIGNALS), parse_signals, _stop_signals_ok,
                                                 "catchable stop signals, comma-separated", "SIGUSR1,SIGTERM",
                                                 coerce=parse_signals)
    deadline_margin_s: float = option(30.0, parse_float, lambda v: _is_num(v) and v >= 0,
                                      "seconds >= 0 before the job's end time to stop", "60")


@dataclass(frozen=True, kw_only=True)
class ConcurrentOptions(_Rows):
    """The concurrent engine's settings (``engines.concurrent.ConcurrentEngine``)."""

    max_async: int = option(1, parse_int, lambda v: _is_int(v) and 1 <= v <= 64,
                            "a whole number of checkpoints in flight, 1 to 64", "2")
    writer_threads: int = option(0, parse_int, lambda v: _is_int(v) and 0 <= v <= 1024,
                                 "a whole number of threads, 0 (one per core) to 1024", "4")
    on_busy: str = option("wait", str, lambda v: v in ON_BUSY,
                          f"one of {', '.join(ON_BUSY)}: what a save does while max_async are in flight", "skip")
    memory_budget_bytes: int | None = option(None, parse_bytes, lambda v: v is None or (_is_int(v) and v > 0),
                                             "a positive byte count (K, M, G, T suffixes are binary)", "4GiB")
    staging_bytes: int | str | None = option(
        DEFAULT_STAGING, parse_staging, lambda v: v is None or v in STAGING or (_is_int(v) and v > 0),
        "auto (a quarter of the state, a full copy up to 64 MiB, within the node's available memory), "
        "full (a copy of the state per save in flight), or a positive byte count of host staging per rank, "
        "a ring when below the state's size", "1GiB")
    # O_DIRECT by default: on the reference VM buffered pwrite + fdatasync of 1 GB ran at
    # 0.3-0.5 GB/s, O_DIRECT at 1.7-2.0 GB/s (the page cache copy and writeback cost more
    # than they save). File systems that refuse O_DIRECT fall back to the page cache.
    direct: bool = option(True, parse_bool, lambda v: isinstance(v, bool),
                          "1/0, true/false, yes/no, on/off: write with O_DIRECT", "0")
    chunk_bytes: int = option(CHUNK_BYTES, parse_bytes, lambda v: _is_int(v) and 4096 <= v <= 1 << 32,
                              "a byte count from 4 KiB to 4 GiB: one writer thread's piece of a file", "16M")
    ring_chunk_bytes: int | None = option(
        None, parse_bytes, lambda v: v is None or (_is_int(v) and 8192 <= v <= 1 << 32),
        "a byte count of one staging ring chunk, 8 KiB to 4 GiB (unset: the engine's size)", "64M")

    def _rules(self) -> None:
        sb, budget = self.staging_bytes, self.memory_budget_bytes
        if isinstance(sb, int) and budget is not None and sb > budget:  # a bool was refused by its rule
            raise ConfigError(f"staging_bytes={sb} exceeds memory_budget_bytes={budget}; lower "
                              "HPCCKPT_STAGING_BYTES or raise the budget")


@dataclass(frozen=True, kw_only=True)
class LevelOptions(_Rows):
    """Multi-level checkpoints (``hpcckpt.levels``): node-local (+ partner) every local_every_steps."""

    local_every_steps: int | None = option(
        None, parse_int, lambda v: v is None or (_is_int(v) and v > 0),
        "a whole number of steps > 0: a node-local checkpoint (and a partner copy on another node) every "
        "this many steps; every_steps stays the interval of the checkpoint directory, a multiple of it", "1")
    local_dir: str | None = option(
        None, str, lambda v: v is None or _is_path(v),
        "a node-local directory path for the node-local level (%n: the node name; default: the job's "
        "prolog-made staging, else /dev/shm)", "/local/$USER/hpcckpt", coerce=str)
    local_keep: int = option(2, parse_int, lambda v: _is_int(v) and v >= 1,
                             "a whole number >= 1 of node-local checkpoints kept on each node", "3")
    partner: bool = option(True, parse_bool, lambda v: isinstance(v, bool),
                           "a boolean (1/0): each node-local checkpoint is also copied to a partner node's "
                           "node-local level", "0")


@dataclass(frozen=True, kw_only=True)
class RestoreOptions(_Rows):
    """What a resume does when it cannot read a checkpoint."""

    on_corrupt: str = option("raise", lambda s: s.strip().lower(), lambda v: v in ON_CORRUPT,
                             f"one of {', '.join(ON_CORRUPT)} (what to do when every checkpoint is damaged)", "fresh")


@dataclass(frozen=True, kw_only=True)
class JitOptions(_Rows):
    """Just-in-time checkpoints by the survivors when a rank dies or hangs (``hpcckpt.jit``)."""

    jit: bool = option(False, parse_bool, lambda v: isinstance(v, bool),
                       "a boolean (1/0, true/false): survivors write a checkpoint when a rank dies or hangs", "1")
    jit_timeout_s: float = option(5.0, parse_float, lambda v: _is_num(v) and 0.5 <= v <= 3600,
                                  "seconds from 0.5 to 3600 a silent rank may take before it counts as failed", "10")


#: the options dataclasses whose fields are the rows with a keyword, in the reference's order
GROUPS: tuple[type[_Rows], ...] = (SaveOptions, StopOptions, ConcurrentOptions, LevelOptions, RestoreOptions,
                                   JitOptions)

# Variables without a keyword: a path, the stop's finer settings, the CRIU mode's, and the ones
# hpcckpt sets for its own processes. A reader takes the row's default unless it says otherwise.
_VARIABLES = (
    Tunable("HPCCKPT_RESTORE_CHUNK_BYTES", parse_bytes, lambda v: _is_int(v) and 8192 <= v <= 1 << 32,
            "a byte count of one pinned chunk of a restore onto the GPU, 8 KiB to 4 GiB", "128M", 128 << 20, "restore"),
    Tunable("HPCCKPT_WARNING_WINDOW_S", parse_float, lambda v: _is_num(v) and v >= 0,
            "seconds >= 0: a warning signal with at most this much time left waits for the deadline "
            "(0: every warning stops at once)", "300", 300.0, "stop"),
    Tunable("HPCCKPT_POLL_S", parse_float, lambda v: _is_num(v) and 0.5 <= v <= 600,
            "seconds from 0.5 to 600 between the job's reads of its end time, maintenance reservations "
            "and drain state from Slurm (keep it under the partition's GraceTime)", "5", None, "stop"),
    Tunable("HPCCKPT_STOP_AT_STEPS", parse_steps,
            lambda v: isinstance(v, tuple) and all(_is_int(s) and s > 0 for s in v),
            "step numbers > 0, comma-separated: stop there as on a signal (set by hpcckpt check)", "12,40", (), "stop"),
    Tunable("HPCCKPT_CLUSTER", lambda s: s.strip().lower(), lambda v: v in CLUSTERS,
            f"one of {', '.join(CLUSTERS)}", "slurm-cli"),
    Tunable("HPCCKPT_NOTICE", str, lambda v: isinstance(v, str),
            "how a supervised script hears the stop: a signal name or 'file PATH' (set by hpcckpt run --mode own)",
            "SIGTERM"),
    Tunable("HPCCKPT_NOTICE_FILE", str, lambda v: isinstance(v, str),
            "a file path written at the stop's notice (set by hpcckpt run --mode own --notice file)",
            "/scratch/run/STOP-NOTICE"),
    Tunable("HPCCKPT_STAGING_ROOT", str, _is_path,
            "a directory path for per-job node-local staging (%n: the node name; as slurm/prolog)",
            "/local/hpcckpt-staging"),
    Tunable("HPCCKPT_CRIU", str, _is_path, "the path of a criu >= 4 binary or wrapper (CRIU mode)",
            "/opt/hpcckpt/criu/bin/criu"),
    Tunable("HPCCKPT_CRIU_PREFIX", str, _is_path, "the prefix scripts/install-criu installed criu under",
            "/opt/hpcckpt/criu"),
    Tunable("HPCCKPT_LIBCUDA", str, _is_path, "the path of the NVIDIA driver library (CUDA checkpoint API)",
            "libcuda.so.1"),
    Tunable("HPCCKPT_END_TIME", parse_float, lambda v: _is_num(v) and v > 0,
            "epoch seconds when the job will be stopped", "1767225600"),
    *(Tunable(f"HPCCKPT_REQUEUE_MAX_{key}", parse_int, lambda v: _is_int(v) and v >= 0,
              "a whole number of requeues >= 0", "10")
      for key in ("TIME_LIMIT", "PREEMPTION", "SIGNAL", "FAILURE", "RANK_FAILURE", "FAILURES_WITHOUT_PROGRESS")),
)
# Variables hpcckpt sets for its own processes (a supervisor for its command, a job for its
# successor, the templates for the job's own later reading, `hpcckpt check` for its runs): not
# options, so outside the user's HPCCKPT_* namespace. Each is read under its _HPCCKPT_ name and,
# for one release, under the HPCCKPT_ name older versions set: a job queued or requeued across an
# upgrade still carries it (its stored batch script exported it).
INTERNAL_PREFIX = "_HPCCKPT_"
_INTERNAL = (
    Tunable("_HPCCKPT_SUCCESSOR_GENERATION", parse_int, lambda v: _is_int(v) and v >= 0,
            "a whole number >= 0: how many successor jobs came before this one (set on a successor job)", "1", 0,
            "internal"),
    Tunable("_HPCCKPT_PREDECESSOR_JOB_ID", str, lambda v: isinstance(v, str),
            "the job id of the job that submitted this one as its successor (set on a successor job)", "1234",
            None, "internal"),
    Tunable("_HPCCKPT_LOCAL_RESTART", parse_int, lambda v: _is_int(v) and v >= 0,
            "a whole number >= 0: the local supervisor's restart of the command", "1", 0, "internal"),
    Tunable("_HPCCKPT_CHECK_TRACE", str, lambda v: isinstance(v, str),
            "a file path: each step's state digests are appended there (set by hpcckpt check)", "/tmp/trace.jsonl",
            None, "internal"),
    Tunable("_HPCCKPT_CRIU_FALLBACK", str, lambda v: isinstance(v, str),
            "fresh: do not resume (set by `hpcckpt run --mode criu --on-restore-failure fresh`)", "fresh", None,
            "internal"),
    Tunable("_HPCCKPT_BATCH_ARGS_JOB", str, lambda v: isinstance(v, str),
            "the SLURM_JOB_ID the exported batch arguments belong to (set by the templates)", "1234", None,
            "internal"),
    Tunable("_HPCCKPT_BATCH_ARGC", parse_int, lambda v: _is_int(v) and v >= 0,
            "how many _HPCCKPT_BATCH_ARG_<n> (the batch script's arguments) the templates exported", "2", None,
            "internal"),
)


def internal_var(name: str) -> str:
    """The variable hpcckpt sets for its own processes: ``LOCAL_RESTART`` -> ``_HPCCKPT_LOCAL_RESTART``."""
    return INTERNAL_PREFIX + name


def internal_source(name: str, environ: Mapping[str, str] | None = None) -> tuple[str, str | None]:
    """(the variable that holds the internal value ``name``, its raw value): its ``_HPCCKPT_``
    name, else the ``HPCCKPT_`` one older versions set; (the new name, None) when neither is set."""
    env = os.environ if environ is None else environ
    for var in (internal_var(name), f"HPCCKPT_{name}"):
        if var in env:
            return var, env[var]
    return internal_var(name), None


def read_internal(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The raw value of the internal variable ``name`` (``LOCAL_RESTART``): ``internal_source``'s."""
    return internal_source(name, environ)[1]


_DIR = Tunable("HPCCKPT_DIR", str, _is_path, "a directory path (the checkpoint root, on a shared file system)",
               "/scratch/$USER/run1/ckpt", None, "save")


def _table() -> dict[str, Tunable]:
    rows = {"dir": _DIR}
    for group in GROUPS:
        name = group.__name__.removesuffix("Options").lower()
        for f in fields(group):
            if _ROW in f.metadata:
                rows[f.name] = replace(f.metadata[_ROW], env=f"HPCCKPT_{f.name.upper()}", group=name)
    rows.update((row.env.removeprefix("HPCCKPT_").lower(), row) for row in _VARIABLES)
    rows.update((row.env.removeprefix(INTERNAL_PREFIX).lower(), row) for row in _INTERNAL)
    return rows


#: Every HPCCKPT_* variable the package reads, by option name: the fields of the options
#: dataclasses above (each field is its row) and the variables without a keyword.
#: tests/unit/test_options_table.py checks that the package reads no other, that each row with
#: a keyword reaches its field from its argument and its variable, and that README.md and the
#: options reference name each.
TUNABLES: dict[str, Tunable] = _table()
#: the keywords of resolve_options besides ``dir``: every field that is a row
KEYWORDS: tuple[str, ...] = tuple(f.name for group in GROUPS for f in fields(group) if _ROW in f.metadata)


def validate(option: str, value: T, *, source: str | None = None) -> T:
    """``value`` if valid for ``option`` (a key of TUNABLES), else a ConfigError naming it."""
    spec = TUNABLES[option]
    if spec.ok(value):
        return value
    where = source or f"{option}={value!r}"
    raise ConfigError(f"{where} is invalid: expected {spec.rule}; e.g. {option}={spec.example} "
                      f"or {spec.env}={spec.example}")


def check_jit_timeout(value: Any) -> float:
    """A JIT timeout given outside ``resolve_options`` (``JitGuard(timeout_s=...)``) checked by the
    table's one rule; None gives the table's default. A ConfigError naming jit_timeout_s otherwise."""
    if value is None:
        return float(TUNABLES["jit_timeout_s"].default)
    return float(validate("jit_timeout_s", value))


def from_env(name: str, default: T, parse: Callable[[str], T],
             environ: Mapping[str, str] | None = None) -> T:
    """Read ``HPCCKPT_<name>`` (from ``environ``, default ``os.environ``); a malformed or
    out-of-range value is an error naming the variable.

    Variables listed in TUNABLES are parsed and checked by their own rule (``parse`` is
    then only the fallback for names the table does not know).
    """
    raw = (os.environ if environ is None else environ).get(f"HPCCKPT_{name}")
    return _parsed(f"HPCCKPT_{name}", raw, name.lower(), default, parse)


def _parsed(var: str, raw: str | None, option: str, default: T, parse: Callable[[str], T]) -> T:
    """``raw`` (the value of ``var``) parsed and checked by the row ``option`` (``parse`` when
    the table has no such row); ``default`` when unset or blank."""
    if raw is None or raw.strip() == "":
        return default
    spec = TUNABLES.get(option)
    try:
        value = (spec.parse if spec else parse)(raw)
    except (ValueError, KeyError, ConfigError) as exc:
        hint = f"; e.g. {var}={spec.example}" if spec else ""
        raise ConfigError(f"environment variable {var}={raw!r} is invalid: {exc}{hint}") from None
    if spec is not None:
        validate(option, value, source=f"environment variable {var}={raw!r}")
    return value


_TABLE_DEFAULT: Any = object()


def env_value(option: str, default: Any = _TABLE_DEFAULT, environ: Mapping[str, str] | None = None) -> Any:
    """The validated ``HPCCKPT_<OPTION>`` for a key of TUNABLES, else ``default``, else the row's default."""
    spec = TUNABLES[option]
    fallback = spec.default if default is _TABLE_DEFAULT else default
    if spec.group == "internal":  # set by hpcckpt itself: its _HPCCKPT_ name, else the older one
        var, raw = internal_source(spec.env.removeprefix(INTERNAL_PREFIX), environ)
        return _parsed(var, raw, option, fallback, spec.parse)
    return from_env(spec.env.removeprefix("HPCCKPT_"), fallback, spec.parse, environ)


def resolve(option: str, explicit: Any = None, environ: Mapping[str, str] | None = None) -> Any:
    """One option: an explicit argument if given (made a value by its row's ``coerce``, then
    checked by its rule), else its ``HPCCKPT_*`` variable, else the table's default."""
    spec = TUNABLES[option]
    if explicit is None:
        return env_value(option, spec.default, environ)
    if spec.coerce is not None:
        try:
            explicit = spec.coerce(explicit)
        except ValueError as exc:
            raise ConfigError(f"{option}={explicit!r} is invalid: {exc}; e.g. {option}={spec.example} "
                              f"or {spec.env}={spec.example}") from None
    return validate(option, explicit)


# --- the options ------------------------------------------------------------------------------

G = TypeVar("G", bound=_Rows)


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions(JitOptions, RestoreOptions, LevelOptions, ConcurrentOptions, StopOptions, SaveOptions):
    """Where, how and how often to checkpoint (resolved; see ``resolve_options``): one field per
    row of the groups it is made of (``GROUPS``; listed here last to first, so that its fields
    come in the table's order), plus the directory and whether the interval is measured."""

    dir: Path
    auto_interval: bool = False  # every_steps="auto": the interval is measured (lifecycle.policy)

    def _rules(self) -> None:
        if self.every_steps == "auto":  # a CheckpointOptions made directly with "auto"
            object.__setattr__(self, "every_steps", None)
            object.__setattr__(self, "auto_interval", True)
        if self.local_every_steps is None:
            return
        if self.auto_interval:
            raise ConfigError("every_steps='auto' does not combine with local_every_steps: give the interval of "
                              "the checkpoint directory in steps, e.g. every_steps=100, local_every_steps=10")
        if self.every_steps is not None and self.every_steps % self.local_every_steps:
            raise ConfigError(f"every_steps={self.every_steps} (the checkpoint directory's interval) is not a "
                              f"multiple of local_every_steps={self.local_every_steps}: the checkpoint directory "
                              f"is filled from a node-local checkpoint; e.g. every_steps={self.local_every_steps * 10}")

    def part(self, group: type[G]) -> G:
        """The fields of one group (e.g. ``ConcurrentOptions``) as that group's own object."""
        return group(**{f.name: getattr(self, f.name) for f in fields(group)})

    @property
    def concurrent(self) -> ConcurrentOptions:
        """What the concurrent engine takes (``make_engine(..., options=...)``)."""
        return self.part(ConcurrentOptions)


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


def _root(dir: str | os.PathLike[str] | None) -> Path:
    raw_dir = dir if dir is not None else os.environ.get("HPCCKPT_DIR")
    if raw_dir is None or not str(raw_dir).strip():
        raise ConfigError("no checkpoint directory: pass dir=... or set HPCCKPT_DIR, e.g. "
                          "HPCCKPT_DIR=/scratch/$USER/run1/ckpt")
    root = Path(raw_dir).expanduser().absolute()
    if root.exists() and not root.is_dir():
        raise ConfigError(f"checkpoint directory {root} is a file, not a directory; pass a directory, "
                          "e.g. dir=/scratch/$USER/run1/ckpt")
    return root


def _unknown(where: str, given: Mapping[str, Any], known: tuple[str, ...]) -> None:
    wrong = sorted(set(given) - set(known))
    if wrong:
        raise TypeError(f"{where} got unknown option(s) {', '.join(wrong)}; the options are: {', '.join(known)} "
                        "(docs/reference/options.md)")


def resolve_options(dir: str | os.PathLike[str] | None = None, **given: Any) -> CheckpointOptions:
    """Build options from arguments, then ``HPCCKPT_*`` variables, then the table's defaults.

    The keywords are the fields of the groups in ``GROUPS`` (``KEYWORDS``; the options
    reference lists them); None means "not given".
    """
    _unknown("resolve_options()", given, KEYWORDS)
    values = {name: resolve(name, given.get(name)) for name in KEYWORDS}
    root = _root(dir)
    auto = values["every_steps"] == "auto"
    if auto:
        values["every_steps"] = None
    warn_if_shared(root)
    return CheckpointOptions(dir=root, auto_interval=auto, **values)


def engine_options(**given: Any) -> ConcurrentOptions:
    """The concurrent engine's options outside a Checkpointer (the benchmarks): each of ``given``
    that is not None as it is, the others from their ``HPCCKPT_*`` variables, else the table's
    defaults. The engine itself reads no environment."""
    names = tuple(f.name for f in fields(ConcurrentOptions))
    _unknown("engine_options()", given, names)
    return ConcurrentOptions(**{name: resolve(name, given.get(name)) for name in names})


def concurrent_options(**given: Any) -> dict[str, Any]:
    """``engine_options`` as keyword arguments (for callers that still pass them as such)."""
    opts = engine_options(**given)
    return {f.name: getattr(opts, f.name) for f in fields(ConcurrentOptions)}
