"""Transparent mode: the whole job dumped and restored with CRIU (see README.md here)."""
from __future__ import annotations

from .locate import Criu, check, find_criu
from .supervisor import RunOptions, Supervisor

__all__ = ["Criu", "RunOptions", "Supervisor", "check", "find_criu"]
