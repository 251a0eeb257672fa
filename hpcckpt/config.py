"""Tunables in one place. Each has an ``HPCCKPT_*`` environment override;
an explicit argument always beats the environment.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TypeVar

from .errors import ConfigError

T = TypeVar("T")

ENGINES = ("sync", "concurrent")
ON_BUSY = ("wait", "skip")
DEFAULT_SIGNALS = ("SIGUSR2", "SIGTERM")


def from_env(name: str, default: T, parse: Callable[[str], T]) -> T:
    """Read ``HPCCKPT_<name>``; a malformed value is an error naming the variable."""
    raw = os.environ.get(f"HPCCKPT_{name}")
    if raw is None or raw == "":
        return default
    try:
        return parse(raw)
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"environment variable HPCCKPT_{name}={raw!r} is invalid: {exc}") from exc


def pick(explicit: T | None, name: str, default: T, parse: Callable[[str], T]) -> T:
    """An explicit argument if given, else the environment, else the default."""
    return explicit if explicit is not None else from_env(name, default, parse)


def parse_signal(name: str | int | signal.Signals) -> signal.Signals:
    """'USR2', 'SIGUSR2', 12 or signal.SIGUSR2 -> signal.SIGUSR2."""
    if isinstance(name, signal.Signals):
        return name
    if isinstance(name, int) or (isinstance(name, str) and name.isdigit()):
        return signal.Signals(int(name))
    key = name.strip().upper()
    if not key.startswith("SIG"):
        key = "SIG" + key
    try:
        return signal.Signals[key]
    except KeyError:
        valid = ", ".join(s.name for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT))
        raise ConfigError(f"unknown signal {name!r}; use one of {valid} (with or without SIG)") from None


def parse_signals(raw: str) -> tuple[signal.Signals, ...]:
    return tuple(parse_signal(s) for s in raw.split(",") if s.strip())


def check_on_busy(value: str) -> str:
    """``value`` if it is a valid on_busy policy, else a ConfigError naming the choices."""
    if value not in ON_BUSY:
        raise ConfigError(f"on_busy={value!r}; use one of {', '.join(ON_BUSY)} (HPCCKPT_ON_BUSY)")
    return value


def parse_bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected one of 1/0, true/false, yes/no, on/off")


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """Where, how and how often to checkpoint (resolved; see ``resolve``)."""

    dir: Path
    engine: str = "sync"
    every_steps: int | None = None
    auto_interval: bool = False
    overhead_bound: float = 0.03
    keep: int = 3
    signals: tuple[signal.Signals, ...] = field(default_factory=lambda: tuple(parse_signal(s) for s in DEFAULT_SIGNALS))
    deadline_margin_s: float = 30.0
    max_async: int = 1
    writer_threads: int = 0
    # concurrent engine: what a save does while max_async are in flight; staging cap; O_DIRECT writes
    on_busy: str = "wait"
    memory_budget_bytes: int | None = None
    direct: bool = True

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"unknown engine {self.engine!r}; valid engines: {', '.join(ENGINES)}")
        if self.every_steps is not None and self.every_steps <= 0:
            raise ConfigError(f"every_steps must be a positive integer or None, got {self.every_steps}")
        if self.keep < 1:
            raise ConfigError(f"keep must be >= 1 (the newest verified checkpoint is always kept), got {self.keep}")
        if self.max_async < 1:
            raise ConfigError(f"max_async must be >= 1, got {self.max_async}")
        check_on_busy(self.on_busy)
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise ConfigError(f"memory_budget_bytes must be a positive byte count or None, "
                              f"got {self.memory_budget_bytes}")


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
    direct: bool | None = None,
) -> CheckpointOptions:
    """Build options from arguments, then ``HPCCKPT_*`` variables, then defaults."""
    raw_dir = dir if dir is not None else os.environ.get("HPCCKPT_DIR")
    if not raw_dir:
        raise ConfigError("no checkpoint directory: pass dir=... or set HPCCKPT_DIR")
    sigs = tuple(parse_signal(s) for s in signals) if signals is not None else from_env(
        "SIGNALS", tuple(parse_signal(s) for s in DEFAULT_SIGNALS), parse_signals)
    every: int | str | None = pick(every_steps, "EVERY_STEPS", None, str)  # type: ignore[arg-type]
    auto = isinstance(every, str) and every.strip().lower() == "auto"
    try:
        every_n = None if every is None or auto else int(every)
    except ValueError:
        raise ConfigError(f"every_steps={every!r}: use a positive integer, 'auto', or None") from None
    return CheckpointOptions(
        dir=Path(raw_dir).expanduser().absolute(),
        engine=pick(engine, "ENGINE", "sync", str),
        every_steps=every_n,
        auto_interval=auto,
        overhead_bound=pick(overhead_bound, "OVERHEAD_BOUND", 0.03, float),
        keep=pick(keep, "KEEP", 3, int),
        signals=sigs,
        deadline_margin_s=pick(deadline_margin_s, "DEADLINE_MARGIN_S", 30.0, float),
        max_async=pick(max_async, "MAX_ASYNC", 1, int),
        writer_threads=pick(writer_threads, "WRITER_THREADS", 0, int),
        on_busy=pick(on_busy, "ON_BUSY", "wait", str),
        memory_budget_bytes=pick(memory_budget_bytes, "MEMORY_BUDGET_BYTES", None, int),  # type: ignore[arg-type]
        direct=pick(direct, "DIRECT", True, parse_bool),
    )
