"""hpcckpt inside the trainers people already use.

- ``hpcckpt.integrations.lightning.HpcckptCallback``: PyTorch Lightning (``pip install hpcckpt[lightning]``)
- ``hpcckpt.integrations.hf.HpcckptTrainerCallback``: Hugging Face ``Trainer`` (``pip install hpcckpt[hf]``)

Each module imports its trainer only when it is imported itself, so the core install
stays light; a missing trainer is reported with the extra that installs it.
"""
from __future__ import annotations
