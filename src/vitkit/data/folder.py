"""ImageFolder trees: one sub-folder per class, images inside.

Layouts accepted for ``open_dataset(root, split)``:

- ``root/<split>/<class>/<image>`` (``val`` also finds ``validation``/``valid``), or
- ``root/<class>/<image>`` for the "train" split when ``root`` has no split folders.

Classes are the sorted class-folder names of the training split (so a validation split that lacks a class
keeps the same indices); a held-out split's folders must be a subset. Files that are not images by their
extension (README.txt, .DS_Store) are ignored; hidden entries too.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from vitkit.data.image_dataset import (
    ImageDataset,
    MissingSplitError,
    Skipped,
    check_class_map,
    decodable_items,
    skip_or_raise,
    split_candidates,
)
from vitkit.errors import DataError
from vitkit.images import LazyImage, load_image, open_lazy

IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm", ".jfif"}
)


class ImageFolder(ImageDataset):
    """Images listed from a class-per-folder tree; decoded on access."""

    def __init__(
        self, root: Path, split: str, paths: list[str], labels: np.ndarray, classes: list[str], skipped: list[Skipped]
    ) -> None:
        super().__init__(str(root), split, classes, labels)
        self.paths = paths
        self.skipped = skipped

    def load_image(self, index: int) -> Image.Image:
        return load_image(self.paths[index])

    def load_lazy(self, index: int) -> LazyImage:
        return open_lazy(self.paths[index])

    def describe(self, index: int) -> str:
        return self.paths[index]


def _subdirs(path: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(path) if not e.name.startswith(".") and _is(e.is_dir))


def _split_dir(root: Path, split: str) -> Path | None:
    for name in split_candidates(split):
        if (root / name).is_dir():
            return root / name
    return None


def _has_split_dirs(root: Path) -> bool:
    return any((root / n).is_dir() for s in ("train", "val", "test") for n in split_candidates(s))


def resolve_split(root: Path, split: str) -> Path:
    """The folder holding the class folders of ``split``."""
    d = _split_dir(root, split)
    if d is not None:
        return d
    if split_candidates(split)[0] == "train" and not _has_split_dirs(root):
        return root
    have = [n for n in _subdirs(root) if n in {c for s in ("train", "val", "test") for c in split_candidates(s)}]
    raise MissingSplitError(f"{root}: no split {split!r} (split folders found: {', '.join(have) or 'none'})")


def open_image_folder(
    root: Path,
    split: str = "train",
    *,
    skip_bad: bool = False,
    classes: list[str] | None = None,
    predecode: bool = True,
) -> ImageFolder:
    """List an ImageFolder split; zero-byte files and empty class folders fail here (or are skipped).

    Corrupt or truncated images are found when decoded (DataError naming the file). With ``skip_bad``
    every image is decoded once now, so that bad ones can be dropped before training starts (unless
    ``predecode`` is False: the batch jobs' stream makes them failed rows as it comes to them).
    """
    base = resolve_split(root, split)
    found = _subdirs(base)
    if not found:
        raise DataError(f"{base}: no class folders (expected {base}/<class>/<image>)")
    if classes is None:
        train_dir = _split_dir(root, "train") if base != root else root
        classes = _subdirs(train_dir) if train_dir is not None and train_dir != base else found
    names = check_class_map(str(base), found, classes)
    index = {c: i for i, c in enumerate(names)}
    paths: list[str] = []
    labels: list[int] = []
    skipped: list[Skipped] = []
    for link, why in _broken_links(base, lambda e: not e.name.startswith(".")):  # class folders
        skip_or_raise(skip_bad, skipped, link, why)
    for cls in found:
        folder = base / cls
        files, broken = _image_files(folder)
        for link, why in broken:
            skip_or_raise(skip_bad, skipped, link, why)
        if not files:
            if not skip_bad:
                raise DataError(
                    f"{folder}: empty class folder (no image files); remove it, or pass --skip-bad "
                    "(skip_bad=True) to skip it"
                )
            skipped.append(Skipped(str(folder), "empty class folder"))
            continue
        for f in files:
            if os.path.getsize(f) == 0:
                skip_or_raise(skip_bad, skipped, f, "empty file (0 bytes)")
                continue
            paths.append(f)
            labels.append(index[cls])
    if skip_bad and predecode:
        keep = decodable_items(paths, lambda i: load_image(paths[i]), skipped)
        paths, labels = [paths[i] for i in keep], [labels[i] for i in keep]
    if not paths:
        raise DataError(f"{base}: no readable images")
    return ImageFolder(root, split, paths, np.asarray(labels, dtype=np.int64), names, skipped)


def list_image_files(root: str | os.PathLike[str], what: str) -> list[str]:
    """Every image file in the folder ``root`` and its sub-folders (an unlabelled folder of images, or an
    ImageFolder's class folders), sorted; names that are not images by their extension and hidden entries are
    skipped, as in an ImageFolder. ``what`` names the input in errors (an option such as ``--calibration``).

    Raises DataError when ``root`` is missing or not a folder, holds no image file, or holds an empty (0-byte)
    image file or an image-named link that leads nowhere; the files are not decoded here.
    """
    base = Path(root)
    if not base.exists():
        raise DataError(f"{what} {base}: no such folder")
    if not base.is_dir():
        raise DataError(f"{what} {base}: not a folder (give a folder of images)")

    def unreadable(err: OSError) -> None:
        raise DataError(f"{what}: {err.filename}: {err.strerror or err}")

    found: list[str] = []
    for folder, dirs, _ in os.walk(base, onerror=unreadable):  # symbolic links to folders are not followed
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        files, broken = _image_files(Path(folder))
        for link, why in broken:
            raise DataError(f"{what}: {link}: {why}")
        for f in files:
            if os.path.getsize(f) == 0:
                raise DataError(f"{what}: {f}: empty file (0 bytes)")
        found += files
    if not found:
        extensions = ", ".join(sorted(IMAGE_EXTENSIONS))
        raise DataError(f"{what} {base}: no image files in it or its sub-folders ({extensions})")
    return sorted(found)


def is_image_name(name: str) -> bool:
    """Whether a file named ``name`` is listed as an image: not hidden, an image extension (any case)."""
    return not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def _image_files(folder: Path) -> tuple[list[str], list[tuple[str, str]]]:
    """The image files of a class folder (sorted), and its image-named symbolic links that lead nowhere."""
    files = sorted(e.path for e in os.scandir(folder) if is_image_name(e.name) and _is(e.is_file))
    return files, _broken_links(folder, lambda e: is_image_name(e.name))


def _is(test: Callable[[], bool]) -> bool:
    """``test()`` (an entry's ``is_dir`` or ``is_file``), False where it raises."""
    try:
        return test()
    except OSError:  # a symbolic link loop: reported by _broken_links
        return False


def _broken_links(folder: Path, wanted: Callable[[os.DirEntry[str]], bool]) -> list[tuple[str, str]]:
    """(path, reason) of the symbolic links in ``folder`` that are dangling or loop: they are reported
    like any other bad item, never dropped silently."""
    out = []
    for e in sorted((e for e in os.scandir(folder) if e.is_symlink() and wanted(e)), key=lambda e: e.name):
        try:
            os.stat(e.path)
        except OSError as err:
            target = os.readlink(e.path)
            if err.errno == errno.ELOOP:
                out.append((e.path, f"symbolic link loop (-> {target})"))
            else:
                out.append((e.path, f"dangling symbolic link (-> {target}: {err.strerror})"))
    return out
