"""Loader identity and position: which saved pass a loader handed to ``ckpt.batches``/``loop`` resumes.

``LoaderKeys.position`` names a loader the same in every run of the script (``key``) and
gives its ``data.LoaderPosition``. Beside it, what the loops need to know of how the script
iterates a pass: whether a loop left it (``left_by_loop``), and whether ``enumerate()``
numbers a resumed epoch's batches from 0 again (``warn_if_enumerated``).
"""
from __future__ import annotations

import dis
import gc
import inspect
import logging
import os
import sys
import types
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from ..data import LoaderPosition, Progress, find_resumable
from ..errors import ConfigError
from ..signals import quiet_workers
from ..state import TrainState

log = logging.getLogger("hpcckpt")

END: Any = object()


class LoaderKeys:
    """The names the loaders' passes are saved under (``key``), and their positions."""

    def __init__(self, progress: Progress, state: TrainState, watched: Any) -> None:
        self._progress, self._state, self._watched = progress, state, watched
        self._names: dict[int, str] = {}  # id of a loader object -> its key
        self._used: tuple[Any, set[str]] = (None, set())  # (epoch, keys whose pass began in it)
        self._legacy: bool | None = None  # a run begun before call-site keys: "loader<N>" by first use
        self._sites_warned: set[str] = set()

    def position(self, loader: Any, name: str | None, *, resumed: bool, progress_restored: bool,
                 **options: Any) -> LoaderPosition:
        """The saved pass of ``loader`` (``data.LoaderPosition``), by ``key``; ``resumed``: the run
        resumed, ``progress_restored``: its checkpoint held the loop's progress."""
        key = self.key(loader, name)
        fresh = key not in self._progress.positions
        pos = self._progress.position(key, loader, **options)
        sampler = find_resumable(loader)
        pos.saves_sampler = sampler is not None and not any(o is sampler for o in self._state.objects.values())
        if fresh and sampler is not None and resumed and not progress_restored:
            pos.load_state_dict({"passes": 1, "taken": 0})  # a checkpoint from before positions were saved
        return pos

    def key(self, loader: Any, name: str | None) -> str:
        """The name a loader's passes are saved under, the same in every run of the script.

        The same object is the same loader. Another object is named by ``name``, else by where
        the script hands it over (file and function of the first caller outside hpcckpt) and
        its order among the loaders that began a pass there in this epoch of ``epochs()``:
        a loader made anew each epoch (``ckpt.batches(range(...))``, a ``DataLoader`` or a
        ``tqdm`` built in the epoch's code) keeps its name from epoch to epoch and from run to
        run, two loaders trained in turn keep theirs. Before, a new object was the next
        ``loader<N>``: a resumed run gave its interrupted pass another loader's saved
        position (it trained none of that epoch's remaining batches, and skipped the next
        epoch's first ones), unless memory reuse happened to give the new object the old
        one's ``id``. Without ``epochs()`` a loader made anew each epoch needs ``name``.
        A run whose checkpoint names its loaders the old way keeps the old way."""
        if self._legacy is None:
            saved = [k for k in self._progress.restored_loader_names() if k.startswith("loader")]
            self._legacy = bool(saved) and all(k[6:].isdigit() for k in saved)
        known = self._names.get(id(loader))
        if known is not None:
            pos = self._progress.positions.get(known)
            if self._legacy or pos is not None and pos.loader is loader:
                self._use(known)
                return known
        quiet_workers(loader, self._watched)  # before its workers start
        if name:
            key = name
        elif self._legacy:
            key = f"loader{len(self._names)}"
        else:
            key = self._by_site()
        self._names[id(loader)] = key
        self._use(key)
        return key

    def _by_site(self) -> str:
        """A new loader object's key by where the script hands it over (``key``)."""
        site, used = caller_site(), self._use(None)
        key = next(k for k in (f"{site}#{j}" for j in range(len(used) + 1)) if k not in used)
        if self._progress.epoch is None and not key.endswith("#0") and site not in self._sites_warned:
            self._sites_warned.add(site)
            log.warning("hpcckpt: %s hands ckpt.batches another loader object than before, and no ckpt.epochs() "
                        "loop tells its epochs apart: its passes are saved as another loader's (%s). Loaders "
                        "trained in turn need nothing; a loader made anew each epoch needs `for epoch in "
                        "ckpt.epochs(...)` or a name (ckpt.batches(loader, name=\"train\")), else a resumed run "
                        "resumes another pass than the one stopped", site, key)
        return key

    def _use(self, key: str | None) -> set[str]:
        """The loader keys whose pass began in the current epoch (``key`` added)."""
        epoch = self._progress.epoch
        if self._used[0] != epoch:
            self._used = (epoch, set())
        if key is not None:
            self._used[1].add(key)
        return self._used[1]


def caller_site() -> str:
    """``file.py:function`` of the innermost caller outside hpcckpt (where a loader is handed over)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and str(frame.f_globals.get("__name__", "")).partition(".")[0] == "hpcckpt":
        frame = frame.f_back
    if frame is None:
        return "?"
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{getattr(code, 'co_qualname', code.co_name)}"


def next_pass(pos: LoaderPosition) -> tuple[Iterator[Any], Any]:
    """The next pass's iterator and first batch; a resumed pass that had ended gives way to a new one."""
    for _ in range(2):
        resumed = pos.pending
        it = pos.open()
        batch = next(it, END)
        if batch is not END:
            return it, batch
        if not resumed:
            break
    raise ConfigError(f"the DataLoader given to Checkpointer.loop yields no batch (pass {pos.passes}); "
                      "check its dataset, batch_size and drop_last")


# What the frame that drops a generator is doing when a loop over it ended without an exception:
# popping the loop's iterator (a break or a return inside the loop: POP_TOP, or POP_ITER from 3.14),
# or finding that an iterator wrapping it stopped (itertools.islice: FOR_ITER, END_FOR).
_LOOP_LEFT_OPS = frozenset(dis.opmap[n] for n in ("POP_TOP", "POP_ITER", "END_FOR", "FOR_ITER") if n in dis.opmap)
_SUSPENDED_OPS = frozenset(dis.opmap[n] for n in ("YIELD_VALUE", "SEND") if n in dis.opmap)


def left_by_loop(frame: FrameType) -> bool:
    """Whether the generator running in ``frame`` (in its ``except GeneratorExit``) is closed
    because a loop over it ended without an exception: a ``break`` or ``return`` inside the loop,
    or a wrapper that stopped (``islice``), possibly through generators of the script that are
    closed with it. False for an exception that unwinds the loop (its iterator is dropped then
    too), an explicit ``close()``, or a collection at another point: told by the instruction the
    frame that dropped it was at."""
    f = frame.f_back
    for _ in range(64):
        if f is None:
            return False
        code, at = f.f_code.co_code, f.f_lasti
        if not 0 <= at < len(code):
            return False
        if code[at] in _SUSPENDED_OPS and f.f_code.co_flags & (inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR):
            f = f.f_back  # a wrapper generator of the script, closed with it
            continue
        return code[at] in _LOOP_LEFT_OPS
    return False


def _next_index(e: enumerate) -> int | None:
    """The number an ``enumerate`` gives its next item (its ``start`` before its first)."""
    try:
        return int(e.__reduce__()[1][1])
    except (TypeError, IndexError, ValueError):
        return None


def _enumerated(it: Any, taken: int) -> str | None:
    """Whether an ``enumerate()`` numbers the batches of the pass ``it``: wrapping it, or a
    generator that runs on top of it in this call (torchvision references' ``MetricLogger.log_every``,
    ``tqdm``). The wrappers are running, so their hold on the pass is on their value stacks,
    which the collector does not see: they are told by their code objects on the call stack.
    One that counts from ``taken`` (``enumerate(..., start=batches.start)``) numbers them right."""
    if any(type(r) is enumerate and _next_index(r) != taken for r in gc.get_referrers(it)):
        return "direct"
    running: set[types.CodeType] = set()
    frame = sys._getframe(2)  # the pass itself (Batches._pass, via warn_if_enumerated); what runs it is above
    for _ in range(16):  # the generators between the pass and the loop that numbers the batches
        frame = frame.f_back  # type: ignore[assignment]  # None ends the walk below
        if frame is None:
            break
        if frame.f_code.co_flags & (inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR):
            running.add(frame.f_code)
    if not running:
        return None
    for obj in gc.get_objects():
        if type(obj) is not enumerate or _next_index(obj) == taken:
            continue
        inner = gc.get_referents(obj)
        if any(type(g) is types.GeneratorType and g.gi_running and g.gi_code in running for g in inner):
            return "wrapped"
    return None


def warn_if_enumerated(it: Any, taken: int, loader: Any, note: Callable[[dict[str, Any]], None]) -> None:
    """A resumed epoch iterated through ``enumerate()``: its count starts at 0 again, ``taken``
    batches short of the uninterrupted run's, so code that depends on it (sampling from the
    model in train mode every N batches: BatchNorm statistics) diverges silently. Found once
    a resumed pass, at its first batch, among the objects that refer to the pass (~17 ms for
    170,000 objects) and, when generators of the script run it, among every enumerate
    (``_enumerated``: one ``gc.get_objects()`` more). ``note``: for ``hpcckpt check``'s trace."""
    how = _enumerated(it, taken) if it is not None else None
    if how is None:
        return
    try:
        of = f" of {len(loader)}"
    except TypeError:
        of = ""
    log.warning("hpcckpt: this epoch resumes at its batch %d%s, but the loop numbers its batches with "
                "enumerate(), which counts from 0 again: code that depends on that number (logging or "
                "sampling every N batches, an i == 0 branch) runs at other batches than in the uninterrupted "
                "run, and where that code changes the model (a forward pass in train mode updates BatchNorm "
                "statistics) the run diverges. %s", taken, of,
                "Number them with `for i, batch in ckpt.batches(loader).enumerate():` (the uninterrupted run's "
                "numbers)" if how == "direct" else
                "It numbers what a generator of the script yields from ckpt.batches(loader) (a logger's "
                "log_every, tqdm): start its count where the epoch resumes, `batches = ckpt.batches(loader)` "
                "then `enumerate(wrapper(batches), start=batches.start)`")
    note({"note": "enumerate", "taken": taken})
