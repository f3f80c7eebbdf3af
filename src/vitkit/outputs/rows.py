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
  mid-write holds nothing recoverable; complete part files always are. A finished file that is resumed is
  copied into the folder as its first part (the file itself stays until the merge replaces it).

``open_rows(..., resume=True)`` reopens an interrupted output: it drops a row cut mid-write (a JSONL/CSV line
without its newline; a part file never appears half-written), and reports the rows already there (``done``,
and their ids, so the job can check they are the ones its input starts with). A finished Parquet file is
reopened as the first part. The store's rules hold (:mod:`vitkit.outputs.store`: no links, one lock, one
pre-check, only vitkit's own outputs resumed or overwritten): a JSONL/CSV file is vitkit's by the mark
``NAME.vitkit.json`` beside it (its columns and the job's ``meta``), a Parquet file by its schema metadata. Any
damage besides a last row cut mid-write is refused, naming the file and line; resume streams the file, one row
in memory at a time (at most :data:`MAX_ROW_BYTES`).
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from vitkit.errors import ConfigError, DataError
from vitkit.fileio import WRITER, WRITER_KEY, clean_stale, refuse_link
from vitkit.outputs.store import (
    Locked,
    Parts,
    check_same,
    create_new,
    open_regular,
    output_suffix,
    parquet_marked,
    precheck,
    pyarrow,
    read_sidecar,
    sidecar_path,
    write_parquet,
    write_sidecar,
)
from vitkit.textids import text_id

FORMATS = (".jsonl", ".csv", ".parquet")
KINDS = ("int", "float", "str", "bool", "int_list", "float_list", "str_list")
MAX_ROW_BYTES = 64 << 20  # one JSONL/CSV row read back on resume (K = 21843 logits take ~0.5 MB)
_FORMULA = ("=", "+", "-", "@", "\t", "\r", "'")  # a CSV text cell starting so is prefixed with '


class ColumnsError(DataError):
    """An output to resume whose columns are not those the job writes (a job whose columns depend on an option
    may try the other choice: ``vitkit predict``'s ``error`` column with ``--skip-bad``)."""


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
    """The format of a row output by its suffix (:func:`~vitkit.outputs.store.output_suffix` of :data:`FORMATS`)."""
    return output_suffix(path, FORMATS)


def _rows(fields: Sequence[Field], columns: Mapping[str, Any]) -> tuple[int, list[list[Any]]]:
    """(number of rows, per field the list of its Python values) of one batch of columns."""
    missing = [f.name for f in fields if f.name not in columns]
    if missing:
        raise ValueError(f"batch lacks column(s) {', '.join(missing)}")
    values = [c.tolist() if isinstance(c, np.ndarray) else list(c) for c in (columns[f.name] for f in fields)]
    values = [_texts(f, v) for f, v in zip(fields, values, strict=True)]
    sizes = {len(v) for v in values}
    if len(sizes) > 1:
        raise ValueError(f"columns of different lengths in one batch: {sorted(sizes)}")
    return (sizes.pop() if sizes else 0), values


def _texts(field: Field, values: list[Any]) -> list[Any]:
    """A str column's values in the one text form of ids (:func:`~vitkit.textids.text_id`: non-UTF-8 bytes of a
    file name as ``\\xNN``); other columns as they are."""
    if field.kind == "str":
        return [v if v is None else text_id(str(v)) for v in values]
    if field.kind == "str_list":
        return [v if v is None else [text_id(str(x)) for x in v] for v in values]
    return values


def _csv_cell(v: Any) -> Any:
    """A cell's value as written: ``""`` for a missing one; a text cell as spreadsheets cannot run it: one
    starting like a formula (``= + - @``, tab, CR) or with a quote gets a leading ``'`` (undone by
    :func:`_csv_uncell`)."""
    if v is None:
        return ""
    return "'" + v if isinstance(v, str) and v[:1] in _FORMULA else v


def csv_text(rows: Iterable[Sequence[Any]], lineterminator: str = "\n") -> str:
    """``rows`` as CSV text, as Python's csv module writes them (lines ending in ``lineterminator``)."""
    buf = io.StringIO()
    csv.writer(buf, lineterminator=lineterminator).writerows(rows)
    return buf.getvalue()


def _csv_uncell(v: str) -> str:
    return v[1:] if v[:1] == "'" else v


class RowWriter(Locked):
    """An output being written (see the module docstring). ``done``: rows complete in it, ``ids``: their
    ``id_field`` values, in order (both as found when it was opened, then counting what was written)."""

    def __init__(self, path: Path, fields: Sequence[Field], id_field: str, meta: Mapping[str, str]) -> None:
        self.path, self.fields, self.id_field, self.meta = path, list(fields), id_field, dict(meta)
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
            self.ids += [text_id(str(v)) for v in columns[self.id_field]]

    def _write(self, n: int, values: list[list[Any]]) -> None:
        raise NotImplementedError


class _TextWriter(RowWriter):
    """JSONL and CSV: rows appended to the file, one ``write`` + ``flush`` per batch. The file is created here
    (never through a link), and marked as vitkit's by ``NAME.vitkit.json`` beside it: its columns and the job's
    ``meta``. Only a file so marked, with this job's columns and meta, is resumed."""

    def __init__(
        self, path: Path, fields: Sequence[Field], id_field: str, resume: bool, meta: Mapping[str, str]
    ) -> None:
        super().__init__(path, fields, id_field, meta)
        self.is_csv = path.suffix.lower() == ".csv"
        self.header = [n for f in self.fields for n in f.csv_names]
        self.columns = self.header if self.is_csv else [f.name for f in self.fields]
        if resume and os.path.lexists(path):
            self._check_mark()
            self.file = open_regular(path)
            try:
                self._reopen(self.file)
            except BaseException:
                self.file.close()
                raise
        else:
            write_sidecar(path, {"columns": self.columns, "meta": self.meta})
            self.file = create_new(path)
            if self.is_csv:
                self._emit(csv_text([self.header]))

    def _check_mark(self) -> None:
        """The file must carry vitkit's mark with this job's columns and meta (DataError naming it otherwise)."""
        mark = read_sidecar(self.path)
        if mark is None:
            raise DataError(
                f"{self.path}: not an output vitkit wrote (no mark {sidecar_path(self.path).name} beside it); vitkit "
                "resumes only its own outputs and never changes other files: write to a new --out"
            )
        if mark.get("columns") != self.columns:
            raise ColumnsError(
                f"{self.path}: its columns are not those this job writes ({', '.join(self.columns[:6])}, "
                "...); continue it with the options it was started with, or write to a new --out"
            )
        found = mark.get("meta")
        check_same(found if isinstance(found, dict) else {}, self.meta, str(self.path))

    def _emit(self, text: str) -> None:
        self.file.write(text.encode("utf-8"))
        self.file.flush()

    def _write(self, n: int, values: list[list[Any]]) -> None:
        if self.is_csv:
            rows = []
            for r in range(n):
                row: list[Any] = []
                for f, col in zip(self.fields, values, strict=True):
                    v = col[r]
                    if f.width:
                        row += [""] * f.width if v is None else [_csv_cell(x) for x in v]
                    else:
                        row.append(_csv_cell(v))
                rows.append(row)
            self._emit(csv_text(rows))
        else:
            names = [f.name for f in self.fields]
            lines = (json.dumps(dict(zip(names, (col[r] for col in values), strict=True))) for r in range(n))
            self._emit("".join(line + "\n" for line in lines))

    def _reopen(self, f: BinaryIO) -> None:
        """Read the ids of the complete rows, streaming (one row in memory at a time), and cut off a last row
        written in part (no newline at its end). Any other damage is DataError naming the file and line."""
        records = _csv_records(f, self.path) if self.is_csv else _lines(f, self.path)
        keep = 0
        for number, (record, complete) in enumerate(records, 1):
            if not complete:  # the last row, cut mid-write
                break
            if number == 1 and self.is_csv:
                self._check_header(record, number)
            else:
                self.ids.append(self._row_id(record, number))
            keep += len(record)
        if self.is_csv and keep == 0:  # not even the header: a kill right after the file was created
            f.seek(0)
            f.truncate(0)
            f.write(csv_text([self.header]).encode("utf-8"))
            keep = f.tell()
        f.truncate(keep)
        f.seek(keep)

    def _decode(self, record: bytes, number: int) -> str:
        try:
            return record.decode("utf-8")
        except UnicodeDecodeError:
            raise _damaged(self.path, number, "is not UTF-8") from None

    def _check_header(self, record: bytes, number: int) -> None:
        rows = list(csv.reader(io.StringIO(self._decode(record, number), newline="")))
        if rows != [self.header]:
            raise _damaged(self.path, number, "is not the header this job writes")

    def _row_id(self, record: bytes, number: int) -> str:
        text = self._decode(record, number)
        if self.is_csv:
            try:
                rows = list(csv.reader(io.StringIO(text, newline=""), strict=True))
            except csv.Error:
                rows = []
            if len(rows) != 1 or len(rows[0]) != len(self.header):
                raise _damaged(self.path, number, f"is not a row of {len(self.header)} columns")
            return _csv_uncell(rows[0][self.header.index(self.id_field)])
        try:
            row = json.loads(text)
        except ValueError:
            raise _damaged(self.path, number, "is not a JSON row") from None
        if not isinstance(row, dict) or sorted(row) != sorted(self.columns):
            raise _damaged(self.path, number, "has other fields than this job writes")
        if not isinstance(row[self.id_field], str):
            raise _damaged(self.path, number, f"has no {self.id_field!r} string")
        return row[self.id_field]

    def _finish(self) -> None:
        self.file.close()


def _damaged(path: Path, number: int, why: str) -> DataError:
    """The refusal of an output to resume whose line ``number`` is damaged (``why``)."""
    return DataError(
        f"{path}: line {number} {why}; vitkit resumes only its own undamaged outputs (write to a new --out, or pass "
        "--overwrite to start again)"
    )


def _lines(f: BinaryIO, path: Path) -> Iterator[tuple[bytes, bool]]:
    """The lines of a file, each with whether it is complete (ends with a newline), one at a time; a line longer
    than :data:`MAX_ROW_BYTES` is DataError."""
    while True:
        line = f.readline(MAX_ROW_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_ROW_BYTES:
            raise DataError(f"{path}: a line of more than {MAX_ROW_BYTES >> 20} MiB; not a row vitkit wrote")
        yield line, line.endswith(b"\n")


def _csv_records(f: BinaryIO, path: Path) -> Iterator[tuple[bytes, bool]]:
    """The records of a CSV file as Python's csv module writes them (a quoted field may hold newlines: a record
    ends at a newline outside quotes), each with whether it is complete. An incomplete last record is a row a
    kill cut mid-write only when it holds no newline: one that runs over lines to the end of the file opens a
    quoted field that never closes (a stray ``"``), which is damage, refused naming its first line -- not rows
    to drop and compute again."""
    record, first = b"", 1
    for number, (line, _) in enumerate(_lines(f, path), 1):
        record += line
        if len(record) > MAX_ROW_BYTES:
            raise DataError(f"{path}: a row of more than {MAX_ROW_BYTES >> 20} MiB; not a row vitkit wrote")
        if record.endswith(b"\n") and record.count(b'"') % 2 == 0:
            yield record, True
            record, first = b"", number + 1
    if b"\n" in record:
        raise _damaged(path, first, "opens a quoted field that never closes (a stray '\"')")
    if record:
        yield record, False


class _ParquetWriter(RowWriter):
    """Parquet: one complete part file per batch in ``NAME.parts/``, merged into ``NAME`` on close."""

    def __init__(
        self, path: Path, fields: Sequence[Field], id_field: str, resume: bool, meta: Mapping[str, str]
    ) -> None:
        super().__init__(path, fields, id_field, meta)
        pa = pyarrow()
        self.pa = pa
        import pyarrow.parquet as pq  # after pyarrow(): its ConfigError names the extra to install

        self.pq = pq
        self.schema = pa.schema(
            [pa.field(f.name, _arrow_type(pa, f.kind)) for f in self.fields],
            metadata={WRITER_KEY: WRITER, **meta},
        )
        self.parts = Parts.beside(path, ".parquet")
        self.next_part = 0
        if resume:
            self._reopen()
        self.parts.folder.mkdir(exist_ok=True)

    def _reopen(self) -> None:
        self.parts.drop_temporaries()
        if self.path.exists() and not self.parts.numbered():  # a finished file: reopened as the first part
            self._check_ours(self.path)
            with open_regular(self.path, write=False) as done:  # copied (the store's write-then-rename): a kill
                self.parts.write(0, lambda f: shutil.copyfileobj(done, f, 1 << 20))  # leaves the file as it was
        for number, part in self.parts.numbered():
            self._check_ours(part)
            for batch in self.pq.ParquetFile(part).iter_batches(columns=[self.id_field]):  # the ids alone, streamed
                self.ids += [str(v) for v in batch.column(0).to_pylist()]
            self.next_part = number + 1

    def _check_ours(self, file: Path) -> None:
        try:
            schema = self.pq.read_schema(file)
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError...
            raise DataError(f"{file}: not a readable Parquet file ({e})") from None
        if (schema.metadata or {}).get(WRITER_KEY.encode()) != WRITER.encode():
            raise DataError(f"{file}: not written by vitkit; vitkit never overwrites what it did not write")
        if schema.remove_metadata() != self.schema.remove_metadata():
            raise ColumnsError(
                f"{file}: its columns ({', '.join(schema.names)}) are not those this job writes "
                f"({', '.join(self.schema.names)}); continue it with the options it was started with, or write to "
                "a new --out"
            )
        found = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in (schema.metadata or {}).items()}
        check_same(found, self.meta, str(file))

    def _write(self, n: int, values: list[list[Any]]) -> None:
        table = self.pa.table(
            {
                f.name: self.pa.array(v, type=self.schema.field(f.name).type)
                for f, v in zip(self.fields, values, strict=True)
            },
            schema=self.schema,
        )
        self.parts.write(self.next_part, lambda f: self.pq.write_table(table, f))
        self.next_part += 1

    def _finish(self) -> None:
        batches = (b for _, p in self.parts.numbered() for b in self.pq.ParquetFile(p).iter_batches())  # streamed
        write_parquet(self.path, self.schema, (self.pa.Table.from_batches([b], self.schema) for b in batches))
        self.parts.discard()  # renamed aside first: a kill never leaves some of the parts beside the file


def _arrow_type(pa: Any, kind: str) -> Any:
    scalar = {"int": pa.int64(), "float": pa.float32(), "str": pa.string(), "bool": pa.bool_()}
    return pa.list_(scalar[kind.removesuffix("_list")]) if kind.endswith("_list") else scalar[kind]


def check_rows_output(path: Path, *, resume: bool, overwrite: bool) -> None:
    """May ``path`` be written as a row output? New: yes. Existing (or a Parquet parts folder beside it): only
    with ``resume`` (continue it) or ``overwrite`` (start it again); a folder, or a parts folder holding files
    vitkit did not write, never."""
    output_format(path)
    side = sidecar_path(path)
    refuse_link(side, "--out")
    if os.path.lexists(side) and read_sidecar(path) is None:
        raise ConfigError(f"--out {path}: {side.name} beside it is not vitkit's mark; vitkit never overwrites it")
    precheck(path, Parts.beside(path, ".parquet"), formats=".jsonl, .csv or .parquet", resume=resume,
             overwrite=overwrite, ours=_is_ours if overwrite and not resume else None)  # fmt: skip


def _is_ours(path: Path) -> bool:
    """Whether an existing output carries vitkit's mark (a Parquet file's schema metadata, a text file's
    ``NAME.vitkit.json``)."""
    return parquet_marked(path) if path.suffix.lower() == ".parquet" else read_sidecar(path) is not None


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
    of an earlier run removed first; only an output vitkit marked); neither: the output must not exist. ``meta``:
    key/value strings stored with the output (Parquet schema metadata, a JSONL/CSV file's mark) and compared on
    resume. The output is locked against other processes until :meth:`RowWriter.close`."""
    out = Path(path)
    output_format(out)
    return Locked.locked(out, lambda: _open_locked(out, fields, id_field, resume, overwrite, meta or {}))


def _open_locked(
    out: Path, fields: Sequence[Field], id_field: str, resume: bool, overwrite: bool, meta: Mapping[str, str]
) -> RowWriter:
    check_rows_output(out, resume=resume, overwrite=overwrite)
    clean_stale(out.parent, [out.name, out.name + ".parts"])  # a merge or a removal a kill cut short
    fmt = output_format(out)
    if not resume:  # overwrite: what an earlier run left goes first (only vitkit's own file shapes)
        Parts.beside(out, ".parquet").discard()
        if out.exists():
            out.unlink()  # a regular file (check_rows_output refused links and the rest): replaced, not truncated
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == ".parquet":
        return _ParquetWriter(out, fields, id_field, resume, meta)
    return _TextWriter(out, fields, id_field, resume, meta)
