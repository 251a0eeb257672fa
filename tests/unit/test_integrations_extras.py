"""Trainer integrations are optional: a missing trainer is a clear error naming the extra."""
from __future__ import annotations

import subprocess
import sys

import pytest

from hpcckpt.errors import ConfigError
from hpcckpt.integrations._extras import require


def test_missing_trainer_names_the_extra_that_installs_it() -> None:
    with pytest.raises(ConfigError, match=r"pip install 'hpcckpt\[lightning\]'") as info:
        require("hpcckpt_no_such_trainer.sub", "lightning", "lightning")
    assert "lightning" in str(info.value) and info.value.__cause__ is None


def test_a_broken_import_inside_an_installed_trainer_is_not_hidden() -> None:
    # The module exists; what fails is something it imports: show that error, not "install".
    with pytest.raises(ModuleNotFoundError):
        require("tests.unit._broken_trainer_for_extras", "lightning", "lightning")


def test_core_import_does_not_pull_a_trainer() -> None:
    code = ("import sys, hpcckpt, hpcckpt.integrations, hpcckpt.api\n"
            "print(sorted(m for m in ('lightning', 'pytorch_lightning', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(("module", "hidden", "extra"), [
    ("hpcckpt.integrations.lightning", ("lightning", "pytorch_lightning"), "lightning"),
    ("hpcckpt.integrations.hf", ("transformers",), "hf"),
])
def test_integration_without_its_trainer_says_how_to_install(module: str, hidden: tuple[str, ...],
                                                             extra: str) -> None:
    # A meta-path finder that hides the trainer: the real import error path.
    code = (
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {hidden!r}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "try:\n"
        f"    import {module}\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("ConfigError") and f"pip install 'hpcckpt[{extra}]'" in out, out
