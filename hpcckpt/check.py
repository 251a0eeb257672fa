"""``hpcckpt check``: does a script resume exactly? Run it uninterrupted and with stops, compare.

While ``_HPCCKPT_CHECK_TRACE`` names a file, every Checkpointer boundary appends one JSON
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
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .cluster.env import without_slurm
from .config import internal_var
from .errors import ConfigError, HpcckptError
from .exitcodes import EXIT_REQUEUE

TRACE_ENV = internal_var("CHECK_TRACE")
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


FIELDS = "__fields__"  # in a trace record's digests: object -> field -> value ("=json") or digest
KINDS = "__kinds__"  # object -> model | module | optimizer | scaler | scheduler | other


def _short(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _leaf(value: Any, tensors: Mapping[str, Any]) -> str:
    """One field as compared: its value ("=json") where it is a number or a short string (a
    0-dim tensor included, so a report can show both values), else a digest."""
    if isinstance(value, dict) and ("__tensor__" in value or "__ndarray__" in value):
        t = tensors[value.get("__tensor__") or value["__ndarray__"]]
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.numel() == 1 and \
                type(t) in (torch.Tensor, torch.nn.Parameter) and not t.is_complex():
            return "=" + json.dumps(t.detach().cpu().reshape(()).item())
        h = hashlib.blake2b(digest_size=8)
        _digest_tensor(h, t) if isinstance(t, torch.Tensor) else h.update(repr(t).encode())
        return h.hexdigest()
    if isinstance(value, dict) and "__float__" in value:
        return "=" + json.dumps(value["__float__"])
    text = json.dumps(value, sort_keys=True, default=str)
    if len(text) <= 40 and "__tensor__" not in text and "__ndarray__" not in text:
        return "=" + text
    return _short(text.encode())


def _fields(node: Any, path: str, tensors: Mapping[str, Any], out: dict[str, str]) -> None:
    """The leaves of an object's flattened state, named by their path (``state.0.exp_avg``,
    ``param_groups.0.lr``, ``metric``): containers of tensors or dicts are walked, a list of
    plain values is one field."""
    def walk(items: Any) -> None:
        for k, v in items:
            _fields(v, f"{path}.{k}" if path else str(k), tensors, out)

    def deep(v: Any) -> bool:
        return isinstance(v, (dict, list))

    if isinstance(node, dict) and len(node) == 1 and "__dict__" in node:
        walk(node["__dict__"])
    elif isinstance(node, dict) and len(node) == 1 and "__tuple__" in node and any(map(deep, node["__tuple__"])):
        walk(enumerate(node["__tuple__"]))
    elif isinstance(node, dict) and not any(k in node for k in ("__tensor__", "__ndarray__", "__float__",
                                                                 "__tuple__", "__dtype__")):
        if not node and path:
            out[path] = _leaf(node, tensors)
        walk(node.items())
    elif isinstance(node, list) and any(map(deep, node)):
        walk(enumerate(node))
    else:
        out[path or "(value)"] = _leaf(node, tensors)


def _kinds(objects: Mapping[str, Any]) -> dict[str, str]:
    """What each registered object is to the check: a model (a module a registered optimizer
    trains), a module none trains (an EMA/SWA copy), an optimizer, a scaler, a scheduler, other."""
    trained = {id(p) for o in objects.values() if isinstance(o, torch.optim.Optimizer)
               for g in o.param_groups for p in g["params"]}
    kinds: dict[str, str] = {}
    for name, obj in objects.items():
        if isinstance(obj, torch.nn.Module):
            params = [id(p) for p in obj.parameters()]
            kinds[name] = "model" if not trained or any(p in trained for p in params) else "module"
        elif isinstance(obj, torch.optim.Optimizer):
            kinds[name] = "optimizer"
        elif "GradScaler" in type(obj).__name__:  # its scale decides which steps the optimizer takes
            kinds[name] = "scaler"
        elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or "scheduler" in type(obj).__name__.lower():
            kinds[name] = "scheduler"
        else:
            kinds[name] = "other"
    return kinds


def state_digests(objects: Mapping[str, Any], flat: Any) -> dict[str, Any]:
    """One digest per registered object (from a capture), plus rng, user_meta and unsaved buffers;
    under ``FIELDS`` each one's fields (state_dict keys, tensor names, user_meta keys) and under
    ``KINDS`` what each object is, so that a check can say what differs and whether it matters."""
    out: dict[str, Any] = {}
    fields: dict[str, dict[str, str]] = {}
    tree = flat.meta
    for name in tree["objects"]:
        per: dict[str, str] = {}
        _fields(tree["objects"][name], "", flat.tensors, per)
        if name in objects:
            fields[name] = per
        out[name] = _short(json.dumps(sorted(per.items())).encode())
    for part, meta in tree["rng"].items():  # python, numpy, torch, cuda: a script may seed only some
        prefix = f"rng/{part}"
        out[f"rng.{part}"] = digest({k: v for k, v in flat.tensors.items() if k == prefix or k.startswith(prefix + "/")},
                                    meta)
    user = tree.get("user", {})
    out["user_meta"] = digest({}, user)
    fields["user_meta"] = {str(k): _leaf(v, {}) for k, v in user.items()} if isinstance(user, dict) else {}
    for name, obj in objects.items():
        if isinstance(obj, torch.nn.Module):
            saved = set(obj.state_dict())
            loose = {k: b for k, b in obj.named_buffers() if k not in saved}
            if loose:
                out[name + NON_PERSISTENT] = digest(loose, sorted(loose))
                fields[name + NON_PERSISTENT] = {k: _leaf({"__tensor__": k}, loose) for k in loose}
    out[FIELDS] = fields
    out[KINDS] = _kinds(objects)
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

TRAINED = ("model", "module", "optimizer", "scaler")  # kinds whose difference is a divergence of training
COUNTER_HINT = ("{field} is a counter {offset} in the resumed run: a number derived from the batch index "
                "(`epoch * updates_per_epoch + batch_idx`, an EMA's warm-up count) counts from 0 again in a "
                "resumed epoch; number the batches from `batches.start` "
                "(`enumerate(batches, start=batches.start)`, or `ckpt.batches(loader).enumerate()`), or use ckpt.step")
COPY_HINT = ("{field} differs while the model and optimizer agree: an EMA/SWA copy whose update (its decay, its "
             "warm-up) is computed from a step number of the script's own; if that number comes from the batch "
             "index (`epoch * updates_per_epoch + batch_idx`), it counts from 0 again in a resumed epoch: number "
             "the batches from `batches.start` (`enumerate(batches, start=batches.start)`), or use ckpt.step")
AVERAGE_HINT = ("{field} is a float that differs while the model and optimizer agree: a running average (an "
                "epoch's mean loss from a meter that starts again in a resumed epoch) or another value kept for "
                "display; if nothing the training reads uses it, leave it (bookkeeping); if something does, "
                "register the meter or keep its sum and count in ckpt.user_meta")
META_HINT = ("{field} differs: the value the script stores in ckpt.user_meta is computed from state a resume "
             "does not bring back (a meter, a local counter); compute it from registered state or keep that "
             "state in user_meta too")
OTHER_HINT = ("{field} differs while the model and optimizer agree: state the script sets from its own "
              "variables; if nothing the training reads uses it, leave it, else keep what it is computed from "
              "in ckpt.user_meta")
GLOBAL_RNG_HINT = ("a draw from a global RNG once per process (a DataLoader with persistent_workers=True "
                   "iterated outside ckpt.batches takes its workers' seed at its first pass; a random init "
                   "after register()): the resumed process draws it at another point of the stream")


@dataclass
class FieldDiff:
    """One field (a state_dict key, a tensor name, a user_meta key) that differs between the runs."""
    object: str
    field: str
    kind: str  # model, module, optimizer, scaler, scheduler, other, rng, user_meta, buffers
    steps: list[int]
    at_end: bool
    values: list[Any] | None = None  # [uninterrupted, stopped] at its first differing step, if plain values

    @property
    def name(self) -> str:
        return f"{self.object}.{self.field}" if self.field else self.object

    @property
    def trained(self) -> bool:
        return self.kind in TRAINED or self.kind in ("buffers", "rng")


def _ranges(steps: Sequence[int]) -> str:
    spans: list[list[int]] = []
    for s in sorted(steps):
        if spans and spans[-1][1] == s - 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


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
    # "identical", "bookkeeping" (only state that training does not read differs: the registered
    # models, modules, optimizers, RNGs and losses agree at every step) or "diverged"
    verdict: str = "identical"
    fields: list[FieldDiff] = field(default_factory=list)
    objects: dict[str, str] = field(default_factory=dict)  # registered object -> its kind (see _kinds)

    @property
    def training_agrees(self) -> bool:
        return self.verdict != "diverged"

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["fields"] = [dict(f.__dict__, name=f.name) for f in self.fields]
        out["training_agrees"] = self.training_agrees
        return out

    def _field_lines(self) -> list[str]:
        out: list[str] = []
        by_object: dict[str, list[FieldDiff]] = {}
        for f in self.fields:
            by_object.setdefault(f.object, []).append(f)
        for obj, diffs in by_object.items():
            steps = sorted({s for f in diffs for s in f.steps})
            end = [f for f in diffs if f.at_end]
            out.append(f"  {obj} ({diffs[0].kind}): {len(diffs)} field(s) differ at step(s) {_ranges(steps)}; "
                       + (f"{len(end)} still differ at the end" if end else "all equal again at the end"))
            for f in diffs[:6]:
                if not f.field:
                    continue
                line = f"    - {f.field}: step(s) {_ranges(f.steps)}, " + \
                    ("still differs at the end" if f.at_end else "equal again at the end")
                if f.values is not None:
                    line += f"; at step {f.steps[0]}: {f.values[0]} (uninterrupted) vs {f.values[1]} (stopped)"
                out.append(line)
            if len(diffs) > 6:
                out.append(f"    - and {len(diffs) - 6} more (--json lists them all)")
        return out

    def lines(self) -> list[str]:
        stops = ", ".join(map(str, self.stops))
        if self.identical:
            return [f"hpcckpt check: identical: {self.steps} steps, stopped at step(s) {stops} and resumed "
                    f"({self.restarts} restarts); every registered object, the RNGs and user_meta match at "
                    "every step and at the end"]
        if self.verdict == "bookkeeping":
            out = [f"hpcckpt check: bookkeeping only: stopped at step(s) {stops}; the registered models, "
                   "optimizers, RNGs and the reported losses agree at every step and at the end; only state "
                   "the training does not read within this run differs:"]
        elif self.first_diverging_step is not None:
            out = [f"hpcckpt check: NOT identical: stopped at step(s) {stops}; the first diverging step is "
                   f"{self.first_diverging_step}, where these differ: {', '.join(self.differing)}"]
        else:
            out = [f"hpcckpt check: NOT identical: stopped at step(s) {stops}; what is registered matches, but "
                   "not all that training changes is registered"]
        if self.verdict == "diverged" and self.fields:
            agree = [k for k in ("model", "optimizer") if k in self.objects.values()
                     and not any(f.kind == k for f in self.fields)]
            if agree:
                out.append(f"  the registered {' and '.join(a + 's' for a in agree)} agree at every step")
        out += self._field_lines()
        if self.unsaved:
            out.append("  trained state that nothing registered saves (a resume starts it again from its initial "
                       "values):")
            out += [f"  - {u}" for u in self.unsaved]
        if self.loss_first_diverging_step is not None:
            out.append(f"  the reported losses first differ at step {self.loss_first_diverging_step}")
        if self.final_differs:
            out.append(f"  at the end ({self.steps}): {', '.join(self.final_differs)} differ")
        out.append("  usual causes (state a resume does not bring back), from what differs:")
        out += [f"  - {h}" for h in self.hints]
        return out


class RunTimeout(HpcckptError):
    """A run of the command did not end within ``--timeout``: it hangs (the message says where)."""


def _descendants(pid: int) -> list[int]:
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parent[int(stat.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        kids = sorted(c for c, pp in parent.items() if pp == p)
        out += kids
        todo += kids
    return out


def _where_it_hangs(pid: int, log: Path) -> str:
    """py-spy's dump of the process and its first children where py-spy is installed, and the
    last lines of the output in any case."""
    parts: list[str] = []
    spy = shutil.which("py-spy")
    if spy:
        for p in [pid, *_descendants(pid)][:4]:
            try:
                r = subprocess.run([spy, "dump", "--pid", str(p)], capture_output=True, text=True, timeout=30,
                                   check=False)
            except (OSError, subprocess.TimeoutExpired):
                continue
            if r.returncode == 0 and r.stdout.strip():
                parts.append(f"py-spy dump --pid {p}:\n{r.stdout.rstrip()}")
        if not parts:
            parts.append(f"(py-spy could not read process {pid}: it may need ptrace permission, "
                         "e.g. sudo, or kernel.yama.ptrace_scope=0)")
    else:
        parts.append("(install py-spy to see the stacks of the hung processes)")
    tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:]) if log.exists() else ""
    parts.append(f"its output ({log}) ends with:\n{tail.rstrip()}")
    return "\n".join(parts)


def _kill(pid: int) -> None:
    for p in [pid, *_descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def run_command(cmd: Sequence[str], env: Mapping[str, str], max_restarts: int, log: Path,
                timeout: float | None = None, name: str = "") -> tuple[int, int]:
    """Run ``cmd`` until it exits with anything but 75; (exit status, restarts). Output goes to ``log``.
    A start that runs past ``timeout`` seconds is killed (its children too) and raises RunTimeout."""
    restarts = 0
    while True:
        with open(log, "a", encoding="utf-8") as out:
            proc = subprocess.Popen(list(cmd), env=dict(env), stdout=out, stderr=subprocess.STDOUT)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                where = _where_it_hangs(proc.pid, log)
                _kill(proc.pid)
                proc.wait()
                traced = ""
                trace = Path(env.get(TRACE_ENV, ""))
                if env.get(TRACE_ENV) and trace.exists():
                    steps, _, _ = read_trace(trace)
                    traced = (f"; it had traced step {max(steps)} (the last boundary it reached)" if steps
                              else "; it had traced no step")
                raise RunTimeout(f"the {name or 'command'} run of {' '.join(cmd)!r} (start {restarts + 1}) did "
                                 f"not end within {timeout:g} s (--timeout){traced}: it hangs. Where:\n{where}") \
                    from None
            except BaseException:
                _kill(proc.pid)
                proc.wait()
                raise
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
            stops: Sequence[int], timeout: float | None = None) -> tuple[dict[int, Any], int, list[str]]:
    env = _environment(work, name, stops)
    log = work / name / "output.log"
    code, restarts = run_command(cmd, env, max_restarts=len(stops) + 2, log=log, timeout=timeout, name=name)
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


def _plain(digests: Mapping[str, Any] | None) -> dict[str, str] | None:
    """A record's object digests without the fields and kinds."""
    return None if digests is None else {k: v for k, v in digests.items() if k not in (FIELDS, KINDS)}


def _unseeded(a: Mapping[int, Any], b: Mapping[int, Any]) -> set[str]:
    """What already differs at the first step, before any stop: the runs themselves differ there
    (an RNG the script never seeds), so a resume cannot be judged by it."""
    first = min(set(a) & set(b), default=None)
    if first is None:
        return set()
    da, db = _plain(a[first].get("digests", {})) or {}, _plain(b[first].get("digests", {})) or {}
    return {k for k in set(da) | set(db) if da.get(k) != db.get(k)}


def _kind(obj: str, kinds: Mapping[str, str]) -> str:
    if obj.startswith("rng."):
        return "rng"
    if obj == "user_meta":
        return "user_meta"
    if obj.endswith(NON_PERSISTENT):
        return "buffers"
    return kinds.get(obj, "other")


def _value(leaf: str | None) -> Any:
    if leaf is None or not leaf.startswith("="):
        return None
    return json.loads(leaf[1:])


def field_diffs(a: Mapping[int, Any], b: Mapping[int, Any], skip: set[str]) -> list[FieldDiff]:
    """Every field that differs at some step both runs traced: its steps, whether it differs at
    the end, its two values where they are plain. An object a trace has no fields for (the RNGs)
    is one field of its own."""
    common = sorted(set(a) & set(b))
    found: dict[tuple[str, str], list[int]] = {}
    first: dict[tuple[str, str], tuple[str | None, str | None]] = {}
    kinds: dict[str, str] = {}
    for step in common:
        da, db = a[step].get("digests") or {}, b[step].get("digests") or {}
        kinds.update(da.get(KINDS, {}))
        fa, fb = da.get(FIELDS, {}), db.get(FIELDS, {})
        pa, pb = _plain(da) or {}, _plain(db) or {}
        for obj in sorted(set(pa) | set(pb)):
            if obj in skip or pa.get(obj) == pb.get(obj):
                continue
            if obj in fa or obj in fb:
                oa, ob = fa.get(obj, {}), fb.get(obj, {})
                keys = [k for k in sorted(set(oa) | set(ob)) if oa.get(k) != ob.get(k)] or [""]
                for k in keys:
                    found.setdefault((obj, k), []).append(step)
                    first.setdefault((obj, k), (oa.get(k), ob.get(k)))
            else:
                found.setdefault((obj, ""), []).append(step)
    end = common[-1] if common else None
    out = []
    for (obj, k), steps in found.items():
        va, vb = first.get((obj, k), (None, None))
        values = [_value(va), _value(vb)] if va is not None and vb is not None and va.startswith("=") \
            and vb.startswith("=") else None
        out.append(FieldDiff(obj, k, _kind(obj, kinds), steps, steps[-1] == end, values))
    out.sort(key=lambda f: (f.steps[0], not f.trained, f.object, f.field))
    return out


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
        d = _plain(run.get(step, {}).get("digests"))
        return None if d is None else {k: v for k, v in d.items() if k not in skip}

    missing = False
    for step in sorted(set(a) | set(b)):
        da, db = digests(a, step), digests(b, step)
        if da != db:
            out.identical = False
            out.first_diverging_step = step
            out.differing = sorted(k for k in set(da or {}) | set(db or {})
                                   if (da or {}).get(k) != (db or {}).get(k)) or ["(step missing in one run)"]
            missing = da is None or db is None
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
    out.fields = field_diffs(a, b, skip)
    out.objects = dict((a[total].get("digests") or {}).get(KINDS, {}))
    if not out.identical:
        trained = any(f.trained for f in out.fields)
        out.verdict = "diverged" if trained or missing or out.unsaved or out.loss_first_diverging_step is not None \
            or not out.fields else "bookkeeping"
        out.hints = _hints(out.differing, notes, out.fields)
    return out


def _hints(differing: Sequence[str], notes: Sequence[str] = (), fields: Sequence[FieldDiff] = ()) -> list[str]:
    """The likely causes, chosen from what the stopped run was seen doing and from what differs:
    the kind of each differing field (a counter, a float, a copy of the model) and its object."""
    hints: list[str] = []
    if "loader_seed" in notes:
        hints.append(LOADER_SEED_HINT)
    if "enumerate" in notes:
        hints.append(ENUMERATE_HINT)
    if any(d.endswith(NON_PERSISTENT) for d in differing) or any(f.kind == "buffers" for f in fields):
        hints.append(HINTS[4])
    if any(d.startswith("rng.") for d in differing):
        hints += [RNG_HINT, GLOBAL_RNG_HINT, HINTS[0]]
    trained_first = min((f.steps[0] for f in fields if f.kind in ("model", "optimizer")), default=None)
    for f in fields:
        values = f.values or [None, None]
        counter = all(isinstance(v, int) and not isinstance(v, bool) for v in values) or (
            f.kind in TRAINED and all(isinstance(v, float) and v.is_integer() for v in values)
            and f.field.endswith(("step", "num_batches_tracked", "num_updates", "n_averaged")))
        if counter and f.values is not None:
            offset = values[1] - values[0]
            hints.append(COUNTER_HINT.format(field=f.name, offset=f"{abs(offset):g} {'ahead' if offset > 0 else 'behind'}"))
        elif f.kind == "module" and (trained_first is None or trained_first > f.steps[0]):
            hints.append(COPY_HINT.format(field=f.object))  # one hint per copy, not per tensor
        elif f.kind not in TRAINED and f.kind not in ("rng", "buffers") and isinstance(values[0], float) \
                and isinstance(values[1], float):
            hints.append(AVERAGE_HINT.format(field=f.name))
        elif f.kind == "user_meta":
            hints.append(META_HINT.format(field=f.name))
        elif f.kind not in TRAINED and f.kind not in ("rng", "buffers"):
            hints.append(OTHER_HINT.format(field=f.name))
    if trained_first is not None and not any(f.steps[0] < trained_first for f in fields):
        # the model or optimizer went wrong first, nothing registered before it: a value outside them
        hints += [HINTS[0], HINTS[1], HINTS[2], HINTS[3], HINTS[5]]
    if not hints:
        hints = list(HINTS)
    return list(dict.fromkeys(hints))


def check(cmd: Sequence[str], work: Path, *, stop_at: Sequence[int] | None = None, stops: int = 2,
          seed: int = 0, timeout: float | None = None) -> CheckOutcome:
    """Run ``cmd`` uninterrupted and stopped, and compare. ``timeout``: the most seconds one start
    of it may run (a run past it raises RunTimeout, saying where it hangs); without it, the
    uninterrupted run is waited for and each start of the stopped run gets 3 times its time + 60 s."""
    if not cmd:
        raise ConfigError("hpcckpt check: no command given; e.g. hpcckpt check -- python train.py --epochs 2")
    began = time.monotonic()
    ref, _, _ = _traced(work, "uninterrupted", cmd, (), timeout)
    limit = timeout if timeout is not None else 3 * (time.monotonic() - began) + 60
    chosen = choose_stops(max(ref), stop_at, stops, seed)
    got, restarts, notes = _traced(work, "stopped", cmd, chosen, limit)
    return compare(ref, got, chosen, restarts, notes)
