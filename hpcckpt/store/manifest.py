"""Every field of a manifest read from disk, checked before anything uses it.

A manifest whose self-checksum matches is still input: a buggy tool or an attacker
can recompute the checksum. ``validate`` runs once, in ``catalog.check``, before any
byte of a rank file is read or any memory is sized from the manifest; whatever fails
here makes the checkpoint corrupt, and loading falls back to the previous one.

What it guarantees to the readers (``hdf5.read_tensors``, ``torchfile.read``,
``TrainState.restore``):
- ``step`` equals the step directory's, ``world_size`` is a sane count and there is
  exactly one record per rank;
- every file path is a plain relative path inside the step directory, listed in
  ``files`` with its size (so the size check covers it), and is a regular file, not
  a symlink (checked by ``commit.verify_files``);
- every tensor has a known dtype, a shape of non-negative dims whose byte count is
  its ``nbytes``, and (HDF5) a byte range inside its file: no allocation is ever
  sized by a number the file cannot back;
- every tensor the metadata tree refers to is in the rank's tensor table, and the
  metadata's step is the manifest's.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

from ..errors import CheckpointCorrupt
from .entry import ITEMSIZE, dtype_itemsize
from .names import HDF5, RANK_FORMATS, TORCH
from .tensortable import TableError, TensorTable

FORMATS = RANK_FORMATS  # the rank files' formats (store.names)
# Manifest formats. v2: distributed tensors (``placement``); v3: v2 with each rank's tensor
# records as columns (``tensor_table``, ``store.tensortable``); v4: v3 with the columns of
# whole numbers packed (one base64 string each).
FORMAT_V1, FORMAT_V2, FORMAT_V3, FORMAT_V4 = "hpcckpt/1", "hpcckpt/2", "hpcckpt/3", "hpcckpt/4"
FORMAT = FORMAT_V4  # what this version writes
DISTRIBUTED_FORMATS = (FORMAT_V2, FORMAT_V3, FORMAT_V4)  # those that record the distributed layout
MAX_WORLD_SIZE = 1 << 20
MAX_DIMS = 64
_U32 = 0xFFFFFFFF
MAX_FILE_BYTES = (1 << 63) - 1  # off_t: no file size or offset beyond it is real
_SAFE_PART = re.compile(r"^[A-Za-z0-9._+=@,-]+$")
_REF_KEYS = ("__tensor__", "__ndarray__")


class Invalid(CheckpointCorrupt):
    """A manifest field that cannot be trusted."""


NEWER = "written by a newer hpcckpt"  # in the problem of a NewerFormat manifest (``resume``)


class NewerFormat(Invalid):
    """An intact manifest in a format newer than this version reads: written by a newer
    hpcckpt, not damaged. A resume refuses to pass over it to an older step."""


def format_number(fmt: Any) -> int | None:
    """N of a format name ``hpcckpt/N``, None for anything else."""
    m = re.fullmatch(r"hpcckpt/([1-9][0-9]{0,5})", fmt) if isinstance(fmt, str) else None
    return int(m.group(1)) if m else None


def refuse_newer(manifest: Mapping[str, Any]) -> None:
    """``NewerFormat`` for a manifest whose format is ``hpcckpt/N`` above ``FORMAT``. Asked
    before anything else of it is decoded (``commit.read_manifest``): a newer format may
    encode its records in a way this version cannot even decode."""
    newer = format_number(manifest.get("format"))
    if newer is not None and newer > (format_number(FORMAT) or 0):
        raise NewerFormat(f"manifest format {manifest.get('format')!r} was {NEWER} (this one reads up to "
                          f"{FORMAT}): upgrade hpcckpt in this job's environment to resume it")


def _int(value: Any, what: str, *, lo: int = 0, hi: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise Invalid(f"{what} is {value!r}, not a whole number")
    if value < lo or (hi is not None and value > hi):
        bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise Invalid(f"{what} is {value}, outside {bound}")
    return value


def _dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Invalid(f"{what} is {type(value).__name__}, not an object")
    return value


def safe_relpath(rel: Any, what: str) -> str:
    """``rel`` if it names a file inside the step directory (no '..', not absolute, plain names)."""
    if not isinstance(rel, str) or not rel:
        raise Invalid(f"{what} is {rel!r}, not a file name")
    parts = PurePosixPath(rel).parts
    if rel.startswith("/") or not parts or any(p in (".", "..") or not _SAFE_PART.match(p) for p in parts):
        raise Invalid(f"{what} {rel!r} is not a plain path inside the step directory")
    return rel


def _itemsize(name: Any, what: str) -> int:
    """Bytes per element of the plain torch dtype called ``name``; ``Invalid`` for any other name."""
    size = dtype_itemsize(name)
    if size is None:
        raise Invalid(f"{what} has dtype {name!r}, which is not a plain torch dtype")
    return size


def _tensor(name: str, e: Any, fmt: str, file_bytes: int, where: str) -> None:
    """One tensor record: checked inline first (a manifest may hold tens of thousands), and
    only a record that fails the quick checks is looked at again to say what is wrong."""
    if type(e) is dict:
        shape, nbytes, crc, dtype = e.get("shape"), e.get("nbytes"), e.get("crc32c", 0), e.get("dtype")
        itemsize = ITEMSIZE.get(dtype) if type(dtype) is str else None
        if (itemsize is not None and type(shape) is list and len(shape) <= MAX_DIMS and type(nbytes) is int
                and type(crc) is int and 0 <= crc <= _U32 and 0 <= nbytes <= file_bytes
                and all(type(d) is int and d >= 0 for d in shape) and math.prod(shape) * itemsize == nbytes):
            if fmt != HDF5 and "offset" not in e:  # the sync format's offsets are optional
                return
            offset = e.get("offset")
            if type(offset) is int and 0 <= offset <= MAX_FILE_BYTES and (not nbytes or offset + nbytes <= file_bytes):
                return
    _tensor_explained(name, e, fmt, file_bytes, where)


def _tensor_explained(name: str, e: Any, fmt: str, file_bytes: int, where: str) -> None:
    what = f"{where} tensor {name!r}"
    e = _dict(e, what)
    itemsize = _itemsize(e.get("dtype"), what)
    shape = e.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise Invalid(f"{what} has shape {shape!r}, not a list of at most {MAX_DIMS} dims")
    numel = 1
    for d in shape:
        numel *= _int(d, f"{what} dimension")
    nbytes = _int(e.get("nbytes"), f"{what} nbytes")
    if numel * itemsize != nbytes:
        raise Invalid(f"{what}: shape {shape} x {itemsize}-byte {e['dtype']} is {numel * itemsize} bytes, "
                      f"manifest says {nbytes}")
    if nbytes > file_bytes:
        raise Invalid(f"{what} claims {nbytes} bytes, more than its {file_bytes}-byte file holds")
    _int(e.get("crc32c", 0), f"{what} crc32c", hi=_U32)
    if fmt == HDF5 or "offset" in e:
        offset = _int(e.get("offset"), f"{what} offset", hi=MAX_FILE_BYTES)
        if nbytes and offset + nbytes > file_bytes:
            raise Invalid(f"{what} spans bytes {offset}..{offset + nbytes}, past the end of its "
                          f"{file_bytes}-byte file")


def tensor_refs(meta: Any, out: set[str]) -> set[str]:
    """Every tensor name the metadata tree refers to (``{"__tensor__": name}``), added to ``out``.

    Level by level, without recursion (a tree of 65,536 tensors is ~100,000 nodes); a tensor's
    own node, by far the most common, is taken in one look."""
    level = [meta]
    depth = 0
    while level:
        if depth > 200:
            raise Invalid("metadata tree is nested more than 200 levels deep")
        below: list[Any] = []
        push = below.append
        for node in level:
            if type(node) is list:
                for v in node:
                    if type(v) is dict or type(v) is list:
                        push(v)
                continue
            if type(node) is not dict:
                continue
            if len(node) == 1 and "__tensor__" in node:
                ref = node["__tensor__"]
                if type(ref) is not str:
                    raise Invalid(f"metadata refers to tensor {ref!r}, not a name")
                out.add(ref)
                continue
            for key in _REF_KEYS:
                if key in node:
                    if not isinstance(node[key], str):
                        raise Invalid(f"metadata refers to tensor {node[key]!r}, not a name")
                    out.add(node[key])
            if "__dtype__" in node:
                _itemsize(node["__dtype__"], "metadata value")
            if "__dict__" in node and not all(isinstance(kv, list) and len(kv) == 2 for kv in node["__dict__"]):
                raise Invalid("metadata '__dict__' entry is not a list of [key, value] pairs")
            for v in node.values():
                if type(v) is dict or type(v) is list:  # a scalar holds no reference: not queued
                    push(v)
        level = below
        depth += 1
    return out


def _meta(meta: Any, step: int, tensors: Mapping[str, Any], where: str,
          shared: Mapping[str, Any] | None = None) -> None:
    meta = _dict(meta, f"{where} meta")
    if meta.get("step") != step or isinstance(meta.get("step"), bool):
        raise Invalid(f"{where} meta says step {meta.get('step')!r}, the manifest says {step}")
    _dict(meta.get("objects"), f"{where} meta objects")
    missing = sorted(tensor_refs(meta, set()) - set(tensors) - set(shared or ()))
    if missing:
        raise Invalid(f"{where}: the metadata refers to tensors the rank file does not hold: "
                      f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")


def _rank(rank: int, rec: Any, step: int, files: Mapping[str, Any], shared: Mapping[str, Any], *,
          meta: bool = True) -> tuple[str, Any, str]:
    """One rank's record checked; returns (its file, its checked tensors, its format), for
    ``_bounded`` of that file with every other rank's record that lists it."""
    where = f"rank {rank}"
    rec = _dict(rec, f"{where} record")
    fname = safe_relpath(rec.get("file"), f"{where} file")
    if fname not in files:
        raise Invalid(f"{where} file {fname!r} is not listed in the manifest's files")
    fmt = rec.get("format")
    if fmt not in FORMATS:
        raise Invalid(f"{where} has format {fmt!r}; known formats: {', '.join(FORMATS)}")
    file_bytes = files[fname]["bytes"]
    tensors = rec.get("tensors")
    if isinstance(tensors, TensorTable):
        _table(tensors, fmt, file_bytes, where)
    else:
        tensors = _dict(tensors, f"{where} tensors")
        for name, e in tensors.items():
            _tensor(name, e, fmt, file_bytes, where)
    if meta:
        _meta(rec.get("meta"), step, tensors, where, shared)
    return fname, tensors, fmt


def _table(t: TensorTable, fmt: str, file_bytes: int, where: str) -> None:
    """A rank's tensor table: names, then every row in a few passes (``TensorTable.sound``);
    a table that fails them is checked row by row to name the first bad one (a dtype torch
    knows but ``ITEMSIZE`` does not passes there)."""
    if not set(map(type, t.names)) <= {str}:
        bad = next(n for n in t.names if type(n) is not str)
        raise Invalid(f"{where} tensor table names a tensor {bad!r}, not a string")
    if len(set(t.names)) != len(t.names):
        seen: set[str] = set()
        twice = next(n for n in t.names if n in seen or seen.add(n))  # type: ignore[func-returns-value]
        raise Invalid(f"{where} tensor table lists tensor {twice!r} twice")
    if t.sound(ITEMSIZE, file_bytes=file_bytes, offsets=fmt == HDF5 or t.has_offsets(), max_dims=MAX_DIMS):
        return
    if fmt == HDF5 and not t.has_offsets() and t.names:
        raise Invalid(f"{where} tensor table of an HDF5 file has no offsets")
    for i, name in enumerate(t.names):
        _tensor(name, t.record(i), fmt, file_bytes, where)


ARCHIVE_SLACK_BYTES = 1 << 20  # a rank file's bytes beyond its tensors': headers, pickle, alignment
TENSOR_SLACK_BYTES = 64 << 10  # ... and per tensor (zip/HDF5 records, 4 KiB alignment, its name)


def _bounded(fname: str, file_bytes: int, listed: list[tuple[int, Any, str]]) -> None:
    """A rank file that is read whole (whole-file crc32c) is at most its tensors' bytes plus
    bounded overhead: verify and a resume stay proportional to the bytes the manifest lists,
    whatever size a crafted manifest gives a (sparse) file.

    ``listed``: (rank, checked tensors, format) of every rank record that names the file. A
    file is bounded by all the tensors they list, each name once: a JIT checkpoint's one
    ``jit.pt`` holds every rank's tensors while each rank's record lists only its own (and
    the replicated ones in the writer's record alone)."""
    if len(listed) == 1:  # the usual case, a file per rank: its table as it is
        rank, tensors, fmt = listed[0]
        held = TensorTable.from_records(tensors).held_bytes(summed=fmt == TORCH)
        count = len(tensors)
    else:
        summed = any(fmt == TORCH for _r, _t, fmt in listed)
        sizes: dict[str, int] = {}  # name -> the most bytes any record gives it
        ends = 0  # where the last range that holds bytes ends (files with offsets)
        for _r, tensors, _fmt in listed:
            table = TensorTable.from_records(tensors)
            for name, nb in zip(table.names, table.nbytes):
                if nb > sizes.get(name, -1):
                    sizes[name] = nb
            if not summed:
                ends = max(ends, table.held_bytes(summed=False))
        held = sum(sizes.values()) if summed else ends
        count = len(sizes)
        rank = listed[0][0]
    limit = held + ARCHIVE_SLACK_BYTES + TENSOR_SLACK_BYTES * count
    if file_bytes > limit:
        whose = f"rank {rank}"
        if len(listed) > 1:
            whose = f"ranks {', '.join(str(r) for r, _t, _f in listed[:5])}{' ...' if len(listed) > 5 else ''}"
        raise Invalid(f"{whose} file {fname!r} is listed as {file_bytes} bytes, but its tensors account for "
                      f"{held}; at most {limit} is plausible")


def build_image(*, kind: str, seq: int, job_id: str | None, restart_count: int, **fields: Any) -> dict[str, Any]:
    """The manifest of one CRIU image (``criu/images``): the store's envelope (kind, sequence
    number, creation time, host, job) around what the dump recorded (``fields``: the
    command, signal, CRIU version, timings, namespaces, CUDA processes and GPUs...).
    Files and their checksums are added by ``Transaction.commit`` as for every checkpoint."""
    import socket
    import time
    return {"kind": kind, "seq": seq, "created": time.time(), "host": socket.gethostname(),
            "job_id": job_id, "restart_count": restart_count, **fields}


def build(*, step: int, engine: str, job: Mapping[str, Any], user: Mapping[str, Any],
          records: list[dict[str, Any]], shared: Mapping[str, Any] | None = None,
          files: Mapping[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """The manifest of one save from every rank's commit record (rank order); the coordinator's.

    The records' distributed-tensor fields become the ``shared`` table
    (``shared.merge_shared``, which refuses pieces that do not tile a tensor), and
    their ``file_info`` the ``files`` table, unless the caller gives them (the JIT writer:
    one file for every rank, its replicated tensors already laid out). ``extra``: further
    top-level fields (the JIT writer's ``jit``).
    """
    import time
    if shared is None:
        from .shared import merge_shared
        shared = merge_shared(records)
    if files is None:
        files = {rec["file"]: rec["file_info"] for rec in records if "file_info" in rec}
    return {
        "format": FORMAT,
        "step": step,
        "world_size": len(records),
        "engine": engine,
        "created": time.time(),
        "job": dict(job),
        "user": dict(user),
        "ranks": {str(r): rec for r, rec in enumerate(records)},
        "files": dict(files),
        "shared": dict(shared),
        **extra,
    }


def validate(manifest: Mapping[str, Any], *, step: int | None, meta: bool = True) -> None:
    """Raise ``CheckpointCorrupt`` naming the first field that cannot be trusted.

    ``step``: the step in the directory's name (None for a directory not named step-N).
    ``meta=False``: all but the ranks' metadata trees, which ``validate_meta`` checks
    then (everything that says which bytes to read is checked without them).
    """
    refuse_newer(manifest)
    m_step = _int(manifest.get("step"), "manifest step")
    if step is not None and m_step != step:
        raise Invalid(f"manifest says step {m_step} but sits in the directory of step {step}")
    world = _int(manifest.get("world_size"), "manifest world_size", lo=1, hi=MAX_WORLD_SIZE)
    files = _dict(manifest.get("files", {}), "manifest files")
    for rel, info in files.items():
        safe_relpath(rel, "manifest file")
        info = _dict(info, f"manifest entry of {rel!r}")
        _int(info.get("bytes"), f"size of {rel!r}", hi=MAX_FILE_BYTES)
        if "crc32c" in info:
            _int(info["crc32c"], f"crc32c of {rel!r}", hi=_U32)
    ranks = _dict(manifest.get("ranks"), "manifest ranks")
    want = {str(r) for r in range(world)}
    if set(ranks) != want:
        extra, missing = sorted(set(ranks) - want), sorted(want - set(ranks), key=int)
        detail = (f" (missing {missing[:5]})" if missing else "") + (f" (unexpected {extra[:5]})" if extra else "")
        raise Invalid(f"manifest for {world} ranks has records for {sorted(ranks, key=str)[:5]}{detail}")
    fmt = manifest.get("format", FORMAT_V1)
    if fmt not in (FORMAT_V1, *DISTRIBUTED_FORMATS):
        raise Invalid(f"manifest format {fmt!r} is not one this version reads "
                      f"({', '.join((FORMAT_V1, *DISTRIBUTED_FORMATS))}); "
                      "upgrade hpcckpt")
    shared = _dict(manifest.get("shared", {}), "manifest shared") if fmt in DISTRIBUTED_FORMATS else {}
    listed: dict[str, list[tuple[int, Any, str]]] = {}
    for r in range(world):
        fname, tensors, rfmt = _rank(r, ranks[str(r)], m_step, files, shared, meta=meta)
        listed.setdefault(fname, []).append((r, tensors, rfmt))
    for fname, recs in listed.items():
        # a file read whole (a torch archive, or a whole-file crc32c): no bigger than what it holds
        if any(rfmt == TORCH for _r, _t, rfmt in recs) or "crc32c" in files[fname]:
            _bounded(fname, files[fname]["bytes"], recs)
    for name, spec in shared.items():
        _shared(name, spec, ranks, world)


def validate_meta(manifest: Mapping[str, Any]) -> None:
    """The ranks' metadata trees of a manifest ``validate(meta=False)`` passed."""
    fmt = manifest.get("format", FORMAT_V1)
    shared = manifest.get("shared", {}) if fmt in DISTRIBUTED_FORMATS else {}
    for r in range(manifest["world_size"]):
        rec = manifest["ranks"][str(r)]
        _meta(rec.get("meta"), manifest["step"], rec["tensors"], f"rank {r}", shared)


def _shared(name: str, spec: Any, ranks: Mapping[str, Any], world: int) -> None:
    """A distributed tensor: known dtype and shape, pieces that tile its bytes, each held by its writer."""
    from .shared import KINDS, tiling_problem
    what = f"shared tensor {name!r}"
    spec = _dict(spec, what)
    itemsize = _itemsize(spec.get("dtype"), what)
    shape = spec.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise Invalid(f"{what} has shape {shape!r}, not a list of at most {MAX_DIMS} dims")
    for d in shape:
        _int(d, f"{what} dimension")
    if spec.get("kind") not in KINDS:
        raise Invalid(f"{what} has kind {spec.get('kind')!r}; known kinds: {', '.join(KINDS)}")
    pieces = spec.get("pieces")
    if not isinstance(pieces, list):
        raise Invalid(f"{what} has no list of pieces")
    writers: set[int] = set()
    for p in pieces:
        p = _dict(p, f"{what} piece")
        r = _int(p.get("rank"), f"{what} piece rank", hi=world - 1)
        if r in writers:  # one piece per tensor per rank file: a file's entry backs one piece only
            raise Invalid(f"{what}: rank {r} is named for two pieces; a rank file holds one piece of a tensor")
        writers.add(r)
        start = _int(p.get("start"), f"{what} piece start")
        nbytes = _int(p.get("nbytes"), f"{what} piece nbytes")
        held = ranks[str(r)]["tensors"].get(name)
        if not isinstance(held, dict) or held.get("nbytes") != nbytes or held.get("dtype") != spec["dtype"]:
            raise Invalid(f"{what}: the piece at byte {start} names rank {r}, whose file holds no "
                          f"{nbytes}-byte {spec['dtype']} piece of it")
        if start % itemsize:
            raise Invalid(f"{what}: piece at byte {start} does not start on an element")
    problem = tiling_problem(spec)
    if problem:
        raise Invalid(f"{what}: {problem}")


def record_out(rec: dict[str, Any]) -> dict[str, Any]:
    """A rank record as JSON carries it (on disk, and between ranks at a commit): its
    ``tensors`` (records or a ``TensorTable``) as the ``tensor_table`` columns. A copy."""
    if "tensors" not in rec:
        return rec
    out = {k: v for k, v in rec.items() if k != "tensors"}
    out["tensor_table"] = TensorTable.from_records(rec["tensors"]).columns()
    return out


def record_in(rec: dict[str, Any], where: str = "rank record") -> dict[str, Any]:
    """``record_out`` undone, in place: ``tensor_table`` becomes ``tensors``, a ``TensorTable``;
    ``Invalid`` when the table is not columns of one length."""
    if isinstance(rec, dict) and "tensor_table" in rec:
        if "tensors" in rec:
            raise Invalid(f"{where} has both 'tensors' and 'tensor_table'")
        try:
            rec["tensors"] = TensorTable.from_columns(rec.pop("tensor_table"))
        except TableError as exc:
            raise Invalid(f"{where} tensor table {exc}") from None
    return rec


def decode(manifest: dict[str, Any]) -> dict[str, Any]:
    """A parsed manifest as the code reads it (``record_in`` of every rank record). In place;
    what the columns hold is ``validate``'s to check."""
    ranks = manifest.get("ranks")
    if isinstance(ranks, dict):
        for r, rec in ranks.items():
            record_in(rec, f"rank {r}")
    return manifest


def encode(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """``manifest`` as it is written (``commit.seal_manifest``): in a distributed-format manifest
    every rank record through ``record_out`` and the format hpcckpt/4. A shallow copy:
    ``manifest`` itself is left as it is. A format-1 manifest is written as it was read."""
    out = dict(manifest)
    ranks = out.get("ranks")
    if out.get("format") not in DISTRIBUTED_FORMATS or not isinstance(ranks, dict):
        return out
    out["ranks"] = {r: record_out(rec) if isinstance(rec, dict) else rec for r, rec in ranks.items()}
    out["format"] = FORMAT
    return out


def as_records(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a read manifest whose rank records list their tensors one object per name
    (``hpcckpt inspect --json``: what a person, or jq, looks a tensor up in)."""
    out = dict(manifest)
    ranks = out.get("ranks")
    if isinstance(ranks, dict):
        out["ranks"] = {r: {**rec, "tensors": dict(rec["tensors"].items())}
                        if isinstance(rec, dict) and isinstance(rec.get("tensors"), TensorTable) else rec
                        for r, rec in ranks.items()}
    return out
