"""How state becomes a checkpoint: ``sync`` (baseline) and ``concurrent`` (PCcheck-style)."""
from __future__ import annotations

from ..errors import ConfigError
from ..ranks import Ranks
from ..store.read import load_rank  # loading belongs to the store; kept here for callers
from .base import Engine, SaveContext, SaveHandle


def make_engine(name: str, ctx: SaveContext, ranks: Ranks, **options: object) -> Engine:
    if name == "sync":
        from .sync import SyncEngine
        return SyncEngine(ctx, ranks)
    if name == "concurrent":
        from .concurrent import ConcurrentEngine
        return ConcurrentEngine(ctx, ranks, **options)  # type: ignore[arg-type]  # options: keyword arguments of ConcurrentEngine, typed object here
    raise ConfigError(f"unknown engine {name!r}; valid engines: sync, concurrent")


__all__ = ["Engine", "SaveContext", "SaveHandle", "load_rank", "make_engine"]
