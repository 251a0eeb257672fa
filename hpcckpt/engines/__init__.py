"""How state becomes a checkpoint: ``sync`` (baseline) and ``concurrent`` (PCcheck-style)."""
from __future__ import annotations

from typing import Any

from ..config import ConcurrentOptions
from ..errors import ConfigError
from ..ranks import Ranks
from ..store.read import load_rank  # loading belongs to the store; kept here for callers
from .base import Engine, SaveContext, SaveHandle


def make_engine(name: str, ctx: SaveContext, ranks: Ranks, options: ConcurrentOptions | None = None,
                **settings: Any) -> Engine:
    """The engine ``name``; ``options``: the concurrent engine's (``CheckpointOptions.concurrent``,
    ``config.engine_options``); ``settings``, fields of ``ConcurrentOptions`` given one by one,
    replace those of ``options``."""
    if name == "sync":
        from .sync import SyncEngine
        return SyncEngine(ctx, ranks)
    if name == "concurrent":
        from .concurrent import ConcurrentEngine
        return ConcurrentEngine(ctx, ranks, options, **settings)
    raise ConfigError(f"unknown engine {name!r}; valid engines: sync, concurrent")


__all__ = ["Engine", "SaveContext", "SaveHandle", "load_rank", "make_engine"]
