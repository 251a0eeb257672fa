"""``hpcckpt check`` says what differs, not only which object: the fields of each object (a
scheduler's running average, an EMA copy and its update counter), at which steps and whether
at the end; it tells bookkeeping (exit 3) from a divergence of the training (exit 1), picks its
hints from what differs, and reports a run that does not end within --timeout as hung (exit 4)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.native

# timm-shaped: its Scheduler keeps `metric`, set each step from the epoch's running loss average
# (a local meter that starts again in a resumed epoch), read by nothing, and set from the
# evaluation at each epoch's end
METRIC_SCRIPT = '''
import torch
from hpcckpt import Checkpointer

class Scheduler:
    def __init__(self):
        self.metric = None
        self.t_initial = 16
    def state_dict(self):
        return dict(self.__dict__)
    def load_state_dict(self, state):
        self.__dict__.update(state)

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = Scheduler()
ckpt = Checkpointer(every_steps=None)
ckpt.register(model=model, optimizer=opt, scheduler=scheduler)
total, count = 0.0, 0
xe, ye = torch.ones(8, 4), torch.zeros(8, 2)
for step in ckpt.steps(16):
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    loss = ((model(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    total, count = total + loss.item(), count + 1
    scheduler.metric = total / count
    if step % 8 == 7:
        with torch.no_grad():
            scheduler.metric = ((model(xe) - ye) ** 2).mean().item()
        total, count = 0.0, 0
    ckpt.report_loss(loss.item())
ckpt.close()
'''

# an EMA copy whose warm-up counts `epoch * updates_per_epoch + batch_idx` (timm's num_updates)
EMA_SCRIPT = '''
import torch
from hpcckpt import Checkpointer

class Ema(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.module = torch.nn.Linear(4, 2)
        self.module.load_state_dict(model.state_dict())
        self.register_buffer("num_updates", torch.zeros((), dtype=torch.long))
    @torch.no_grad()
    def update(self, model, n):
        self.num_updates.fill_(n)
        decay = min(0.9, (1 + n) / (10 + n))
        for e, p in zip(self.module.parameters(), model.parameters()):
            e.mul_(decay).add_(p, alpha=1 - decay)

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ema = Ema(model)
data = [(torch.randn(4), torch.randn(2)) for _ in range(32)]
loader = torch.utils.data.DataLoader(data, batch_size=4)
ckpt = Checkpointer(every_steps=None)
ckpt.register(model=model, optimizer=opt, ema=ema)
for epoch in ckpt.epochs(2):
    for batch_idx, (x, y) in enumerate(ckpt.batches(loader)):
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ema.update(model, epoch * len(loader) + batch_idx)
ckpt.close()
'''

HANG_SCRIPT = '''
import time
import torch
from hpcckpt import Checkpointer

model = torch.nn.Linear(2, 2)
ckpt = Checkpointer(every_steps=None)
ckpt.register(model=model)
for step in ckpt.steps(4):
    pass
ckpt.close()
print("about to wait for a thread that never ends", flush=True)
time.sleep(3600)
'''


def run_check(tmp_path: Path, script: str, *extra: str) -> tuple[int, dict, str]:
    path = tmp_path / "train.py"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCCKPT_", "SLURM_"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    base = [sys.executable, "-m", "hpcckpt.cli", "check", *extra, "--dir", str(tmp_path / "work"),
            "--", sys.executable, str(path)]
    proc = subprocess.run(base[:4] + ["--json"] + base[4:], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    assert proc.stdout.strip(), proc.stderr
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def test_a_running_average_in_the_scheduler_is_bookkeeping_named_by_field(tmp_path: Path) -> None:
    code, out, err = run_check(tmp_path, METRIC_SCRIPT, "--stop-at", "11")
    assert code == 3, (out, err)  # bookkeeping only
    assert out["verdict"] == "bookkeeping" and out["training_agrees"] and not out["identical"], out
    names = [f["name"] for f in out["fields"]]
    assert names == ["scheduler.metric"], out["fields"]
    metric = out["fields"][0]
    # the meter starts again at the resume (step 11): steps 12-15 differ; the evaluation at the
    # epoch's end (step 16) sets it equal again
    assert metric["steps"] == [12, 13, 14, 15] and metric["at_end"] is False, metric
    assert metric["values"][0] != metric["values"][1]
    assert out["loss_first_diverging_step"] is None
    assert any("scheduler.metric" in h and "running average" in h and "leave it" in h for h in out["hints"])
    assert not any("learning rate" in h for h in out["hints"]), out["hints"]
    # the text report, from the same traces
    from hpcckpt.check import compare, read_trace
    ref, _, _ = read_trace(tmp_path / "work" / "uninterrupted" / "trace.jsonl")
    got, _, notes = read_trace(tmp_path / "work" / "stopped" / "trace.jsonl")
    text = "\n".join(compare(ref, got, [11], 1, notes).lines())
    assert text.startswith("hpcckpt check: bookkeeping only:") and "optimizers" in text, text
    assert "  scheduler (scheduler): 1 field(s) differ at step(s) 12-15; all equal again at the end" in text, text
    assert "    - metric: step(s) 12-15, equal again at the end; at step 12:" in text, text


def test_an_ema_counted_from_the_batch_index_diverges_and_the_hint_says_batches_start(tmp_path: Path) -> None:
    code, out, err = run_check(tmp_path, EMA_SCRIPT, "--stop-at", "11")
    assert code == 1, (out, err)
    assert out["verdict"] == "diverged" and not out["training_agrees"], out
    objects = {f["object"] for f in out["fields"]}
    assert objects == {"ema"}, out["fields"]  # the model and the optimizer agree at every step
    counter = next(f for f in out["fields"] if f["field"] == "num_updates")
    # resumed at step 11 (epoch 1, batch 3): batch_idx counts from 0 again, 3 behind
    assert counter["kind"] == "module" and counter["values"] == [11, 8] and counter["at_end"], counter
    assert any("ema.num_updates" in h and "3 behind" in h and "batches.start" in h for h in out["hints"]), \
        out["hints"]


def test_a_run_that_does_not_end_is_reported_as_hung_with_where(tmp_path: Path) -> None:
    # 30 s: the run must reach its hang (torch's import, 4 steps and the final save) before the
    # timeout, however loaded the machine; 5 s was not enough beside the suite's other workers.
    code, out, err = run_check(tmp_path, HANG_SCRIPT, "--timeout", "30")
    assert code == 4, (out, err)
    assert out["hung"] is True and out["type"] == "RunTimeout", out
    assert "did not end within 30 s" in out["error"] and "traced step 4" in out["error"], out
    assert "about to wait for a thread that never ends" in out["error"], out


def test_what_counts_as_training_state_comes_from_what_each_object_is() -> None:
    """In process, on hand-made traces: a scheduler's field alone is bookkeeping; a GradScaler's
    scale, an EMA copy (a module no optimizer trains) or an RNG alone is a divergence."""
    import torch

    from hpcckpt.check import FIELDS, KINDS, _kinds, compare
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kinds = _kinds({"model": model, "opt": opt, "ema": torch.nn.Linear(2, 2), "scaler": torch.amp.GradScaler("cpu"),
                    "sched": torch.optim.lr_scheduler.StepLR(opt, 2)})
    assert kinds == {"model": "model", "opt": "optimizer", "ema": "module", "scaler": "scaler", "sched": "scheduler"}

    def trace(changed: str | None) -> dict[int, dict]:
        out = {}
        for step in (1, 2, 3):
            fields = {name: {"x": "=1"} for name in kinds}
            if changed and step == 3 and changed in fields:
                fields[changed] = {"x": "=2"}
            digests = {name: str(f) for name, f in fields.items()}
            digests["rng.torch"] = "r2" if changed == "rng.torch" and step == 3 else "r"
            out[step] = {"step": step, "digests": {**digests, FIELDS: fields, KINDS: kinds}, "loss": None}
        return out

    for changed, verdict in [("sched", "bookkeeping"), ("scaler", "diverged"), ("ema", "diverged"),
                             ("rng.torch", "diverged")]:
        got = compare(trace(None), trace(changed), [2], 1)
        assert got.verdict == verdict and [f.object for f in got.fields] == [changed], (changed, got)
        assert got.fields[0].at_end and got.fields[0].steps == [3]
