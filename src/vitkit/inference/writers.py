"""Row outputs of the batch jobs: JSONL, CSV or Parquet (by the file's suffix), written batch by batch and
resumable after a kill.

A job describes its rows by :class:`Field` s and hands :meth:`RowWriter.write` one batch at a time as columns
(name -> one value per row; a list field takes lists or a 2-D array; ``None`` for a missing value, e.g. a
failed image's labels). When ``write`` returns, the batch is complete on disk as far as a killed process goes
(written and flushed to the operating system; a power cut is another matter):

- ``.jsonl``: one JSON object per row, lists as arrays;
- ``.csv``: a header, then one line per row, a list field spread over ``name_1`` .. ``name_n`` columns;
- ``.parquet``: each batch a complete Parquet file in the folder ``NAME.parts/`` (written under a temporary
  name and renamed), merged into ``NAME`` by :meth:`RowWriter.close` (list fields as list columns), after
  which the folder is removed. A Parquet file is readable only once its footer is written, so a file cut
  mid-write holds nothing recoverable; complete part files always are.

``open_rows(..., resume=True)`` reopens an interrupted output: it drops a row cut mid-write (a JSONL/CSV line
without its newline or that does not parse; a part file never appears half-written), and reports the rows
already there (``done``, and their ids, so the job can check they are the ones its input starts with). A
finished Parquet file is reopened as the first part. Outputs are never replaced without ``overwrite``, and
only files of the shapes written here are ever removed.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vitkit.errors import ConfigError, DataError
from vitkit.fileio import WRITER, WRITER_KEY, clean_stale, fsync, remove_tree, temp_path

FORMATS = (".jsonl", ".csv", ".parquet")
KINDS = ("int", "float", "str", "bool", "int_list", "float_list", "str_list")
_PART = re.compile(r"^part-(\d{8})\.parquet$")
_PART_TMP = re.compile(r"^\.part-(\d{8})\.parquet\.tmp$")
PARQUET_ROW_GROUP_BYTES = 64 << 20  # the merged file's row groups: up to this much data each


@dataclass(frozen=True)
class Field:
    """One output column: ``kind`` one of int, float, str, bool, or a list of int/float/str of length
    ``width`` (CSV spreads it over ``name_1`` .. ``name_width``; JSONL and Parquet keep it a list)."""

    name: str
    kind: str
    width: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"field {self.name!r}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind.endswith("_list") != (self.width > 0):
            raise ValueError(f"field {self.name!r}: a list field needs a width > 0, a scalar none")

    @property
    def csv_names(self) -> list[str]:
        return [f"{self.name}_{i}" for i in range(1, self.width + 1)] if self.width else [self.name]


def output_format(path: str | os.PathLike[str]) -> str:
    """The format of an output file by its suffix: ``.jsonl``, ``.csv`` or ``.parquet`` (ConfigError otherwise)."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ConfigError(f"--out {path}: unknown format {suffix or '(no suffix)'!r}; use .jsonl, .csv or .parquet")
    return suffix


def _rows(fields: Sequence[Field], columns: Mapping[str, Any]) -> tuple[int, list[list[Any]]]:
    """(number of rows, per field the list of its Python values) of one batch of columns."""
    missing = [f.name for f in fields if f.name not in columns]
    if missing:
        raise ValueError(f"batch lacks column(s) {', '.join(missing)}")
    values = [c.tolist() if isinstance(c, np.ndarray) else list(c) for c in (columns[f.name] for f in fields)]
    sizes = {len(v) for v in values}
    if len(sizes) > 1:
        raise ValueError(f"columns of different lengths in one batch: {sorted(sizes)}")
    return (sizes.pop() if sizes else 0), values


class RowWriter:
    """An output being written (see the module docstring). ``done``: rows complete in it, ``ids``: their
    ``id_field`` values, in order (both as found when it was opened, then counting what was written)."""

    def __init__(self, path: Path, fields: Sequence[Field], id_field: str) -> None:
        self.path, self.fields, self.id_field = path, list(fields), id_field
        if id_field not in {f.name for f in fields}:
            raise ValueError(f"id field {id_field!r} is not among the fields")
        self.ids: list[str] = []

    @property
    def done(self) -> int:
        return len(self.ids)

    def write(self, columns: Mapping[str, Any]) -> None:
        """Append one batch of rows; complete on disk when this returns."""
        n, values = _rows(self.fields, columns)
        if n:
            self._write(n, values)
            self.ids += [str(v) for v in columns[self.id_field]]

    def _write(self, n: int, values: list[list[Any]]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Finish the output (Parquet: merge the parts into the file)."""


class _TextWriter(RowWriter):
    """JSONL and CSV: rows appended to the file, one ``write`` + ``flush`` per batch."""

    def __init__(self, path: Path, fields: Sequence[Field], id_field: str, resume: bool) -> None:
        super().__init__(path, fields, id_field)
        self.is_csv = path.suffix.lower() == ".csv"
        self.header = [n for f in self.fields for n in f.csv_names]
        if resume and path.exists():
            self._reopen()
            self.file = path.open("a", encoding="utf-8", newline="")
        else:
            self.file = path.open("w", encoding="utf-8", newline="")
            if self.is_csv:
                self._emit(self._csv_text([self.header]))

    def _emit(self, text: str) -> None:
        self.file.write(text)
        self.file.flush()

    def _csv_text(self, rows: list[list[Any]]) -> str:
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(rows)
        return buf.getvalue()

    def _write(self, n: int, values: list[list[Any]]) -> None:
        if self.is_csv:
            rows = []
            for r in range(n):
                row: list[Any] = []
                for f, col in zip(self.fields, values, strict=True):
                    v = col[r]
                    if f.width:
                        row += [""] * f.width if v is None else [_csv_value(x) for x in v]
                    else:
                        row.append(_csv_value(v))
                rows.append(row)
            self._emit(self._csv_text(rows))
        else:
            names = [f.name for f in self.fields]
            lines = (json.dumps(dict(zip(names, (col[r] for col in values), strict=True))) for r in range(n))
            self._emit("".join(line + "\n" for line in lines))

    def _reopen(self) -> None:
        """Read the complete rows of an interrupted output, and cut off a row written in part."""
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1  # rows end with a newline: anything after the last one was cut mid-write
        text = data[:end].decode("utf-8", errors="strict")
        if self.is_csv:
            ids, keep = self._csv_rows(text)
        else:
            ids, keep = self._jsonl_rows(text)
        self.ids = ids
        if keep < len(data):
            with self.path.open("r+b") as f:
                f.truncate(keep)

    def _jsonl_rows(self, text: str) -> tuple[list[str], int]:
        ids: list[str] = []
        pos = 0
        names = sorted(f.name for f in self.fields)
        for line in text.split("\n")[:-1]:  # json.dumps escapes every newline and non-ASCII character
            try:
                row = json.loads(line)
            except ValueError:
                break  # a line cut mid-write: dropped with whatever follows
            if not isinstance(row, dict) or sorted(row) != names:
                raise DataError(
                    f"{self.path}: row {len(ids) + 1} has other fields than this job writes ({', '.join(names)}); "
                    "continue it with the options it was started with, or write to a new --out"
                )
            ids.append(str(row[self.id_field]))
            pos += len(line) + 1
        return ids, pos

    def _csv_rows(self, text: str) -> tuple[list[str], int]:
        lines = text.splitlines(keepends=True)
        while lines:  # drop lines from the end until the rest parses (a quoted field cut at its newline)
            try:
                rows = list(csv.reader(io.StringIO("".join(lines), newline=""), strict=True))
                break
            except csv.Error:
                lines.pop()
        else:
            rows = []
        if not rows:  # not even the header: start the file again
            self.path.write_text(self._csv_text([self.header]), encoding="utf-8")
            return [], len(self._csv_text([self.header]).encode("utf-8"))
        if rows[0] != self.header:
            raise DataError(
                f"{self.path}: its columns ({', '.join(rows[0][:6])}, ...) are not those this job writes "
                f"({', '.join(self.header[:6])}, ...); continue it with the options it was started with, or write "
                "to a new --out"
            )
        body = rows[1:]  # a short row can only be the last, cut mid-write
        cut = next((i for i, r in enumerate(body) if len(r) != len(self.header)), len(body))
        rows = [rows[0], *body[:cut]]
        col = self.header.index(self.id_field)
        text_kept = self._csv_text(rows)
        return [r[col] for r in rows[1:]], len(text_kept.encode("utf-8"))

    def close(self) -> None:
        self.file.close()


def _csv_value(v: Any) -> Any:
    return "" if v is None else v


class _ParquetWriter(RowWriter):
    """Parquet: one complete part file per batch in ``NAME.parts/``, merged into ``NAME`` on close."""

    def __init__(
        self, path: Path, fields: Sequence[Field], id_field: str, resume: bool, meta: Mapping[str, str]
    ) -> None:
        super().__init__(path, fields, id_field)
        pa = _pyarrow()
        self.pa = pa
        self.schema = pa.schema(
            [pa.field(f.name, _arrow_type(pa, f.kind)) for f in self.fields],
            metadata={WRITER_KEY: WRITER, **meta},
        )
        self.parts = path.with_name(path.name + ".parts")
        self.next_part = 0
        if resume:
            self._reopen()
        self.parts.mkdir(exist_ok=True)

    def _reopen(self) -> None:
        import pyarrow.parquet as pq

        if self.path.exists() and not self.parts.exists():  # a finished file: reopened as the first part
            self._check_ours(self.path)
            self.parts.mkdir()
            os.replace(self.path, self.parts / "part-00000000.parquet")
        if not self.parts.is_dir():
            return
        for name in _our_entries(self.parts, temporary=True):
            (self.parts / name).unlink()  # a part cut mid-write (never renamed into place)
        for name in _our_entries(self.parts):
            part = self.parts / name
            self._check_ours(part)
            self.ids += [str(v) for v in pq.read_table(part, columns=[self.id_field]).column(0).to_pylist()]
            self.next_part = int(_PART.match(name).group(1)) + 1  # type: ignore[union-attr]

    def _check_ours(self, file: Path) -> None:
        import pyarrow.parquet as pq

        try:
            schema = pq.read_schema(file)
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError...
            raise DataError(f"{file}: not a readable Parquet file ({e})") from None
        if (schema.metadata or {}).get(WRITER_KEY.encode()) != WRITER.encode():
            raise DataError(f"{file}: not written by vitkit; vitkit never overwrites what it did not write")
        if schema.remove_metadata() != self.schema.remove_metadata():
            raise DataError(
                f"{file}: its columns ({', '.join(schema.names)}) are not those this job writes "
                f"({', '.join(self.schema.names)}); continue it with the options it was started with, or write to "
                "a new --out"
            )

    def _write(self, n: int, values: list[list[Any]]) -> None:
        import pyarrow.parquet as pq

        table = self.pa.table(
            {
                f.name: self.pa.array(v, type=self.schema.field(f.name).type)
                for f, v in zip(self.fields, values, strict=True)
            },
            schema=self.schema,
        )
        name = f"part-{self.next_part:08d}.parquet"
        tmp = self.parts / f".{name}.tmp"
        pq.write_table(table, tmp)
        os.replace(tmp, self.parts / name)
        self.next_part += 1

    def close(self) -> None:
        import pyarrow.parquet as pq

        parts = [self.parts / n for n in _our_entries(self.parts)]
        tmp = temp_path(self.path)
        try:
            with pq.ParquetWriter(tmp, self.schema) as out:
                pending: list[Any] = []
                size = 0
                for part in parts:
                    for batch in pq.ParquetFile(part).iter_batches():
                        pending.append(batch)
                        size += batch.nbytes
                        if size >= PARQUET_ROW_GROUP_BYTES:
                            out.write_table(self.pa.Table.from_batches(pending, self.schema))
                            pending, size = [], 0
                if pending or not parts:
                    out.write_table(self.pa.Table.from_batches(pending, self.schema))
            fsync(tmp)
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)
        remove_tree(self.parts)  # renamed aside first: a kill never leaves some of the parts beside the file


def _our_entries(folder: Path, temporary: bool = False) -> list[str]:
    """The part files (or, with ``temporary``, the temporary part files) in a parts folder, sorted."""
    pattern = _PART_TMP if temporary else _PART
    return sorted(e.name for e in folder.iterdir() if pattern.match(e.name) and e.is_file())


def _pyarrow() -> Any:
    try:
        import pyarrow
    except ImportError:
        raise ConfigError(
            "--out *.parquet needs pyarrow: pip install 'vitkit[parquet]' (or pip install pyarrow)"
        ) from None
    return pyarrow


def _arrow_type(pa: Any, kind: str) -> Any:
    scalar = {"int": pa.int64(), "float": pa.float32(), "str": pa.string(), "bool": pa.bool_()}
    return pa.list_(scalar[kind.removesuffix("_list")]) if kind.endswith("_list") else scalar[kind]


def check_rows_output(path: Path, *, resume: bool, overwrite: bool) -> None:
    """May ``path`` be written as a row output? New: yes. Existing (or a Parquet parts folder beside it): only
    with ``resume`` (continue it) or ``overwrite`` (start it again); a folder, or a parts folder holding files
    vitkit did not write, never."""
    output_format(path)
    if path.is_dir():
        raise ConfigError(f"--out {path}: is a folder; name a .jsonl, .csv or .parquet file")
    parts = path.with_name(path.name + ".parts")
    if parts.exists():
        foreign = [e.name for e in parts.iterdir() if not (_PART.match(e.name) or _PART_TMP.match(e.name))]
        if foreign or not parts.is_dir():
            raise ConfigError(
                f"--out {path}: {parts} holds {foreign[0] if foreign else 'a file'!r}, which vitkit did not write; "
                "vitkit never deletes what it did not write"
            )
    if (path.exists() or parts.exists()) and not (resume or overwrite):
        raise ConfigError(
            f"--out {path}: already exists (or a run into it was interrupted); pass --resume to continue it, or "
            "--overwrite to start again"
        )


def open_rows(
    path: str | os.PathLike[str],
    fields: Sequence[Field],
    *,
    id_field: str,
    resume: bool = False,
    overwrite: bool = False,
    meta: Mapping[str, str] | None = None,
) -> RowWriter:
    """A :class:`RowWriter` for ``path`` (format by suffix). ``resume``: continue an existing output (its
    complete rows kept: ``writer.done``, ``writer.ids``); ``overwrite``: start it again (a Parquet parts folder
    of an earlier run removed first); neither: the output must not exist. ``meta``: key/value strings stored in
    a Parquet file's schema metadata (besides vitkit's writer mark)."""
    out = Path(path)
    check_rows_output(out, resume=resume, overwrite=overwrite)
    clean_stale(out.parent, [out.name, out.name + ".parts"])  # a merge or a removal a kill cut short
    fmt = output_format(out)
    if not resume:  # overwrite: what an earlier run left goes first (only vitkit's own file shapes)
        parts = out.with_name(out.name + ".parts")
        if parts.is_dir():
            for name in _our_entries(parts) + _our_entries(parts, temporary=True):
                (parts / name).unlink()
            parts.rmdir()
        if fmt == ".parquet" and out.exists():
            out.unlink()
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == ".parquet":
        return _ParquetWriter(out, fields, id_field, resume, meta or {})
    return _TextWriter(out, fields, id_field, resume)
