"""The interruption ledger lives in ``hpcckpt.lifecycle.ledger``; this name stays for importers."""
from __future__ import annotations

from .lifecycle.ledger import LEDGER, LOCK, LOCK_WAIT_S, Ledger, LedgerBusy

__all__ = ["LEDGER", "LOCK", "LOCK_WAIT_S", "Ledger", "LedgerBusy"]
