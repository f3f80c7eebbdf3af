"""Hugging Face ``datasets`` on disk, read with the ``datasets`` library (``pip install 'vitkit[datasets]'``).

Sources ``open_dataset`` routes here:

- a ``save_to_disk`` folder (a ``DatasetDict`` with one sub-folder per split, or a single ``Dataset``, which
  is the "train" split);
- ``.parquet`` / ``.arrow`` files, or a folder of them (split from the file names, ``train-00000-of-00001.parquet``,
  ``data/test-*.parquet``; a lone file is the "train" split);
- a Hub dataset id ``org/name`` served from the local ``datasets`` / Hub cache (offline mode,
  ``HF_HUB_OFFLINE=1``, works when it was downloaded before).

Columns: the image column is the one of ``Image`` type (else one named image/img), the label column the one of
``ClassLabel`` type (else one named label/labels); give them with ``image_column=`` / ``label_column=`` or in the
source, ``data.parquet?image=img&label=fine_label``, when there are several. ``ClassLabel`` names become the
class names; string labels are sorted into classes; plain integers name classes "0".."max".

A row whose image cannot be decoded, or whose label is missing, raises DataError naming its index
(``skip_bad=True`` drops such rows and lists them in ``ds.skipped``).
"""

from __future__ import annotations

import contextlib
import os
import re
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from vitkit.data.image_dataset import (
    ImageDataset,
    MissingSplitError,
    Skipped,
    check_class_map,
    default_classes,
    relabel,
    skip_or_raise,
    split_candidates,
)
from vitkit.errors import DataError
from vitkit.images import MAX_IMAGE_BYTES, ImageTooLarge, decode_image, max_image_pixels, read_image_file

IMAGE_NAMES = ("image", "img", "images", "picture", "pixel_values")
LABEL_NAMES = ("label", "labels", "fine_label", "class", "target", "y")
HUB_DATASET_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
FILE_SUFFIXES = (".parquet", ".arrow")
# A Parquet column chunk of more than MAX_IMAGE_BYTES uncompressed is read only when it expands at most this many
# times (image bytes are compressed already: about 1x; a cell of 1 GiB of zeros in 34 KB is not)
MAX_PARQUET_RATIO = 64


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError(
            "reading Hugging Face datasets needs the datasets package: pip install 'vitkit[datasets]' "
            "(or pip install datasets)"
        ) from None
    return datasets


def split_source(source: str) -> tuple[str, dict[str, str]]:
    """``path?image=img&label=y`` -> (path, {"image": "img", "label": "y"})."""
    if "?" not in source:
        return source, {}
    path, _, query = source.partition("?")
    opts = dict(urllib.parse.parse_qsl(query, keep_blank_values=False))
    unknown = sorted(set(opts) - {"image", "label"})
    if unknown:
        raise DataError(f"{source}: unknown option {unknown[0]!r} (use ?image=COLUMN&label=COLUMN)")
    return path, opts


def is_saved_dataset(path: Path) -> bool:
    """A ``save_to_disk`` folder: a DatasetDict (dataset_dict.json) or a Dataset (state.json + arrow files)."""
    return path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file())


def _data_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path] if path.suffix in FILE_SUFFIXES else []
    return sorted(Path(f) for f in _walk_data_files(path))


def _walk_data_files(folder: Path) -> Iterator[str]:
    """The Parquet/Arrow files under ``folder`` (not ``datasets``' cache files), from directory entries, in walk
    order; links to folders are not followed. Asked of every folder given to ``open_dataset``
    (:func:`is_hf_source`), a walk with pathlib cost an image folder ~75 us per image of an ``eval``'s main thread,
    more than the rest of the job."""
    for root, _, names in os.walk(folder):
        for name in names:
            data = os.path.splitext(name)[1] in FILE_SUFFIXES and "cache-" not in name
            if data and os.path.isfile(os.path.join(root, name)):
                yield os.path.join(root, name)


def is_hf_source(source: str) -> bool:
    """Whether ``open_dataset`` should read ``source`` with ``datasets``."""
    path = Path(split_source(source)[0])
    if path.is_file():
        return path.suffix in FILE_SUFFIXES
    if path.is_dir():
        if is_saved_dataset(path):
            return True
        # a folder of parquet/arrow files and no class folders of images
        return _has_data_file(path) and not any(
            e.is_dir() and not e.name.startswith(".") and e.name != "data" and not _has_data_file(Path(e.path))
            for e in os.scandir(path)
        )
    return False


def _has_data_file(folder: Path) -> bool:
    """Whether :func:`_data_files` of ``folder`` is not empty, stopping at the first."""
    return next(_walk_data_files(folder), None) is not None


# the file suffixes of datasets vitkit reads: a name ending so is a path (a Hub id never names a file)
PATH_SUFFIXES = (*FILE_SUFFIXES, ".npz", ".tar", ".json", ".zip")


def is_hub_dataset_id(source: str) -> bool:
    """Whether ``source`` names a Hugging Face Hub dataset (``org/name``) rather than a local path: spelled as
    an id, not there on disk, and not shaped like a path -- its first part is no local file or folder
    (``photos/holiday`` with a ``photos/`` here is a missing folder in it) and it ends in no dataset file
    suffix. A missing path is then refused without asking the Hub for it."""
    path = split_source(source)[0]
    if os.path.exists(path) or HUB_DATASET_ID.match(path) is None:
        return False
    return not os.path.lexists(path.split("/", 1)[0]) and not path.lower().endswith(PATH_SUFFIXES)


def no_scripts(datasets: Any) -> dict[str, Any]:
    """The keyword arguments that keep ``datasets.load_dataset`` from running a dataset's loading script (code
    that whoever wrote the dataset chose): ``trust_remote_code=False`` for the versions that have scripts (before
    4.0; the default since 2.20, the oldest version vitkit takes, said explicitly all the same), nothing from
    4.0, which runs no scripts at all (and may not take the argument)."""
    major = str(getattr(datasets, "__version__", "0")).split(".")[0]
    return {"trust_remote_code": False} if major.isdigit() and int(major) < 4 else {}


def check_parquet_sizes(path: Path) -> None:
    """DataError naming the file, row group and column when a column chunk of a Parquet file is over
    :data:`~vitkit.images.MAX_IMAGE_BYTES` uncompressed and either holds more than that per row (so some cell is
    over the per-image cap) or expands more than :data:`MAX_PARQUET_RATIO` times (a 34 KB file whose one cell is
    1 GiB of zeros): from the file's metadata, before ``datasets`` reads (and converts) a byte of it."""
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError...
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for c in range(group.num_columns):
            col = group.column(c)
            full, packed = col.total_uncompressed_size, col.total_compressed_size
            if full <= MAX_IMAGE_BYTES:
                continue
            if full > max(group.num_rows, 1) * MAX_IMAGE_BYTES or full > MAX_PARQUET_RATIO * max(packed, 1):
                raise DataError(
                    f"{path}: row group {g} of {group.num_rows} rows holds {full} bytes in column "
                    f"{col.path_in_schema!r} ({packed} compressed): over the {MAX_IMAGE_BYTES >> 20} MiB vitkit reads "
                    "for one image; not read"
                )


def _load(datasets: Any, path_text: str, split: str) -> Any:
    """The ``datasets.Dataset`` of ``split`` (aliases tried), MissingSplitError when there is none."""
    path = Path(path_text)
    try:
        if path.exists() and is_saved_dataset(path):
            obj = datasets.load_from_disk(str(path))
        elif path.exists():
            files = _data_files(path)
            if not files:
                raise DataError(f"{path}: no .parquet or .arrow files")
            kind = "parquet" if files[0].suffix == ".parquet" else "arrow"
            for f in files:
                if f.suffix == ".parquet":
                    check_parquet_sizes(f)
            if path.is_file():
                obj = datasets.load_dataset(kind, data_files={"train": str(path)}, **no_scripts(datasets))
            else:
                obj = datasets.load_dataset(str(path), **no_scripts(datasets))
        else:
            obj = _load_hub_dataset(datasets, path_text)
    except DataError:
        raise
    except (FileNotFoundError, ImportError) as e:  # ImportError: e.g. a builder needing an extra package
        if isinstance(e, FileNotFoundError) and not path.exists():
            raise DataError(
                f"{path_text}: no such file or directory, and not a dataset in the local Hugging Face cache "
                f"(offline mode: download it first with datasets.load_dataset on a connected machine) ({e})"
            ) from None
        raise DataError(f"{path_text}: {e}") from None
    except Exception as e:  # datasets raises many types (DatasetNotFoundError, ConnectionError, ArrowInvalid...)
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        if not path.exists():
            raise DataError(
                f"{path_text}: no such file or directory, and not a Hub dataset in the local Hugging Face cache "
                f"({first})"
            ) from None
        raise DataError(f"{path_text}: cannot read as a Hugging Face dataset ({first})") from None
    if isinstance(obj, datasets.DatasetDict):
        for name in split_candidates(split):
            if name in obj:
                return obj[name]
        raise MissingSplitError(f"{path_text}: no split {split!r} (splits: {', '.join(obj)})")
    if split_candidates(split)[0] != "train":
        raise MissingSplitError(f"{path_text}: a single dataset without splits; it serves split 'train' only")
    return obj


@contextlib.contextmanager
def _offline(datasets: Any) -> Iterator[None]:
    """``datasets`` and huggingface_hub in their offline mode while a Hub id is looked up, as ``HF_HUB_OFFLINE=1``
    would set them at import (their own switch, read per call): a name that is in no local cache -- a mistyped
    folder like ``photos/holiday`` -- is answered from this machine, never sent to the Hub."""
    import huggingface_hub.constants as hub_constants

    config = datasets.config
    saved = (config.HF_HUB_OFFLINE, getattr(config, "HF_DATASETS_OFFLINE", None), hub_constants.HF_HUB_OFFLINE)
    config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    if saved[1] is not None:
        config.HF_DATASETS_OFFLINE = True
    try:
        yield
    finally:
        config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved[0], saved[2]
        if saved[1] is not None:
            config.HF_DATASETS_OFFLINE = saved[1]


def _load_hub_dataset(datasets: Any, repo_id: str) -> Any:
    """A Hub dataset by id, from this machine only: through ``datasets`` (its cache, offline), else from the
    snapshot of the repository in huggingface_hub's cache (where ``datasets`` keeps the downloaded data files).
    Nothing is requested from the Hub (download a dataset with ``datasets.load_dataset`` first)."""
    from vitkit.hub.resolve import quiet_logs

    with quiet_logs("datasets", "huggingface_hub"):
        try:
            with _offline(datasets):
                return datasets.load_dataset(repo_id, **no_scripts(datasets))
        except Exception as first:
            from huggingface_hub import snapshot_download

            try:
                folder = snapshot_download(repo_id, repo_type="dataset", local_files_only=True)
            except Exception:
                raise first from None
            return datasets.load_dataset(str(folder), **no_scripts(datasets))


def _pick(
    kind: str, source: str, given: str | None, columns: list[str], typed: list[str], names: tuple[str, ...]
) -> str:
    option = f"{kind}_column= / ?{kind}=COLUMN"
    if given is not None:
        if given not in columns:
            raise DataError(f"{source}: no column {given!r} (columns: {', '.join(columns)})")
        return given
    found = typed or [c for c in columns if c.lower() in names]  # the columns of the kind's feature type, else by name
    if len(found) == 1:
        return found[0]
    raise DataError(
        f"{source}: cannot tell the {kind} column among {', '.join(columns)}; name it with {option}"
        if not found
        else f"{source}: several {kind} columns ({', '.join(found)}); choose one with {option}"
    )


class HFDataset(ImageDataset):
    """A split of a Hugging Face dataset; images decoded on access (Pillow), labels read once."""

    def __init__(
        self, source: str, split: str, table: Any, image_column: str, rows: np.ndarray, labels: np.ndarray,
        classes: list[str], skipped: list[Skipped],
    ) -> None:  # fmt: skip
        super().__init__(source, split, classes, labels)
        self.table = table
        self.image_column = image_column
        self.rows = rows  # dataset row of each item (rows dropped by skip_bad are absent)
        self.skipped = skipped
        self.roots: tuple[Path, ...] = ()  # where an image cell's path may point (cell_roots)

    def describe(self, index: int) -> str:
        return f"{self.source} ({self.split}) row {int(self.rows[index])}"

    def load_image(self, index: int) -> Image.Image:
        return decode_cell(self.table[int(self.rows[index])][self.image_column], self.describe(index), self.roots)


def decode_cell(value: Any, what: str, roots: tuple[Path, ...] = ()) -> Image.Image:
    """An image cell (``{"bytes", "path"}`` with decoding off, raw bytes, or an array) -> a PIL image, through
    the one decoder (:func:`~vitkit.images.decode_image`: its pixel, scan and format bounds).
    A cell's ``path`` is read only when it is a regular file under one of ``roots`` (the dataset's folder, the
    datasets library's caches): a dataset cannot make vitkit read a file of its author's choosing."""
    try:
        if isinstance(value, Image.Image):
            return value
        if isinstance(value, dict):
            data, path = value.get("bytes"), value.get("path")
            if data is None and path:
                data = _cell_file(str(path), what, roots)
            value = data
        if isinstance(value, bytes | bytearray):
            if not value:
                raise DataError(f"{what}: empty image (0 bytes)")
            try:
                return decode_image(bytes(value), what)
            except ImageTooLarge:
                raise
            except DataError as e:  # the decoder's reason, as an unreadable image of this row
                raise DataError(f"{what}: unreadable image ({str(e).removeprefix(what + ': ')})") from None
        if value is None:
            raise DataError(f"{what}: no image (null)")
        arr = np.asarray(value)
        if arr.dtype != np.uint8:
            raise DataError(f"{what}: image array of dtype {arr.dtype} (expected uint8)")
        limit = max_image_pixels()
        if arr.ndim >= 2 and limit is not None and arr.shape[0] * arr.shape[1] > limit:
            raise ImageTooLarge(f"{what}: image array of {arr.shape[1]}x{arr.shape[0]} pixels exceeds the limit of "
                                f"{limit} pixels")  # fmt: skip
        return Image.fromarray(arr)
    except DataError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, TypeError) as e:
        raise DataError(f"{what}: unreadable image ({e})") from None


def _cell_file(path: str, what: str, roots: tuple[Path, ...]) -> bytes:
    real = Path(path).resolve()
    if not any(real.is_relative_to(r) for r in roots):
        raise DataError(f"{what}: its image is a file outside the dataset's folder ({path}); not read")
    return read_image_file(real)


def cell_roots(path_text: str, datasets: Any) -> tuple[Path, ...]:
    """Where an image cell's ``path`` may point: a local dataset's own folder, and the datasets and Hub caches
    (where a Hub dataset's files are extracted)."""
    roots = [Path(datasets.config.HF_DATASETS_CACHE)]
    local = Path(path_text)
    if local.exists():
        roots.append(local if local.is_dir() else local.parent)
    with contextlib.suppress(ImportError):
        from huggingface_hub import constants

        roots.append(Path(constants.HF_HUB_CACHE))
    return tuple(r.resolve() for r in roots)


def _cell_sizes(table: Any, column: str) -> np.ndarray:
    """The byte length of each row's encoded image (its ``bytes`` field, or the binary cell), from the Arrow offsets
    alone (the memory-mapped bytes are not touched); zeros for a column of another type."""
    import pyarrow as pa
    import pyarrow.compute as pc

    parts = []
    for chunk in table.data.column(column).chunks:
        if pa.types.is_struct(chunk.type) and chunk.type.get_field_index("bytes") >= 0:
            chunk = pc.struct_field(chunk, "bytes")  # (a slice's own rows: StructArray.field ignores its offset)
        if not (pa.types.is_binary(chunk.type) or pa.types.is_large_binary(chunk.type)):
            return np.zeros(len(table), dtype=np.int64)
        parts.append(pc.binary_length(chunk).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64))
    sizes = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if table._indices is not None:  # a selection or shuffle of the underlying table
        sizes = sizes[table._indices.column(0).to_numpy()]
    return sizes


def _labels_and_classes(table: Any, column: str, source: str, datasets: Any) -> tuple[np.ndarray, list[str], list[int]]:
    """(int64 labels with -1 for missing, class names, rows with a missing label)."""
    feature = table.features[column]
    values = table.data.column(column).to_pylist() if table._indices is None else list(table[column])
    missing = [i for i, v in enumerate(values) if v is None or (isinstance(v, int) and v < 0)]
    if isinstance(feature, datasets.ClassLabel):
        labels = np.asarray([-1 if v is None else int(v) for v in values], dtype=np.int64)
        return labels, list(feature.names), missing
    if all(isinstance(v, str) for v in values if v is not None):
        classes = sorted({v for v in values if v is not None})
        index = {c: i for i, c in enumerate(classes)}
        return np.asarray([-1 if v is None else index[v] for v in values], dtype=np.int64), classes, missing
    if all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in values if v is not None):
        labels = np.asarray([-1 if v is None else int(v) for v in values], dtype=np.int64)
        return labels, default_classes(labels[labels >= 0]), missing
    kind = type(next(v for v in values if v is not None)).__name__ if len(missing) < len(values) else "null"
    raise DataError(f"{source}: label column {column!r} holds {kind} values (expected class ids or names)")


def open_hf_dataset(
    source: str,
    split: str = "train",
    *,
    skip_bad: bool = False,
    classes: list[str] | None = None,
    image_column: str | None = None,
    label_column: str | None = None,
    predecode: bool = True,
) -> HFDataset:
    """One split of a Hugging Face dataset (see the module docstring for the sources it reads); ``skip_bad`` and
    ``predecode``: every image cell decoded once now, the bad rows dropped (``open_dataset``)."""
    datasets = _datasets()
    path_text, opts = split_source(source)
    table = _load(datasets, path_text, split)
    columns = list(table.column_names)
    features = table.features
    images = [c for c in columns if isinstance(features[c], datasets.Image)]
    label_types = [c for c in columns if isinstance(features[c], datasets.ClassLabel)]
    img_col = _pick("image", path_text, image_column or opts.get("image"), columns, images, IMAGE_NAMES)
    lab_col = _pick("label", path_text, label_column or opts.get("label"), columns, label_types, LABEL_NAMES)
    if isinstance(features[img_col], datasets.Image):
        table = table.cast_column(img_col, datasets.Image(decode=False))
    labels, found, missing = _labels_and_classes(table, lab_col, path_text, datasets)
    what = f"{path_text} ({split})"
    skipped: list[Skipped] = []
    keep = np.ones(len(labels), dtype=bool)
    if missing:
        if not skip_bad:
            raise DataError(f"{what} row {missing[0]}: no label in column {lab_col!r}")
        skipped += [Skipped(f"{what} row {i}", "no label") for i in missing]
        keep[missing] = False
    if labels.size and labels.max() >= len(found):
        bad = int(np.argmax(labels >= len(found)))  # first row whose label is out of range
        raise DataError(f"{what} row {bad}: label {int(labels[bad])} outside the {len(found)} classes of {lab_col!r}")
    for row in np.flatnonzero(keep)[_cell_sizes(table, img_col)[keep] > MAX_IMAGE_BYTES].tolist():
        problem = f"an image of more than {MAX_IMAGE_BYTES >> 20} MiB, the most vitkit reads for one image"
        skip_or_raise(skip_bad, skipped, f"{what} row {row}", problem)
        keep[row] = False
    names = check_class_map(path_text, found, classes)
    roots = cell_roots(path_text, datasets)
    if skip_bad and predecode:
        for row in np.flatnonzero(keep).tolist():
            try:
                decode_cell(table[row][img_col], f"{what} row {row}", roots)
            except DataError as e:
                skipped.append(Skipped(f"{what} row {row}", str(e).split(": ", 1)[-1]))
                keep[row] = False
    rows = np.flatnonzero(keep)
    if not rows.size:
        raise DataError(f"{what}: no readable rows")
    labels = relabel(labels[rows], found, names)
    ds = HFDataset(path_text, split, table, img_col, rows, labels, names, skipped)
    ds.roots = roots
    return ds
