"""Finding a usable criu: an explicit path, the site's own, or the private install.

Search order (first match wins):
  1. ``HPCCKPT_CRIU`` (or an explicit argument): a path to a criu binary or wrapper;
  2. a ``criu`` on ``PATH`` whose major version is >= ``MIN_MAJOR`` (the site's own);
  3. ``<HPCCKPT_CRIU_PREFIX or /opt/hpcckpt/criu>/bin/criu`` from ``scripts/install-criu``.
A criu older than ``MIN_MAJOR`` is skipped: Debian bookworm's 3.17 cannot dump on
current kernels (vDSO layout) and fails in ways that look like application bugs.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import CriuError

MIN_MAJOR = 4
DEFAULT_PREFIX = Path("/opt/hpcckpt/criu")
_VERSION_RE = re.compile(r"^Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", re.MULTILINE)
_INSTALL_HINT = "run `scripts/install-criu` (as root) from the hpcckpt repository, or set HPCCKPT_CRIU to a criu >= 4"


@dataclass(frozen=True, kw_only=True)
class Criu:
    """A criu binary that runs, with its parsed version and where it was found."""

    path: Path
    version: str
    major: int
    source: str  # "explicit" | "env" | "site" | "private"


@dataclass(frozen=True, kw_only=True)
class CheckResult:
    ok: bool
    output: str


def parse_version(text: str) -> tuple[int, int, int] | None:
    """``criu --version`` output -> (major, minor, patch); None when unrecognised."""
    m = _VERSION_RE.search(text)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def private_prefix() -> Path:
    raw = os.environ.get("HPCCKPT_CRIU_PREFIX")
    return Path(raw) if raw else DEFAULT_PREFIX


def probe(path: Path, source: str, *, timeout_s: float = 30.0) -> Criu:
    """Run ``criu --version``; raise CriuError naming the path when it does not run."""
    try:
        proc = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CriuError(f"{path} does not run ({exc}); {_INSTALL_HINT}") from exc
    parsed = parse_version(proc.stdout)
    if proc.returncode != 0 or parsed is None:
        raise CriuError(f"{path} --version failed (exit {proc.returncode}): "
                        f"{(proc.stdout + proc.stderr).strip()[:300]!r}; {_INSTALL_HINT}")
    return Criu(path=path, version=".".join(map(str, parsed)), major=parsed[0], source=source)


def _candidates(explicit: str | os.PathLike[str] | None) -> list[tuple[Path, str]]:
    if explicit:
        return [(Path(explicit), "explicit")]
    env = os.environ.get("HPCCKPT_CRIU")
    if env:
        return [(Path(env), "env")]
    found: list[tuple[Path, str]] = []
    site = shutil.which("criu")
    private = private_prefix() / "bin" / "criu"
    if site and Path(site).resolve() != private.resolve():
        found.append((Path(site), "site"))
    found.append((private, "private"))
    return found


def find_criu(explicit: str | os.PathLike[str] | None = None) -> Criu:
    """The criu to use; raise CriuError listing what was tried and how to fix it."""
    tried: list[str] = []
    for path, source in _candidates(explicit):
        if not path.exists():
            tried.append(f"{path} ({source}): not found")
            continue
        try:
            criu = probe(path, source)
        except CriuError as exc:
            tried.append(f"{path} ({source}): {exc}")
            continue
        if criu.major < MIN_MAJOR:
            tried.append(f"{path} ({source}): criu {criu.version}, CRIU mode needs >= {MIN_MAJOR}")
            continue
        return criu
    raise CriuError("no usable criu: " + "; ".join(tried) + f"; {_INSTALL_HINT}")


def check(criu: Criu, *, timeout_s: float = 60.0) -> CheckResult:
    """``criu check``: can this kernel and this criu dump and restore at all?"""
    try:
        proc = subprocess.run([str(criu.path), "check"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return CheckResult(ok=False, output=str(exc))
    text = (proc.stdout + proc.stderr).strip()
    return CheckResult(ok=proc.returncode == 0 and "Looks good" in text, output=text)


def tracks_memory(criu: Criu, *, timeout_s: float = 60.0) -> bool:
    """Whether this kernel gives criu soft-dirty memory tracking (``--track-mem``), which
    dumps that write only the pages dirtied since a parent image need."""
    try:
        proc = subprocess.run([str(criu.path), "check", "--feature", "mem_dirty_track"], capture_output=True,
                              text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0
