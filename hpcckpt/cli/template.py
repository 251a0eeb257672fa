"""``hpcckpt template NAME``: print (or write) a job script template.

    hpcckpt template --list
    hpcckpt template single --set TIME=1:00:00 --set LEAD_S=300 --out train.sbatch
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hpcckpt.cli.common import add_json, emit
from hpcckpt.cluster import render
from hpcckpt.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("template", help="render an sbatch/submitit template (--list to see them)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", nargs="?", help="template name (see --list)")
    p.add_argument("--list", action="store_true", help="list the templates and their parameters")
    p.add_argument("--out", type=Path, default=None, help="write here instead of stdout")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="fill a parameter (repeatable), e.g. --set TIME=2:00:00")
    add_json(p)
    p.set_defaults(func=run)


def _overrides(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects KEY=VALUE, got {pair!r}")
        out[key.strip().upper()] = value
    return out


def _expedite_here() -> bool:
    """Whether the Slurm whose client tools are here has ``--requeue=expedite`` (25.11+)."""
    from hpcckpt.cluster.scontrol import major_minor, slurm_version

    version = major_minor(slurm_version())
    return version is not None and version >= render.EXPEDITE_SINCE


def _list(args: argparse.Namespace) -> int:
    rows = [{"name": t.name, "file": t.output_name, "description": t.description,
             "parameters": t.defaults} for t in render.TEMPLATES.values()]
    text = "\n".join(f"{r['name']:<9} {r['file']:<22} {r['description']}\n"
                     f"{'':<9} parameters: {', '.join(sorted(r['parameters']))}" for r in rows)
    emit(args, rows, text)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.list or not args.name:
        if not args.list:
            raise ConfigError("name a template (hpcckpt template --list shows them)")
        return _list(args)
    overrides = _overrides(args.set)
    if "REQUEUE" in render.get(args.name).defaults and "REQUEUE" not in overrides and _expedite_here():
        overrides["REQUEUE"] = "expedite"
        print("hpcckpt template: this Slurm has --requeue=expedite (>= 25.11): rendered with it "
              "(--set REQUEUE=plain for --requeue)", file=sys.stderr)
    text = render.render(args.name, overrides)
    if args.out is None:
        if args.json:
            emit(args, {"name": args.name, "text": text}, text)
        else:
            sys.stdout.write(text)
        return 0
    if not args.out.parent.is_dir():
        raise ConfigError(f"--out={args.out}: its directory {args.out.parent} does not exist; create it "
                          "first or write elsewhere, e.g. --out train.sbatch")
    if args.out.is_dir():
        raise ConfigError(f"--out={args.out} is a directory; name the file, e.g. --out {args.out}/train.sbatch")
    tmp = args.out.with_name(f".{args.out.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    mode = 0o755 if text.startswith("#!") else 0o644
    os.chmod(tmp, mode)
    os.replace(tmp, args.out)
    emit(args, {"name": args.name, "out": str(args.out)}, f"wrote {args.out}")
    return 0
