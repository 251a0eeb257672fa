"""``hpcckpt check`` on real scripts: one that forgets a Python-level learning rate (it names
the first wrong step and the object that differs), the same script keeping it in
``user_meta`` (identical), and a module with a mutating non-persistent buffer (named)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.native

SCRIPT = '''
import torch
from hpcckpt import Checkpointer

KEEP_LR = {keep_lr}
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
{buffer}
ckpt = Checkpointer(every_steps=None)
ckpt.register(model=model)
lr = ckpt.user_meta.get("lr", 0.5) if KEEP_LR else 0.5
for step in ckpt.steps(16):
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    loss = ((model(x) - y) ** 2).mean()
    model.zero_grad()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-lr)
    if (step + 1) % 5 == 0:
        lr *= 0.5  # annealed by hand, as word_language_model does
        if KEEP_LR:
            ckpt.user_meta["lr"] = lr
    ckpt.report_loss(loss.item())
ckpt.close()
'''
BUFFER = '''model.register_buffer("seen", torch.zeros(()), persistent=False)
def count(m, inputs, output):
    m.seen.add_(1)
model.register_forward_hook(count)'''


def check(tmp_path: Path, *, keep_lr: bool, buffer: str = "", stop_at: str = "12") -> tuple[int, dict]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(keep_lr=keep_lr, buffer=buffer))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCCKPT_", "SLURM_"))}
    env["PYTHONPATH"] = str(REPO)
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "check", "--json", "--stop-at", stop_at,
                           "--dir", str(tmp_path / "work"), "--", sys.executable, str(script)],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode in (0, 1), proc.stderr + proc.stdout
    return proc.returncode, json.loads(proc.stdout)


def test_a_forgotten_python_lr_is_named_at_the_first_wrong_step(tmp_path: Path) -> None:
    code, out = check(tmp_path, keep_lr=False)
    assert code == 1 and not out["identical"]
    # lr was halved at steps 5 and 10; resumed at 12 with the initial lr, step 13 is the first wrong one
    assert out["first_diverging_step"] == 13 and out["differing"] == ["model"], out
    assert out["loss_first_diverging_step"] == 14  # the loss of step 13 is computed before its update
    assert out["stops"] == [12] and out["restarts"] == 1 and "model" in out["final_differs"]
    assert any("learning rate" in h and "user_meta" in h for h in out["hints"])


def test_the_same_script_keeping_lr_in_user_meta_is_identical(tmp_path: Path) -> None:
    code, out = check(tmp_path, keep_lr=True, stop_at="5,12")
    assert code == 0 and out["identical"] and out["steps"] == 16 and out["restarts"] == 2, out


def test_a_mutating_non_persistent_buffer_is_named(tmp_path: Path) -> None:
    code, out = check(tmp_path, keep_lr=True, buffer=BUFFER)
    assert code == 1 and out["differing"] == ["model (non-persistent buffers)"], out
    assert "persistent" in out["hints"][0]


PLAIN_LIST_SCRIPT = '''
import torch
from torch import nn
from hpcckpt import Checkpointer

class Net(nn.Module):  # as mnist_forward_forward: layers in a plain list, each with its optimizer
    def __init__(self):
        super().__init__()
        self.layers = [nn.Linear(4, 4), nn.Linear(4, 2)]
        self.opts = [torch.optim.Adam(layer.parameters(), lr=0.01) for layer in self.layers]

torch.manual_seed(0)
net = Net()
ckpt = Checkpointer(every_steps=None)
ckpt.register(net=net, opt0=net.opts[0], opt1=net.opts[1])
for step in ckpt.steps(16):
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    loss = ((net.layers[1](net.layers[0](x)) - y) ** 2).mean()
    for opt in net.opts:
        opt.zero_grad()
    loss.backward()
    for opt in net.opts:
        opt.step()
ckpt.close()
'''


def test_layers_no_registered_object_saves_make_the_check_fail_and_are_named(tmp_path: Path) -> None:
    """The registered objects alone would look exact at the stop (the module's state_dict is
    empty, the optimizers come back): the check says the run is not exact, and names the layers."""
    script = tmp_path / "train.py"
    script.write_text(PLAIN_LIST_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCCKPT_", "SLURM_"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "hpcckpt.cli", "check", "--json", "--stop-at", "8",
                           "--dir", str(tmp_path / "work"), "--", sys.executable, str(script)],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 1, proc.stderr + proc.stdout
    out = json.loads(proc.stdout)
    assert not out["identical"] and len(out["unsaved"]) == 2, out
    assert out["unsaved"][0].startswith("net.layers[0] (Linear) is held in a plain Python container"), out
    assert out["unsaved"][1].startswith("net.layers[1] (Linear)"), out
