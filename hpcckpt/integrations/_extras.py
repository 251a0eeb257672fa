"""Optional dependencies: import a trainer or say which extra installs it."""
from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import ConfigError


def require(module: str, extra: str, package: str) -> ModuleType:
    """Import ``module``; when it is missing, a ConfigError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module == exc.name or module.startswith(exc.name + ".")):
            raise  # the trainer is there but one of its own imports failed: show that
        raise ConfigError(
            f"hpcckpt's {extra} integration needs {package}, which is not installed in "
            f"this environment; install it with `pip install 'hpcckpt[{extra}]'` "
            f"(or `pip install {package}` into the environment that has your torch)") from None
