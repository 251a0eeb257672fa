"""One rank file's tensor records as columns: the manifest's ``tensor_table`` (hpcckpt/3, /4).

A manifest used to hold one JSON object per tensor (``{"dtype", "shape", "nbytes",
"crc32c", "offset"}`` under its name). With tens of thousands of tensors those objects were
most of what a resume, a ``verify`` or a commit spent outside the bytes: parsing, checking and
encoding 65,536 of them took longer than reading the 256 MB they describe. The table keeps
the same fields as columns, so that parsing makes a handful of lists, checking is one pass in
the native core (``sound``), and a reader takes offsets, sizes and checksums as arrays.

On disk, format hpcckpt/4: the names and dtypes as lists, every column of whole numbers packed
(base64 of little-endian unsigned integers: one string, not a number per tensor, to parse)::

    "tensor_table": {"name": [...], "dtype": [...], "ndim": "<u2>", "dims": "<u8>",
                     "nbytes": "<u8>", "crc32c": "<u4>", "offset": "<u8>"}
    # dims: every tensor's dims one after another, ndim of them each; offset: HDF5 rank files only

Format hpcckpt/3 held the whole numbers as lists (``"shape": [[...], ...], "nbytes": [...]``,
...); either form is read. In memory the table is also a read-only ``Mapping`` of name ->
record (the record built when asked), so code that looks one tensor up reads it as it read
the old objects.
"""
from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator, Mapping
from itertools import accumulate
from typing import Any

import numpy as np

from .._core import native
from .entry import TensorEntry

COLUMNS = ("name", "dtype", "shape", "nbytes", "crc32c")  # hpcckpt/3: every column a list
OFFSET = "offset"
# hpcckpt/4: names and dtypes lists, the rest packed as these little-endian types.
PACKED = {"ndim": "<u2", "dims": "<u8", "nbytes": "<u8", "crc32c": "<u4", OFFSET: "<u8"}
PACKED_COLUMNS = ("name", "dtype", *PACKED)


class TableError(ValueError):
    """The table's columns are not lists of one length (``from_columns``)."""


class TensorTable(Mapping[str, dict[str, Any]]):
    """Columns of one rank file's tensors; a ``Mapping`` of name -> record besides."""

    __slots__ = ("names", "dtypes", "_shapes", "_nbytes", "_crcs", "_offsets", "_packed", "_starts", "_index",
                 "_arrays", "_read_only")

    def __init__(self, names: list[str], dtypes: list[str], shapes: list[list[int]] | None, nbytes: list[int] | None,
                 crcs: list[int] | None, offsets: list[int] | None = None, *,
                 packed: dict[str, np.ndarray] | None = None) -> None:
        self.names, self.dtypes = names, dtypes
        self._shapes, self._nbytes, self._crcs, self._offsets = shapes, nbytes, crcs, offsets
        # hpcckpt/4's decoded columns (``_unpacked``): the lists above are made from them only
        # when asked (a resume's records), never for a check or a verify, which use the arrays.
        self._packed = packed
        self._starts: np.ndarray | None = None  # where each packed row's dims begin (``record``)
        self._index: dict[str, int] | None = None
        self._arrays: tuple[list[str], np.ndarray, np.ndarray, np.ndarray] | None = None
        self._read_only = False  # a manifest's table (``from_columns``): its arrays are kept

    # -- the columns as lists (those of a packed table made when first asked) ------------

    @property
    def shapes(self) -> list[list[int]]:
        if self._shapes is None:
            p = self._packed
            assert p is not None
            dims = p["dims"].tolist()
            ends = list(accumulate(p["ndim"].tolist()))
            self._shapes = list(map(dims.__getitem__, map(slice, [0, *ends[:-1]], ends)))
        return self._shapes

    @property
    def nbytes(self) -> list[int]:
        if self._nbytes is None:
            assert self._packed is not None
            self._nbytes = self._packed["nbytes"].tolist()
        return self._nbytes

    @property
    def crcs(self) -> list[int]:
        if self._crcs is None:
            assert self._packed is not None
            self._crcs = self._packed["crc32c"].tolist()
        return self._crcs

    @property
    def offsets(self) -> list[int] | None:
        if self._offsets is None and self._packed is not None and OFFSET in self._packed:
            self._offsets = self._packed[OFFSET].tolist()
        return self._offsets

    # -- building ------------------------------------------------------------------

    @classmethod
    def from_records(cls, records: Mapping[str, Mapping[str, Any]]) -> TensorTable:
        """From ``{name: {"dtype", "shape", "nbytes", "crc32c"[, "offset"]}}`` (what the engines'
        writers and manifests before hpcckpt/3 give); a missing crc32c is 0. ``offsets`` only
        when every record has one."""
        if isinstance(records, TensorTable):
            return records
        names = list(records)
        recs = list(records.values())
        offsets: list[int] | None = [r.get(OFFSET) for r in recs]  # type: ignore[misc]
        if offsets and any(o is None for o in offsets):
            offsets = None
        return cls(names, [r.get("dtype") for r in recs], [r.get("shape") for r in recs],  # type: ignore[misc]
                   [r.get("nbytes") for r in recs], [r.get("crc32c", 0) for r in recs],  # type: ignore[misc]
                   offsets if names else None)

    @classmethod
    def from_columns(cls, cols: Any) -> TensorTable:
        """From the manifest's ``tensor_table`` (either form); ``TableError`` unless it is an
        object of columns of one length, lists where lists belong and packed columns that
        decode (what they hold is ``manifest.validate``'s to check)."""
        if not isinstance(cols, dict):
            raise TableError(f"is {type(cols).__name__}, not an object")
        packed = "ndim" in cols or "dims" in cols
        unknown = sorted(set(cols) - set(PACKED_COLUMNS if packed else (*COLUMNS, OFFSET)))
        if unknown:
            raise TableError(f"has unknown columns {unknown[:5]}")
        table = cls._unpacked(cols) if packed else cls._listed(cols)
        table._read_only = True
        return table

    @classmethod
    def _listed(cls, cols: dict[str, Any]) -> TensorTable:
        """The hpcckpt/3 form: every column a list."""
        got = []
        for key in COLUMNS:
            col = cols.get(key)
            if type(col) is not list:
                raise TableError(f"column {key!r} is {type(col).__name__}, not a list")
            got.append(col)
        offsets = cols.get(OFFSET)
        if offsets is not None and type(offsets) is not list:
            raise TableError(f"column 'offset' is {type(offsets).__name__}, not a list")
        n = len(got[0])
        if any(len(c) != n for c in got) or (offsets is not None and len(offsets) != n):
            raise TableError("has columns of different lengths")
        return cls(got[0], got[1], got[2], got[3], got[4], offsets)

    @classmethod
    def _unpacked(cls, cols: dict[str, Any]) -> TensorTable:
        """The hpcckpt/4 form: names and dtypes lists, the whole numbers packed."""
        names, dtypes = cols.get("name"), cols.get("dtype")
        for key, col in (("name", names), ("dtype", dtypes)):
            if type(col) is not list:
                raise TableError(f"column {key!r} is {type(col).__name__}, not a list")
        n = len(names)  # type: ignore[arg-type]
        if len(dtypes) != n:  # type: ignore[arg-type]
            raise TableError("has columns of different lengths")
        ndim = _unpack(cols, "ndim", n)
        packed = {"ndim": ndim, "dims": _unpack(cols, "dims", int(ndim.sum())), "nbytes": _unpack(cols, "nbytes", n),
                  "crc32c": _unpack(cols, "crc32c", n)}
        if OFFSET in cols:
            packed[OFFSET] = _unpack(cols, OFFSET, n)
        return cls(names, dtypes, None, None, None, None, packed=packed)  # type: ignore[arg-type]

    def columns(self) -> dict[str, Any]:
        """The on-disk form (``tensor_table``, hpcckpt/4)."""
        out: dict[str, Any]
        if self._packed is not None:
            out = {"name": self.names, "dtype": self.dtypes}
            out.update((k, _pack(a, k)) for k, a in self._packed.items())
            return out
        out = {"name": self.names, "dtype": self.dtypes, "ndim": _pack(list(map(len, self.shapes)), "ndim"),
               "dims": _pack([d for s in self.shapes for d in s], "dims"), "nbytes": _pack(self.nbytes, "nbytes"),
               "crc32c": _pack(self.crcs, "crc32c")}
        if self.offsets is not None:
            out[OFFSET] = _pack(self.offsets, OFFSET)
        return out

    def listed(self) -> dict[str, list[Any]]:
        """The hpcckpt/3 form: every column a list (what a person reads, or a test crafts)."""
        out: dict[str, list[Any]] = {"name": self.names, "dtype": self.dtypes, "shape": self.shapes,
                                     "nbytes": self.nbytes, "crc32c": self.crcs}
        if self.offsets is not None:
            out[OFFSET] = self.offsets
        return out

    # -- the Mapping view ------------------------------------------------------------

    def index(self) -> dict[str, int]:
        """Name -> row (built once, when a single tensor is first looked up)."""
        if self._index is None:
            self._index = {n: i for i, n in enumerate(self.names)}
        return self._index

    def record(self, i: int) -> dict[str, Any]:
        p = self._packed
        if p is not None and self._shapes is None:  # one row of a packed table: no column made a list
            if self._starts is None:
                self._starts = np.concatenate(([0], np.cumsum(p["ndim"], dtype=np.int64)))
            start, end = int(self._starts[i]), int(self._starts[i + 1])
            rec = {"dtype": self.dtypes[i], "shape": p["dims"][start:end].tolist(),
                   "nbytes": int(p["nbytes"][i]), "crc32c": int(p["crc32c"][i])}
            if OFFSET in p:
                rec[OFFSET] = int(p[OFFSET][i])
            return rec
        rec = {"dtype": self.dtypes[i], "shape": self.shapes[i], "nbytes": self.nbytes[i], "crc32c": self.crcs[i]}
        if self.offsets is not None:
            rec[OFFSET] = self.offsets[i]
        return rec

    def __getitem__(self, name: str) -> dict[str, Any]:
        return self.record(self.index()[name])

    def __contains__(self, name: object) -> bool:
        return name in self.index()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TensorTable):
            return self.listed() == other.listed()
        return Mapping.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TensorTable({len(self.names)} tensors)"

    # -- arrays ----------------------------------------------------------------------

    def entries(self) -> dict[str, TensorEntry]:
        """Name -> ``TensorEntry`` of every row (offset 0 where the table has none)."""
        offsets = self.offsets or [0] * len(self.names)
        return {n: TensorEntry(n, d, tuple(s), o, b, c) for n, d, s, o, b, c in zip(
            self.names, self.dtypes, self.shapes, offsets, self.nbytes, self.crcs)}

    def arrays(self) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
        """``(names, offsets, nbytes, crc32c)`` of the tensors that hold bytes, as uint64/uint32
        arrays (offsets 0 where the table has none); the table must have been validated. A
        manifest's table (read-only) builds them once."""
        if self._arrays is None:
            got = self._build_arrays()
            if not self._read_only:
                return got
            self._arrays = got
        return self._arrays

    def _build_arrays(self) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
        p = self._packed
        if p is not None:
            offs = p[OFFSET].astype(np.uint64) if OFFSET in p else np.zeros(len(self.names), np.uint64)
            return _nonempty(self.names, offs, p["nbytes"].astype(np.uint64), p["crc32c"].astype(np.uint32))
        nb = np.array(self.nbytes, dtype=np.uint64)
        offs = np.array(self.offsets, dtype=np.uint64) if self.offsets is not None else np.zeros(len(nb), np.uint64)
        return _nonempty(self.names, offs, nb, np.array(self.crcs, dtype=np.uint32))

    def has_offsets(self) -> bool:
        """Whether the table records where each tensor's bytes are (HDF5, torch archives since
        offsets were recorded), without making the offsets a list."""
        return self._offsets is not None or (self._packed is not None and OFFSET in self._packed)

    def held_bytes(self, *, summed: bool) -> int:
        """The bytes the tensors account for: with ``summed`` their sizes added up (a torch
        archive), else where the last range that holds bytes ends (offsets 0 where there are
        none). Exact at any size (the table must have passed its row checks)."""
        p = self._packed
        if p is None:
            if summed:
                return sum(self.nbytes)
            # an empty tensor's offset is not read, so it bounds nothing (as in the packed form)
            return max((o + b if b else 0 for o, b in zip(self.offsets or [0] * len(self.nbytes), self.nbytes)),
                       default=0)
        nb = p["nbytes"]
        if summed:  # in two halves of 32 bits: 65,536 of each add up without overflow
            return (int((nb >> np.uint64(32)).sum()) << 32) + int((nb & np.uint64(0xFFFFFFFF)).sum())
        if OFFSET not in p:
            return int(nb.max(initial=0))
        return int(np.where(nb > 0, p[OFFSET] + nb, 0).max(initial=0))  # ends checked to fit: no overflow

    # -- checking --------------------------------------------------------------------

    def sound(self, itemsize: dict[str, int], *, file_bytes: int, offsets: bool, max_dims: int) -> bool:
        """Whether every row passes the quick checks: plain-int columns (no bool, no float), a
        dtype named in ``itemsize``, a shape of at most ``max_dims`` whole dims whose elements
        times the dtype's size are ``nbytes``, at most ``file_bytes``, a crc32c within 32 bits,
        and with ``offsets`` a whole offset where the bytes end inside the file. One pass in the
        native core (``table_check``), which also gives the columns ``arrays`` is made of. False
        says only that some row needs a closer look (a dtype torch knows but ``itemsize`` does
        not, an overflowing shape, or a damaged row): the caller checks row by row then."""
        if not self.names:
            return not offsets or not self.has_offsets()
        if offsets and not self.has_offsets():
            return False
        p = self._packed
        if p is not None:
            return bool(native().table_check_packed(self.dtypes, p["ndim"], p["dims"], p["nbytes"], p["crc32c"],
                                                    p.get(OFFSET) if offsets else None, itemsize, file_bytes,
                                                    max_dims))
        got = native().table_check(self.dtypes, self.shapes, self.nbytes, self.crcs,
                                   self.offsets if offsets else None, itemsize, file_bytes, max_dims)
        if got is None:
            return False
        if self._read_only and self._arrays is None and (offsets or self.offsets is None):
            offs, nb, crcs = (np.frombuffer(b, t) for b, t in zip(got, (np.uint64, np.uint64, np.uint32)))
            self._arrays = _nonempty(self.names, offs, nb, crcs)
        return True


def _nonempty(names: list[str], offs: np.ndarray, nb: np.ndarray,
              crcs: np.ndarray) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """The rows that hold bytes (``nbytes`` > 0)."""
    keep = np.flatnonzero(nb)
    if len(keep) == len(nb):
        return names, offs, nb, crcs
    return [names[i] for i in keep.tolist()], offs[keep], nb[keep], crcs[keep]


def _pack(values: list[int] | np.ndarray, key: str) -> str:
    """A column of whole numbers as hpcckpt/4 writes it."""
    return base64.b64encode(np.asarray(values, dtype=PACKED[key]).tobytes()).decode("ascii")


def _unpack(cols: dict[str, Any], key: str, n: int) -> np.ndarray:
    """Packed column ``key`` of ``n`` numbers; ``TableError`` for anything else."""
    raw = cols.get(key)
    if type(raw) is not str:
        raise TableError(f"column {key!r} is {type(raw).__name__}, not a packed column (a base64 string)")
    try:
        data = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise TableError(f"column {key!r} is not valid base64") from None
    dtype = np.dtype(PACKED[key])
    if len(data) != n * dtype.itemsize:
        raise TableError(f"has columns of different lengths (column {key!r}: {len(data)} bytes for "
                         f"{n} numbers of {dtype.itemsize})")
    return np.frombuffer(data, dtype)

