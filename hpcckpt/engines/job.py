"""One save of the concurrent engine on its way from staging to its commit, and the layout key
that tells whether a save's tensors fit the current staging."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..store.hostmem import one_cuda_device
from ..store.layout import Layout
from .base import SaveHandle
from .staging import Key, RingStream, Slot, Staging


@dataclass
class SaveJob:
    handle: SaveHandle
    step: int
    tmp: Path
    fname: str
    meta: Any
    layout: Layout | None
    slot: Slot | None
    batch: Any
    items: dict[str, int]
    started: float
    copied: threading.Event = field(default_factory=threading.Event)
    cuda_event: Any = None
    device: Any = None  # the CUDA device of cuda_event's copies
    d2h_events: tuple[Any, Any, int] | None = None  # (begin, end, bytes) of a slot's D2H copy
    staging: Staging | None = None
    ring: RingStream | None = None
    sources: dict[str, Any] | None = None  # ring: source byte views; CUDA slot: device clones; until copied
    error: BaseException | None = None  # failed before persisting: only the commit exchange is left
    placement: dict[str, Any] = field(default_factory=dict)  # the record's distributed-tensor fields
    # Items added in bulk (``_stage_host``): (first item id, indices into layout.names), in order.
    groups: list[tuple[int, np.ndarray]] = field(default_factory=list)
    # Its slot's bytes are durable and the slot is free: only its commit is left (``_busy``).
    persisted: bool = False
    # A slot filled by a D2H copy: set once the launcher thread saw the copy done and started
    # the batch (or failed to: ``launch_error``).
    launched: threading.Event = field(default_factory=threading.Event)
    launch_error: BaseException | None = None


def layout_key(tensors: dict[str, torch.Tensor]) -> Key:
    """The layout key of a capture: (name, dtype, shape) of each tensor, and the CUDA device
    whose copies the staging serves (pinned then), None when nothing is on a GPU.

    ConfigError when tensors are on several CUDA devices: one side stream, one pinned
    context (run one process per GPU).
    """
    specs = tuple((n, t.dtype, tuple(t.shape)) for n, t in tensors.items())
    device = one_cuda_device((t.device for t in tensors.values()), "checkpoint")
    return specs, None if device is None else device.index
