"""``hpcckpt prolog`` / ``hpcckpt epilog``: the Slurm node hooks shipped with hpcckpt.

Slurm runs Prolog/Epilog as root with only Slurm's environment (no virtualenv), so
slurm.conf should name the scripts themselves: ``hpcckpt prolog --path`` prints where
they are. Without ``--path`` the verb runs the hook here, with this environment (a
dry run on a node, or from a wrapper that Slurm calls), and exits with its status.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from hpcckpt.cli.common import add_json, emit
from hpcckpt.errors import ConfigError

HOOKS = {"prolog": "prepare node-local staging before a job (slurm.conf Prolog=)",
         "epilog": "record the interruption, scavenge node-local checkpoints and clean staging after a job "
                   "(slurm.conf Epilog=)"}


def hook_script(name: str) -> Path:
    """The hook in a wheel (hpcckpt/slurm/) or in a source checkout (slurm/ beside hpcckpt/)."""
    pkg = Path(__file__).resolve().parents[1]
    candidates = [pkg / "slurm" / name, pkg.parent / "slurm" / name]
    for path in candidates:
        if path.is_file():
            return path
    raise ConfigError(f"the {name} script is not installed (looked in {', '.join(map(str, candidates))}); "
                      "reinstall hpcckpt (pip install hpcckpt, or pip install -e . in a checkout)")


def register(sub: argparse._SubParsersAction) -> None:
    for name, text in HOOKS.items():
        p = sub.add_parser(name, help=text, description=__doc__)
        p.add_argument("--path", action="store_true", help="print the script's path (for slurm.conf) and exit")
        add_json(p)
        p.set_defaults(func=run, hook=name)


def run(args: argparse.Namespace) -> int:
    script = hook_script(args.hook)
    if args.path:
        emit(args, {"hook": args.hook, "script": str(script)}, str(script))
        return 0
    # The hook writes its own messages to stderr; with --json its stdout is folded into the record.
    proc = subprocess.run(["bash", str(script)], check=False, text=True,
                          stdout=subprocess.PIPE if args.json else None)
    if args.json:
        emit(args, {"hook": args.hook, "script": str(script), "returncode": proc.returncode,
                    "stdout": proc.stdout}, "")
    sys.stdout.flush()
    return proc.returncode
