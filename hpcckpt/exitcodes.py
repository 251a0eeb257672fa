"""Process exit statuses hpcckpt gives and relies on, defined once.

``EXIT_REQUEUE`` is the contract between a job and what restarts it: the local
restart loop (``hpcckpt.lifecycle.restart``), the CRIU supervisor, the sbatch templates
(``srun ... || [ $? -eq 75 ] && hpcckpt requeue``) and ``hpcckpt requeue`` outside Slurm.
"""
from __future__ import annotations

import logging
import os
import sys

EXIT_OK = 0
EXIT_PROBLEM = 1  # the verb ran and found a problem (verify: corruption)
EXIT_USAGE = 2  # bad usage or configuration (argparse, ConfigError, a file where a directory goes)
EXIT_NOTHING = 3  # nothing to act on (no checkpoint, no job)
EXIT_EXTERNAL = 4  # an external tool or the scheduler failed (criu, scontrol, CUDA driver)
EXIT_INTERNAL = 70  # EX_SOFTWARE: a bug in hpcckpt (the message says how to get the traceback)
EXIT_REQUEUE = 75  # EX_TEMPFAIL: "restart me" after the final checkpoint is durable
EXIT_INTERRUPTED = 130  # Ctrl-C


def flush_and_exit(code: int) -> None:
    """End the process with ``code`` at once (its other threads left, atexit callbacks and the
    interpreter's teardown skipped), the logging handlers and standard streams flushed first:
    for a status that must be the process's even where a ``SystemExit`` would not be (raised
    in a thread, while Python joins threads or runs atexit callbacks) or where teardown would hang."""
    for h in logging.getLogger().handlers + logging.getLogger("hpcckpt.jit").handlers + \
            logging.getLogger("hpcckpt").handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - closed, broken or None: nothing more to say there
            pass
    os._exit(code)
