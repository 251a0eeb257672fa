"""``hpcckpt check``: does a script resume exactly? Run it uninterrupted and with stops, compare.

While ``HPCCKPT_CHECK_TRACE`` names a file, every Checkpointer boundary appends one JSON
line: the step and a digest of each registered object (its saved state), of the RNGs, of
``user_meta`` and of the non-persistent buffers of registered modules (which are never
saved), plus the losses the script passed to ``ckpt.report_loss``. The check runs the
command once uninterrupted and once stopped at chosen steps (``HPCCKPT_STOP_AT_STEPS``),
restarting it on exit 75 as the local supervisor does, and compares the traces step by
step: the first step whose digests differ, and which objects differ there, is the answer.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from .cluster.env import without_slurm
from .errors import ConfigError, HpcckptError
from .exitcodes import EXIT_REQUEUE

TRACE_ENV = "HPCCKPT_CHECK_TRACE"
NON_PERSISTENT = " (non-persistent buffers)"
ENUMERATE_HINT = ("a batch number from enumerate(ckpt.batches(loader)), which counts from 0 again in a resumed "
                  "epoch: code run every N batches (a sample from the model in train mode updates its BatchNorm "
                  "statistics) runs at other batches; number them with "
                  "`for i, batch in ckpt.batches(loader).enumerate():`, or, where enumerate() numbers what a "
                  "wrapper yields (a logger's log_every, tqdm), with "
                  "`enumerate(wrapper(batches), start=batches.start)`")
RNG_HINT = ("random numbers drawn between register() and the first step (data made there: negative labels, a "
            "random split, masks): register() puts the saved RNG back at once, so that code draws other numbers "
            "than it did in the uninterrupted run (ckpt.steps/batches/loop set the RNG again where training resumes, "
            "but what was drawn before stays); call register() after such code, right before the training loop")
LOADER_SEED_HINT = ("a DataLoader with persistent_workers=True iterated outside ckpt.batches (an evaluation loader) "
                    "draws its workers' seed from the global torch RNG at its first pass; hpcckpt gives it back after "
                    "a resume, except where the script makes such loaders anew and keeps one: make it once before the "
                    "training loop, or give it a generator of its own (DataLoader(..., generator=torch.Generator()))")
HINTS = (
    "a Python value that changes during training (a learning rate annealed by hand, the best "
    "validation loss, an early-stopping counter, an epoch counter of your own): keep it in ckpt.user_meta",
    "a batch fetched ahead of the step (nanoGPT's prefetched batch) or a recurrent hidden state carried "
    "across batches (an LSTM's): register an object whose state_dict holds it, or recompute it after a resume",
    "EMA / SWA copies of the model, a second optimizer, a GradScaler: register them too",
    "random augmentation in DataLoader worker processes: keep the default skip='auto' of "
    "ckpt.batches/loop (it replays the interrupted epoch's batches through the workers)",
    "a buffer registered with persistent=False that changes during training is never saved: make it "
    "persistent, or recompute it after a resume",
    "a DataLoader iterated outside ckpt.batches/loop for training: hpcckpt cannot know its position",
    ENUMERATE_HINT,
    RNG_HINT,
)


# --- the trace (written by the Checkpointer) ---------------------------------------------------

def _digest_tensor(h: Any, t: torch.Tensor) -> None:
    t = t.detach()
    if t.layout != torch.strided or type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        h.update(repr(t).encode())  # DTensor, sparse: as printed (a check is a debugging aid)
        return
    c = t.cpu().contiguous()
    h.update(f"{c.dtype}{tuple(c.shape)}".encode())
    if c.numel():
        h.update(c.reshape(-1).view(torch.uint8).numpy().tobytes())


def digest(tensors: Mapping[str, torch.Tensor], meta: Any) -> str:
    h = hashlib.blake2b(digest_size=12)
    h.update(json.dumps(meta, sort_keys=True, default=str).encode())
    for name in sorted(tensors):
        h.update(name.encode())
        _digest_tensor(h, tensors[name])
    return h.hexdigest()


def state_digests(objects: Mapping[str, Any], flat: Any) -> dict[str, str]:
    """One digest per registered object (from a capture), plus rng, user_meta and unsaved buffers."""
    out: dict[str, str] = {}
    tree = flat.meta
    for name in tree["objects"]:
        prefix = f"objects/{name}/"
        out[name] = digest({k: v for k, v in flat.tensors.items() if k.startswith(prefix)}, tree["objects"][name])
    for part, meta in tree["rng"].items():  # python, numpy, torch, cuda: a script may seed only some
        prefix = f"rng/{part}"
        out[f"rng.{part}"] = digest({k: v for k, v in flat.tensors.items() if k == prefix or k.startswith(prefix + "/")},
                                    meta)
    out["user_meta"] = digest({}, tree.get("user", {}))
    for name, obj in objects.items():
        if isinstance(obj, torch.nn.Module):
            saved = set(obj.state_dict())
            loose = {k: b for k, b in obj.named_buffers() if k not in saved}
            if loose:
                out[name + NON_PERSISTENT] = digest(loose, sorted(loose))
    return out


def append_trace(path: Path, record: Mapping[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def read_trace(path: Path) -> tuple[dict[int, dict[str, Any]], list[str], list[str]]:
    """Steps -> their last record, the checkpoint directories the runs used, and the notes the
    Checkpointer left on what it saw the script do (``enumerate``: a resumed epoch numbered by
    ``enumerate()``; ``unsaved: WHAT``: trained state that nothing registered saves)."""
    steps: dict[int, dict[str, Any]] = {}
    dirs: list[str] = []
    notes: list[str] = []
    if not path.exists():
        return steps, dirs, notes
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "dir" in rec:
            dirs.append(rec["dir"])
        elif "step" in rec:
            steps[int(rec["step"])] = rec
        elif rec.get("note") == "unsaved":  # one note per line: "unsaved: WHAT"
            notes += [f"unsaved: {what}" for what in rec.get("what", [])]
        elif "note" in rec:
            notes.append(str(rec["note"]))
    return steps, dirs, notes


# --- the check ------------------------------------------------------------------------------

@dataclass
class CheckOutcome:
    identical: bool
    steps: int
    stops: list[int]
    first_diverging_step: int | None = None
    differing: list[str] = field(default_factory=list)
    loss_first_diverging_step: int | None = None
    final_differs: list[str] = field(default_factory=list)
    restarts: int = 0
    hints: list[str] = field(default_factory=list)
    not_compared: list[str] = field(default_factory=list)  # RNGs the script does not seed
    unsaved: list[str] = field(default_factory=list)  # trained state nothing registered saves (not compared)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def lines(self) -> list[str]:
        stops = ", ".join(map(str, self.stops))
        if self.identical:
            return [f"hpcckpt check: identical: {self.steps} steps, stopped at step(s) {stops} and resumed "
                    f"({self.restarts} restarts); every registered object, the RNGs and user_meta match at "
                    "every step and at the end"]
        if self.first_diverging_step is not None:
            out = [f"hpcckpt check: NOT identical: stopped at step(s) {stops}; the first diverging step is "
                   f"{self.first_diverging_step}, where these differ: {', '.join(self.differing)}"]
        else:
            out = [f"hpcckpt check: NOT identical: stopped at step(s) {stops}; what is registered matches, but "
                   "not all that training changes is registered"]
        if self.unsaved:
            out.append("  trained state that nothing registered saves (a resume starts it again from its initial "
                       "values):")
            out += [f"  - {u}" for u in self.unsaved]
        if self.loss_first_diverging_step is not None:
            out.append(f"  the reported losses first differ at step {self.loss_first_diverging_step}")
        if self.final_differs:
            out.append(f"  at the end ({self.steps}): {', '.join(self.final_differs)} differ")
        out.append("  usual causes (state a resume does not bring back):")
        out += [f"  - {h}" for h in self.hints]
        return out


def run_command(cmd: Sequence[str], env: Mapping[str, str], max_restarts: int, log: Path) -> tuple[int, int]:
    """Run ``cmd`` until it exits with anything but 75; (exit status, restarts). Output goes to ``log``."""
    restarts = 0
    while True:
        with open(log, "a", encoding="utf-8") as out:
            code = subprocess.run(list(cmd), env=dict(env), stdout=out, stderr=subprocess.STDOUT,
                                  check=False).returncode
        if code != EXIT_REQUEUE or restarts >= max_restarts:
            return code, restarts
        restarts += 1


def _environment(work: Path, name: str, stops: Sequence[int]) -> dict[str, str]:
    env = without_slurm(os.environ)
    run = work / name
    run.mkdir(parents=True, exist_ok=True)
    env.update({"HPCCKPT_DIR": str(run / "ckpt"), TRACE_ENV: str(run / "trace.jsonl")})
    env.pop("HPCCKPT_STOP_AT_STEPS", None)
    if stops:
        env["HPCCKPT_STOP_AT_STEPS"] = ",".join(map(str, stops))
    return env


def _traced(work: Path, name: str, cmd: Sequence[str],
            stops: Sequence[int]) -> tuple[dict[int, Any], int, list[str]]:
    env = _environment(work, name, stops)
    log = work / name / "output.log"
    code, restarts = run_command(cmd, env, max_restarts=len(stops) + 2, log=log)
    if code != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise HpcckptError(f"the {name} run of {' '.join(cmd)!r} exited with status {code}; it must finish "
                           f"(status 0) to be compared. Its output ({log}) ends with:\n{tail}")
    steps, dirs, notes = read_trace(Path(env[TRACE_ENV]))
    if not steps:
        raise ConfigError(f"the {name} run traced no step: does {' '.join(cmd)!r} train through a hpcckpt "
                          "Checkpointer (steps/loop/epochs+batches/step_done)?")
    foreign = sorted({d for d in dirs if Path(d) != Path(env["HPCCKPT_DIR"])})
    if foreign:
        raise ConfigError(f"the command checkpoints to {foreign[0]}, not to the directory hpcckpt check gives it "
                          "in HPCCKPT_DIR; let HPCCKPT_DIR choose it (Checkpointer() without dir=) for the check")
    return steps, restarts, notes


def choose_stops(total: int, stop_at: Sequence[int] | None, count: int, seed: int) -> list[int]:
    if stop_at:
        bad = [s for s in stop_at if not 0 < s < total]
        if bad:
            raise ConfigError(f"--stop-at {bad}: the run has steps 1..{total}; stop inside it, e.g. "
                              f"--stop-at {max(1, total // 2)}")
        return sorted(set(stop_at))
    if total < 2:
        raise ConfigError(f"the run has {total} step(s): nothing to stop and resume")
    return sorted(random.Random(seed).sample(range(1, total), min(count, total - 1)))


def _unseeded(a: Mapping[int, Any], b: Mapping[int, Any]) -> set[str]:
    """What already differs at the first step, before any stop: the runs themselves differ there
    (an RNG the script never seeds), so a resume cannot be judged by it."""
    first = min(set(a) & set(b), default=None)
    if first is None:
        return set()
    da, db = a[first].get("digests", {}), b[first].get("digests", {})
    return {k for k in set(da) | set(db) if da.get(k) != db.get(k)}


def compare(a: Mapping[int, Any], b: Mapping[int, Any], stops: list[int], restarts: int,
            notes: Sequence[str] = ()) -> CheckOutcome:
    total = max(a)
    out = CheckOutcome(identical=True, steps=total, stops=stops, restarts=restarts)
    skip = _unseeded(a, b)
    out.not_compared = sorted(skip)
    if any(not k.startswith("rng.") for k in skip):
        raise HpcckptError(f"the two runs differ already at the first step, before any stop, in "
                           f"{', '.join(sorted(skip))}: the script is not deterministic (seed torch, numpy and "
                           "random, and use deterministic algorithms), so its resume cannot be checked bit for bit")

    def digests(run: Mapping[int, Any], step: int) -> dict[str, str] | None:
        d = run.get(step, {}).get("digests")
        return None if d is None else {k: v for k, v in d.items() if k not in skip}

    a_steps, b_steps = a, b
    for step in sorted(set(a) | set(b)):
        da, db = digests(a_steps, step), digests(b_steps, step)
        if da != db:
            out.identical = False
            out.first_diverging_step = step
            out.differing = sorted(k for k in set(da or {}) | set(db or {})
                                   if (da or {}).get(k) != (db or {}).get(k)) or ["(step missing in one run)"]
            break
    for step in sorted(set(a) & set(b)):
        if a[step].get("loss") != b[step].get("loss"):
            out.loss_first_diverging_step = step
            out.identical = False
            break
    last_a, last_b = digests(a, total) or {}, digests(b, max(b)) or {}
    out.final_differs = sorted(k for k in set(last_a) | set(last_b) if last_a.get(k) != last_b.get(k))
    out.unsaved = list(dict.fromkeys(n.split(": ", 1)[1] for n in notes if n.startswith("unsaved: ")))
    if out.unsaved:
        out.identical = False  # what is not saved cannot have come back, whatever the digests say
    if not out.identical:
        out.hints = _hints(out.differing, notes)
    return out


def _hints(differing: Sequence[str], notes: Sequence[str] = ()) -> list[str]:
    """The usual causes, the likeliest first: what the stopped run was seen doing, then what
    the differing names point at."""
    hints = list(HINTS)
    if any(d.endswith(NON_PERSISTENT) for d in differing):
        hints.insert(0, HINTS[4])
    rng = any(d.startswith("rng.") for d in differing)
    if differing == ["user_meta"] or rng:
        hints.insert(0, HINTS[0])
    if rng:
        hints.insert(0, RNG_HINT)
    if "enumerate" in notes:
        hints.insert(0, ENUMERATE_HINT)
    if "loader_seed" in notes:
        hints.insert(0, LOADER_SEED_HINT)
    return list(dict.fromkeys(hints))


def check(cmd: Sequence[str], work: Path, *, stop_at: Sequence[int] | None = None, stops: int = 2,
          seed: int = 0) -> CheckOutcome:
    if not cmd:
        raise ConfigError("hpcckpt check: no command given; e.g. hpcckpt check -- python train.py --epochs 2")
    ref, _, _ = _traced(work, "uninterrupted", cmd, ())
    chosen = choose_stops(max(ref), stop_at, stops, seed)
    got, restarts, notes = _traced(work, "stopped", cmd, chosen)
    return compare(ref, got, chosen, restarts, notes)
