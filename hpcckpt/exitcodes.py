"""Process exit statuses hpcckpt gives and relies on, defined once.

``EXIT_REQUEUE`` is the contract between a job and what restarts it: the local
supervisor (``hpcckpt.supervisor``), the CRIU supervisor, the sbatch templates
(``srun ... || [ $? -eq 75 ] && hpcckpt requeue``) and ``hpcckpt requeue`` outside Slurm.
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_PROBLEM = 1  # the verb ran and found a problem (verify: corruption)
EXIT_USAGE = 2  # bad usage or configuration (argparse, ConfigError, a file where a directory goes)
EXIT_NOTHING = 3  # nothing to act on (no checkpoint, no job)
EXIT_EXTERNAL = 4  # an external tool or the scheduler failed (criu, scontrol, CUDA driver)
EXIT_INTERNAL = 70  # EX_SOFTWARE: a bug in hpcckpt (the message says how to get the traceback)
EXIT_REQUEUE = 75  # EX_TEMPFAIL: "restart me" after the final checkpoint is durable
EXIT_INTERRUPTED = 130  # Ctrl-C
