"""``hpcckpt`` entry point.

Every module in ``hpcckpt.cli`` that defines ``register(subparsers)`` adds a verb;
its parser sets ``func=run`` with ``run(args) -> int``. Exit codes:

  0  success
  1  the verb ran and found a problem (verify: corruption; demo: not identical)
  2  bad usage or configuration (argparse, ConfigError)
  3  nothing to act on (no checkpoint, no job)
  4  an external tool or the scheduler failed (criu, scontrol, CUDA driver)
 70  an internal error (a bug; -vv prints the traceback)
 75  the job asked to be requeued (EX_TEMPFAIL; from `hpcckpt run`)
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import pkgutil
import sys
from collections.abc import Sequence

from ..errors import ClusterError, ConfigError, CriuError, CudaCheckpointError, HpcckptError, NoCheckpoint
from ..exitcodes import EXIT_EXTERNAL, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_NOTHING, EXIT_PROBLEM, EXIT_USAGE

log = logging.getLogger("hpcckpt.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpcckpt", description="Keep PyTorch training jobs alive on Slurm.",
        epilog="Exit codes: 0 ok, 1 problem found, 2 usage/config error, 3 nothing to act on, "
               "4 external tool failed, 70 internal error, 75 requeue requested.")
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
    for verb, verb_parser in sub.choices.items():
        page = DOCS.get(verb, "docs/reference/cli.md")
        more = f"Read next: {page} (and docs/reference/cli.md#{verb})."
        verb_parser.epilog = f"{verb_parser.epilog}\n\n{more}" if verb_parser.epilog else more
    _list_by_group(parser, sub)
    return parser


# How users meet the verbs: ``hpcckpt --help`` lists a job's own verbs first, then these
# groups (every verb keeps its name: ``hpcckpt prolog`` is still ``hpcckpt prolog``).
GROUPS = {
    "node and admin verbs (Slurm's Prolog=/Epilog= as root, or an administrator)": ("prolog", "epilog", "scavenge"),
    "developer verbs (hpcckpt itself: a demonstration, measurements, a probe)": ("bench", "demo", "cuda"),
}
USER_VERBS = "verbs"


def verb_groups(verbs: Sequence[str]) -> list[tuple[str, list[str]]]:
    """(title, verbs) in the order ``hpcckpt --help`` lists them: the user's verbs, then ``GROUPS``."""
    grouped = {v for names in GROUPS.values() for v in names}
    return [(USER_VERBS, [v for v in verbs if v not in grouped]),
            *((title, [v for v in names if v in verbs]) for title, names in GROUPS.items())]


def _list_by_group(parser: argparse.ArgumentParser, sub: argparse._SubParsersAction) -> None:
    """List the verbs in ``--help`` by group: each group is a section of its own, showing the
    verbs' one-line help; parsing is not changed (one namespace of verbs, as before)."""
    rows = {row.dest: row for row in sub._choices_actions}
    parser._positionals._group_actions.remove(sub)  # in the usage line still; its rows are shown below
    for title, verbs in verb_groups(list(sub.choices)):
        parser.add_argument_group(title)._group_actions.extend(rows[v] for v in verbs if v in rows)
    # the options (-h, -v) after the verbs
    parser._action_groups.append(parser._action_groups.pop(parser._action_groups.index(parser._optionals)))


# The page to read after each verb's --help (the docs site's source, in the repository).
DOCS = {
    "bench": "docs/performance.md", "check": "docs/guides/integrate.md", "cuda": "docs/guides/gpu.md",
    "demo": "docs/getting-started.md", "doctor": "docs/guides/troubleshooting.md", "epilog": "docs/guides/admins.md",
    "export": "docs/on-disk.md", "history": "docs/guides/slurm.md", "inspect": "docs/on-disk.md",
    "ls": "docs/on-disk.md", "prolog": "docs/guides/admins.md", "requeue": "docs/guides/slurm.md",
    "run": "docs/own-checkpoints.md", "scavenge": "docs/guides/admins.md", "template": "docs/guides/slurm.md",
    "verify": "docs/on-disk.md",
}


def _code(exc: BaseException) -> int:
    if isinstance(exc, ConfigError):
        return EXIT_USAGE
    if isinstance(exc, NoCheckpoint):
        return EXIT_NOTHING
    if isinstance(exc, (ClusterError, CriuError, CudaCheckpointError)):
        return EXIT_EXTERNAL
    return EXIT_PROBLEM


def _os_message(exc: OSError) -> str:
    """An OSError as a person reads it: what failed on which path, and what to check."""
    where = f" {exc.filename!r}" if exc.filename is not None else ""
    if exc.filename2 is not None:
        where += f" -> {exc.filename2!r}"
    hint = {NotADirectoryError: "a file was given (or is in the path) where a directory is expected",
            IsADirectoryError: "a directory was given where a file is expected",
            FileNotFoundError: "check the path",
            PermissionError: "check the owner and mode (ls -ld) of the path"}.get(type(exc), "")
    return f"{exc.strerror or exc}{where}" + (f" ({hint})" if hint else "")


def _report(args: argparse.Namespace, message: str, kind: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps({"error": message, "type": kind}))
    else:
        print(f"hpcckpt {args.verb}: error: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `hpcckpt inspect DIR | head`: the reader has what it wanted
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        except OSError:
            pass
        return 0
    except HpcckptError as exc:
        _report(args, str(exc), type(exc).__name__)
        return _code(exc)
    except OSError as exc:
        _report(args, _os_message(exc), type(exc).__name__)
        return EXIT_USAGE if isinstance(exc, (NotADirectoryError, IsADirectoryError)) else EXIT_PROBLEM
    except Exception as exc:  # never a bare traceback for a user; the bug stays findable with -vv
        log.debug("traceback of the internal error", exc_info=True)
        _report(args, f"internal error {type(exc).__name__}: {exc}; this is a bug in hpcckpt: rerun with -vv "
                      "to see the traceback and report it", type(exc).__name__)
        return EXIT_INTERNAL
