"""One rank file's tensor records as columns: the manifest's ``tensor_table`` (format hpcckpt/3).

A manifest used to hold one JSON object per tensor (``{"dtype", "shape", "nbytes",
"crc32c", "offset"}`` under its name). With tens of thousands of tensors those objects were
most of what a resume, a ``verify`` or a commit spent outside the bytes: parsing, checking and
encoding 65,536 of them took longer than reading the 256 MB they describe. The table keeps
the same fields as parallel lists, so that parsing makes a handful of lists, checking is a
few passes in C (``check``), and a reader takes offsets, sizes and checksums as arrays.

On disk::

    "tensor_table": {"name": [...], "dtype": [...], "shape": [[...], ...], "nbytes": [...],
                     "crc32c": [...], "offset": [...]}      # offset: HDF5 rank files only

In memory the table is also a read-only ``Mapping`` of name -> record (the record built when
asked), so code that looks one tensor up reads it as it read the old objects.
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping

import numpy as np

from .._core import native
from .entry import TensorEntry

COLUMNS = ("name", "dtype", "shape", "nbytes", "crc32c")
OFFSET = "offset"


class TableError(ValueError):
    """The table's columns are not lists of one length (``from_columns``)."""


class TensorTable(Mapping[str, dict[str, Any]]):
    """Columns of one rank file's tensors; a ``Mapping`` of name -> record besides."""

    __slots__ = ("names", "dtypes", "shapes", "nbytes", "crcs", "offsets", "_index", "_arrays", "_read_only")

    def __init__(self, names: list[str], dtypes: list[str], shapes: list[list[int]], nbytes: list[int],
                 crcs: list[int], offsets: list[int] | None = None) -> None:
        self.names, self.dtypes, self.shapes, self.nbytes, self.crcs = names, dtypes, shapes, nbytes, crcs
        self.offsets = offsets
        self._index: dict[str, int] | None = None
        self._arrays: tuple[list[str], np.ndarray, np.ndarray, np.ndarray] | None = None
        self._read_only = False  # a manifest's table (``from_columns``): its arrays are kept

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
        """From the manifest's ``tensor_table``; ``TableError`` unless it is an object of lists of
        one length (what the lists hold is ``manifest.validate``'s to check)."""
        if not isinstance(cols, dict):
            raise TableError(f"is {type(cols).__name__}, not an object")
        unknown = sorted(set(cols) - set(COLUMNS) - {OFFSET})
        if unknown:
            raise TableError(f"has unknown columns {unknown[:5]}")
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
        table = cls(got[0], got[1], got[2], got[3], got[4], offsets)
        table._read_only = True
        return table

    def columns(self) -> dict[str, list[Any]]:
        """The on-disk form (``tensor_table``)."""
        out: dict[str, list[Any]] = {"name": self.names, "dtype": self.dtypes, "shape": self.shapes, "nbytes": self.nbytes,
               "crc32c": self.crcs}
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
            return self.columns() == other.columns()
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
        nb = np.array(self.nbytes, dtype=np.uint64)
        offs = np.array(self.offsets, dtype=np.uint64) if self.offsets is not None else np.zeros(len(nb), np.uint64)
        return _nonempty(self.names, offs, nb, np.array(self.crcs, dtype=np.uint32))

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
            return not offsets or not self.offsets
        if offsets and self.offsets is None:
            return False
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
