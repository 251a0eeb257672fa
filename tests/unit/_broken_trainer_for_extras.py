"""A stand-in for an installed trainer whose own import fails (see test_integrations_extras)."""
from __future__ import annotations

import hpcckpt_missing_dependency_of_a_trainer  # noqa: F401
