"""Reading processes from /proc: trees, namespaces' PIDs, signal masks, mapped files.

Shared by CRIU mode (``hpcckpt.criu``) and the CUDA checkpoint wrapper (``hpcckpt.cuda``),
which belongs to neither.
"""
from __future__ import annotations
