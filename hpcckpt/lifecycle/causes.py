"""Why a run stopped, as its ``stop`` record spells it, and the ``Cause`` that stop is charged to.

One map for every reader: the in-process stop (``policy.StopReason.cause``) and ``hpcckpt
requeue`` (the cause of the ledger's last ``stop`` when none is given). Slurm's own record of
a stop refines the cause afterwards (``hpcckpt.cluster.causes.refine_cause``).
"""
from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from ..cluster.base import Cause

# A stop's ``reason`` -> the cause it is charged to (per-cause requeue budgets, history).
# Reasons that name no interruption ("done", "after_run", a StopReason of NONE) are not here:
# each reader says what they mean to it (``default``).
STOP_REASON_CAUSE: Mapping[str, Cause] = MappingProxyType({
    "signal": Cause.SIGNAL,
    "deadline": Cause.TIME_LIMIT,
    "maintenance": Cause.MAINTENANCE,
    "drain": Cause.MAINTENANCE,
    "error": Cause.FAILURE,
    "rank_failure": Cause.RANK_FAILURE,
})


def stop_cause(reason: object, default: Cause = Cause.SIGNAL) -> Cause:
    """The cause a stop with ``reason`` is charged to; ``default`` for a reason that names none."""
    return STOP_REASON_CAUSE.get(reason, default) if isinstance(reason, str) else default
