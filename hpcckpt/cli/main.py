"""``hpcckpt`` entry point.

Every module in ``hpcckpt.cli`` that defines ``register(subparsers)`` adds a verb;
its parser sets ``func=run`` with ``run(args) -> int``. Exit codes:

  0  success
  1  the verb ran and found a problem (verify: corruption; demo: not identical)
  2  bad usage or configuration (argparse, ConfigError)
  3  nothing to act on (no checkpoint, no job)
  4  an external tool or the scheduler failed (criu, scontrol, CUDA driver)
 75  the job asked to be requeued (EX_TEMPFAIL; from `hpcckpt run`)
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import pkgutil
import sys
from typing import Sequence

from ..errors import ClusterError, ConfigError, CriuError, CudaCheckpointError, HpcckptError, NoCheckpoint

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, EXIT_NOTHING, EXIT_EXTERNAL = 0, 1, 2, 3, 4


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpcckpt", description="Keep PyTorch training jobs alive on Slurm.",
        epilog="Exit codes: 0 ok, 1 problem found, 2 usage/config error, 3 nothing to act on, "
               "4 external tool failed, 75 requeue requested.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    import hpcckpt.cli as pkg
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if info.name in ("main", "__main__", "common"):
            continue
        mod = importlib.import_module(f"hpcckpt.cli.{info.name}")
        if hasattr(mod, "register"):
            mod.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except HpcckptError as exc:
        code = (EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_NOTHING if isinstance(exc, NoCheckpoint)
                else EXIT_EXTERNAL if isinstance(exc, (ClusterError, CriuError, CudaCheckpointError))
                else EXIT_PROBLEM)
        if getattr(args, "json", False):
            print(json.dumps({"error": str(exc), "type": type(exc).__name__}))
        else:
            print(f"hpcckpt {args.verb}: error: {exc}", file=sys.stderr)
        return code
