"""``hpcckpt cuda state|lock|checkpoint|restore|unlock|toggle|restore-tid PID``.

Moves a CUDA process through the driver's checkpoint states (driver >= 570):
RUNNING -lock-> LOCKED -checkpoint-> CHECKPOINTED -restore-> LOCKED -unlock-> RUNNING.
``toggle`` goes RUNNING -> CHECKPOINTED or back. PIDs are as seen from here.
A stopped process is refused, a traced one after ~10 s for its tracer to let go (the
driver works through the process's own restore thread); a call that does not return
within --call-timeout-s is reported stuck (a state query: after 30 s, "could not query"),
and the command then exits at once, past the CUDA library's teardown, which would wait
for that call.
"""
from __future__ import annotations

import argparse

from .common import add_json, emit, positive_seconds

ACTIONS = ("state", "lock", "checkpoint", "restore", "unlock", "toggle", "restore-tid")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cuda", help="CUDA checkpoint API on a process (lock/checkpoint/restore/unlock)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=ACTIONS)
    p.add_argument("pid", type=int)
    p.add_argument("--timeout-ms", type=int, default=0,
                   help="the driver's lock timeout (0 = the driver waits indefinitely)")
    p.add_argument("--call-timeout-s", type=positive_seconds, default=None,
                   help="give up on a driver call that has not returned after this long and report it stuck "
                        "(default 600; a lock gets --timeout-ms on top)")
    add_json(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..cuda import driver
    from ..errors import HpcckptError
    from .main import _code

    try:
        code = _run(args)
    except HpcckptError as exc:
        # A call still blocked in the driver could hang the exit in libcuda's teardown: the
        # driver module then leaves at once with this status (main reports the error first).
        driver.set_exit_status(_code(exc))
        raise
    driver.set_exit_status(code)
    return code


def _run(args: argparse.Namespace) -> int:
    from ..cuda import CudaCheckpoint
    from ..cuda.driver import CALL_TIMEOUT_S

    cu = CudaCheckpoint(call_timeout_s=args.call_timeout_s or CALL_TIMEOUT_S)
    pid = args.pid
    result: dict[str, object] = {"pid": pid, "action": args.action, "driver_api": cu.info.text}
    if args.action == "restore-tid":
        result["restore_tid"] = cu.restore_thread_id(pid)
    elif args.action == "toggle":
        cu.toggle(pid, timeout_ms=args.timeout_ms)
    elif args.action == "lock":
        cu.lock(pid, timeout_ms=args.timeout_ms)
    elif args.action != "state":
        getattr(cu, args.action)(pid)
    result["state"] = cu.state(pid).name.lower()
    text = str(result.get("restore_tid", result["state"]))
    emit(args, result, text)
    return 0
