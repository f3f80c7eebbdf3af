"""Images in: an image file or its bytes -> a decoded PIL image or pixel array, with every bound checked before
any pixel memory is allocated. Pillow, numpy and simplejpeg only; below every other package but ``errors``.

- :func:`load_image` / :func:`decode_image`: the one decoder of every command (datasets, shards, predict,
  analyze, serve): a regular file under :data:`MAX_IMAGE_BYTES` (:func:`read_image_file`), a JPEG of at most
  :data:`MAX_JPEG_SCANS` scans, a header under :func:`max_image_pixels`, one of :data:`IMAGE_FORMATS`;
  anything else is one :class:`~vitkit.errors.DataError` naming the image (:class:`ImageTooLarge` for bombs).
- :func:`open_lazy` / :func:`lazy_image`: a JPEG read and its header checked but not decoded
  (:class:`EncodedJpeg`), so that a transform decodes only the scale it needs (:func:`decode_scaled`,
  :func:`decode_crop`, :func:`decode_crop_rgb`: libjpeg's DCT scaling at 1/2, 1/4 or 1/8).
- :func:`convert_image`: any decoded mode -> "RGB" or "L", the conversion every command uses.
"""

from __future__ import annotations

import io
import os
import stat
import warnings
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from PIL import Image, UnidentifiedImageError

from vitkit.errors import DataError

# One image file is read only when it is a regular file of at most this many bytes (an 89-megapixel PNG, the
# pixel limit, rarely exceeds 100 MB); a sparse 1.5 GB "photo" or a link to /dev/zero is refused unread
MAX_IMAGE_BYTES = 256 << 20
# A JPEG with more scans than this is refused before decoding: a progressive JPEG has about 10, and each empty
# scan costs a full pass over the coefficients (2,000 of them in 95 KB took seconds of CPU)
MAX_JPEG_SCANS = 64
# The formats decoded (those of the documented extensions; JPEG's opener also gives cameras' MPO files): Pillow's
# other plugins (EPS through Ghostscript, among them) are never reached
IMAGE_FORMATS = ("JPEG", "PNG", "BMP", "GIF", "TIFF", "WEBP", "PPM")
# Structure bounds, checked from the bytes before Pillow parses them (each bomb below took Pillow seconds to minutes
# and up to gigabytes inside the byte and pixel caps):
# - a GIF's extension blocks (comments, application data, plain text) hold at most this many bytes in all: Pillow
#   joins a comment's sub-blocks quadratically (16 MiB of them took 21 s); real ones hold a few KB
MAX_GIF_EXTENSION_BYTES = 1 << 20
# - a PNG has at most this many chunks (an 89-megapixel PNG in libpng's 8 KiB IDAT chunks has about 13,000; 5.6
#   million empty private chunks took 15 s and 737 MB), of which those other than image data (IDAT, APNG's fdAT)
#   hold at most MAX_PNG_ANCILLARY_BYTES (an ICC profile or XMP packet takes a few hundred KB)
MAX_PNG_CHUNKS = 1 << 16
MAX_PNG_ANCILLARY_BYTES = 32 << 20
# - a TIFF tag of numbers (strip or tile offsets and byte counts among them) holds at most this many values (an
#   89-megapixel image stored one row per strip has about 10,000 strips; one of 3 million 1-pixel rows took 23 s and
#   1.4 GB), and an IFD at most this many entries (65,535 is the most a classic TIFF can hold)
MAX_TIFF_VALUES = 1 << 16
MAX_TIFF_ENTRIES = 0xFFFF
# Decoded modes whose conversion to 8 bits costs more than an RGB image's decode (float64 copies of every pixel):
# each of their pixels counts this many against max_image_pixels (an 88-megapixel float TIFF peaked at 2.6 GB, an
# RGB one at 0.9 GB; at the weighted limit, 22 MP, a float or 16-bit TIFF peaks below that RGB one)
MODE_PIXEL_WEIGHT = {"F": 4, "I": 4, "I;16": 4, "I;16B": 4, "I;16L": 4, "I;16N": 4}

# What the Python API takes as one image (vitkit.predict, vitkit.embed): a file's path or a decoded Pillow image
ImageInput = str | os.PathLike[str] | Image.Image


def read_image_file(path: str | os.PathLike[str], *, empty_ok: bool = False) -> bytes:
    """The bytes of an image file, read safely: opened without blocking (a FIFO never hangs), checked with
    ``fstat`` to be a regular file (a link to one is fine; to /dev/zero, a FIFO or a socket not) of at most
    :data:`MAX_IMAGE_BYTES`, then read to at most that + 1 bytes (a file growing meanwhile). DataError naming it
    otherwise (missing, a folder, empty unless ``empty_ok``, too large, unreadable)."""
    p = os.fspath(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            _check_stat(p, os.fstat(fd), empty_ok)
            os.set_blocking(fd, True)
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read(MAX_IMAGE_BYTES + 1)
        finally:
            os.close(fd)
    except FileNotFoundError:  # only the open can say it: the rest reads the file it opened
        raise DataError(f"{p}: no such file") from None
    except OSError as e:
        raise DataError(f"{p}: unreadable ({e.strerror or e})") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise DataError(f"{p}: more than {MAX_IMAGE_BYTES >> 20} MiB, the most vitkit reads for one image")
    if not data and not empty_ok:
        raise DataError(f"{p}: empty file (0 bytes)")
    return data


def _check_stat(p: str, st: os.stat_result, empty_ok: bool = False) -> None:
    if stat.S_ISDIR(st.st_mode):
        raise DataError(f"{p}: is a directory, not an image")
    if not stat.S_ISREG(st.st_mode):
        raise DataError(f"{p}: not a regular file (a FIFO, device or socket); vitkit reads images from files only")
    if st.st_size == 0 and not empty_ok:
        raise DataError(f"{p}: empty file (0 bytes)")
    if st.st_size > MAX_IMAGE_BYTES:
        raise DataError(
            f"{p}: {st.st_size} bytes, more than the {MAX_IMAGE_BYTES >> 20} MiB vitkit reads for one image"
        )


def jpeg_scans(data: bytes, limit: int = MAX_JPEG_SCANS) -> int:
    """The number of scans (SOS markers) of a JPEG's own marker stream, counted from the bytes without
    decoding (segments skipped by their lengths, entropy-coded data up to its next marker), up to ``limit``
    + 1. A malformed stream stops the count (the decoder then names what is wrong)."""
    i, scans, n = 2, 0, len(data)
    while i + 4 <= n and scans <= limit:
        if data[i] != 0xFF:
            break
        marker = data[i + 1]
        if marker == 0xFF:  # a fill byte
            i += 1
            continue
        if marker == 0xD9:  # end of image
            break
        if 0xD0 <= marker <= 0xD7 or marker == 0x01:  # markers without a length
            i += 2
            continue
        i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
        if marker == 0xDA:
            scans += 1
            i = _scan_end(data, i)
    return scans


def _scan_end(data: bytes, i: int) -> int:
    """Where the entropy-coded data starting at ``i`` ends: the next 0xFF that is not a stuffed zero, a
    restart marker or a fill byte."""
    while True:
        i = data.find(b"\xff", i)
        if i < 0 or i + 1 >= len(data):
            return len(data)
        nxt = data[i + 1]
        if nxt == 0x00 or 0xD0 <= nxt <= 0xD7 or nxt == 0xFF:
            i += 1
            continue
        return i


def check_jpeg_scans(data: bytes, name: str | Callable[[], str]) -> None:
    """ImageTooLarge naming the image when ``data`` is a JPEG of more than :data:`MAX_JPEG_SCANS` scans."""
    if data[:2] == b"\xff\xd8" and jpeg_scans(data) > MAX_JPEG_SCANS:
        raise ImageTooLarge(
            f"{_named(name)}: a JPEG of more than {MAX_JPEG_SCANS} scans (progressive JPEGs have about 10): refused "
            "undecoded, as a decompression bomb"
        )


def check_structure(data: bytes, name: str | Callable[[], str]) -> None:
    """:class:`ImageTooLarge` naming the image when the block structure of a GIF, PNG or TIFF is over its bounds
    (:data:`MAX_GIF_EXTENSION_BYTES`, :data:`MAX_PNG_CHUNKS`, :data:`MAX_PNG_ANCILLARY_BYTES`,
    :data:`MAX_TIFF_VALUES`, :data:`MAX_TIFF_ENTRIES`): walked from the bytes, block headers only, before Pillow
    parses anything. A malformed structure stops the walk (the decoder then names what is wrong)."""
    if data[:6] in (b"GIF87a", b"GIF89a"):
        problem = _gif_problem(data)
    elif data[:8] == b"\x89PNG\r\n\x1a\n":
        problem = _png_problem(data)
    elif data[:4] in (b"II*\0", b"MM\0*", b"II+\0", b"MM\0+"):
        problem = _tiff_problem(data)
    else:
        return
    if problem is not None:
        raise ImageTooLarge(f"{_named(name)}: {problem}: refused undecoded, as a decompression bomb")


def _gif_problem(data: bytes) -> str | None:
    """What is over the bounds in a GIF's blocks up to its first image's data (all Pillow reads of a still image)."""
    n = len(data)
    i = 13 + ((3 << ((data[10] & 7) + 1)) if n > 10 and data[10] & 0x80 else 0)  # header, screen, global colours
    extension = 0
    while i < n:
        block = data[i]
        if block == 0x21:  # an extension: its label, then sub-blocks
            i, size = _gif_sub_blocks(data, i + 2, MAX_GIF_EXTENSION_BYTES - extension)
            extension += size
            if extension > MAX_GIF_EXTENSION_BYTES:
                return f"a GIF with more than {MAX_GIF_EXTENSION_BYTES} bytes of extension blocks (comments, app data)"
        else:  # the first image descriptor (Pillow decodes it), the trailer, or a malformed block
            return None
    return None


def _gif_sub_blocks(data: bytes, i: int, limit: int) -> tuple[int, int]:
    """(where the sub-blocks starting at ``i`` end, their data bytes), counted up to ``limit`` + 1."""
    total, n = 0, len(data)
    while i < n and total <= limit:
        size = data[i]
        i += 1 + size
        if size == 0:
            break
        total += size
    return i, total


def _png_problem(data: bytes) -> str | None:
    """What is over the bounds in a PNG's chunks (walked by their lengths up to IEND)."""
    i, n, chunks, ancillary = 8, len(data), 0, 0
    while i + 8 <= n:
        length = int.from_bytes(data[i : i + 4], "big")
        kind = data[i + 4 : i + 8]
        chunks += 1
        if chunks > MAX_PNG_CHUNKS:
            return f"a PNG of more than {MAX_PNG_CHUNKS} chunks"
        if kind not in (b"IDAT", b"fdAT"):
            ancillary += length
            if ancillary > MAX_PNG_ANCILLARY_BYTES:
                return f"a PNG with more than {MAX_PNG_ANCILLARY_BYTES >> 20} MiB in chunks other than image data"
        if kind == b"IEND":
            break
        i += 12 + length
    return None


_TIFF_BYTES_TYPES = (1, 2, 6, 7)  # BYTE, ASCII, SBYTE, UNDEFINED: Pillow keeps them as bytes, not one int each
_TIFF_STRIP_TAGS = {273: "strips", 279: "strips", 324: "tiles", 325: "tiles"}


def _tiff_problem(data: bytes) -> str | None:
    """What is over the bounds in the first IFD of a TIFF (classic or BigTIFF): its entry count, and the number of
    values of each numeric tag (strip and tile offsets and byte counts among them), read from the entry headers."""
    order: Literal["little", "big"] = "little" if data[:2] == b"II" else "big"
    big = data[2:4] in (b"+\0", b"\0+")
    start = int.from_bytes(data[8:16] if big else data[4:8], order)
    head, entry, width = (8, 20, 8) if big else (2, 12, 4)  # entry count size, entry size, count field size
    if start + head > len(data):
        return None
    entries = int.from_bytes(data[start : start + head], order)
    if entries > MAX_TIFF_ENTRIES:
        return f"a TIFF directory of {entries} entries (at most {MAX_TIFF_ENTRIES})"
    for k in range(min(entries, (len(data) - start - head) // entry)):
        at = start + head + k * entry
        tag, kind = int.from_bytes(data[at : at + 2], order), int.from_bytes(data[at + 2 : at + 4], order)
        count = int.from_bytes(data[at + 4 : at + 4 + width], order)
        if count > MAX_TIFF_VALUES and kind not in _TIFF_BYTES_TYPES:
            what = _TIFF_STRIP_TAGS.get(tag)
            return (
                f"a TIFF of {count} {what} (at most {MAX_TIFF_VALUES})"
                if what
                else f"a TIFF tag {tag} of {count} values (at most {MAX_TIFF_VALUES})"
            )
    return None


class EncodedJpeg:
    """A JPEG read into memory but not decoded: its header's size and Pillow's mode for it ("RGB" for YCbCr
    and RGB JPEGs, "L" for greyscale), so that a random crop can be drawn first and then only the scale it
    needs decoded (:func:`decode_crop`, :func:`decode_crop_rgb`). ``name`` identifies it in errors (a path,
    or a function that names a shard member only when an error needs it)."""

    __slots__ = ("_name", "data", "height", "mode", "width")

    def __init__(self, data: bytes, width: int, height: int, mode: str, name: str | Callable[[], str]) -> None:
        self.data, self.width, self.height, self.mode, self._name = data, width, height, mode, name

    @property
    def size(self) -> tuple[int, int]:
        return self.width, self.height

    @property
    def name(self) -> str:
        return _named(self._name)

    def __repr__(self) -> str:
        return f"EncodedJpeg({self.name!r}, {self.width}x{self.height}, {self.mode}, {len(self.data)} bytes)"


LazyImage = Image.Image | EncodedJpeg
_JPEG_MODES = {"YCbCr": "RGB", "RGB": "RGB", "Gray": "L"}  # libjpeg colour space -> Pillow's decoded mode


def encoded_jpeg(data: bytes, name: str | Callable[[], str]) -> EncodedJpeg | None:
    """``data`` as an :class:`EncodedJpeg` when it is a JPEG whose header libjpeg-turbo reads and which
    decodes to RGB or L (not CMYK/YCCK); None otherwise (decode it fully: :func:`decode_image` names what is
    wrong). A header declaring more pixels than :func:`max_image_pixels` is refused here, before any pixel
    memory, as :func:`decode_image` does."""
    if data[:2] != b"\xff\xd8":
        return None
    check_jpeg_scans(data, name)
    import simplejpeg

    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    mode = _JPEG_MODES.get(colorspace)
    if mode is None or width <= 0 or height <= 0:
        return None
    _check_pixels(width, height, max_image_pixels(), name)
    return EncodedJpeg(data, int(width), int(height), mode, name)


def open_lazy(path: str | os.PathLike[str]) -> LazyImage:
    """A JPEG file read but not decoded (:class:`EncodedJpeg`: only its header parsed), so that a crop can be
    decoded at reduced scale (:func:`decode_crop`); any other image decoded as :func:`load_image` does."""
    p = os.fspath(path)
    return lazy_image(read_image_file(p), p)


def lazy_image(data: bytes, name: str | Callable[[], str]) -> LazyImage:
    """Encoded image bytes as an :class:`EncodedJpeg` when :func:`encoded_jpeg` takes them, else fully
    decoded by :func:`decode_image` (which names what is wrong). ``name`` as for :class:`EncodedJpeg`."""
    lazy = encoded_jpeg(data, name)
    return lazy if lazy is not None else decode_image(data, _named(name))


def decode_crop(
    img: LazyImage, box: tuple[int, int, int, int], size: tuple[int, int], *, reduce: bool = True
) -> tuple[Image.Image, tuple[float, float, float, float]]:
    """Decode a lazy JPEG for a crop ``box`` (left, top, right, bottom, full-resolution pixels) that will
    be resized to ``size`` = (H, W): at 1/2, 1/4 or 1/8 scale (libjpeg's DCT scaling, what ``Image.draft``
    does) when the crop keeps at least ``size`` pixels at that scale. Returns the decoded image (Pillow's
    mode for the file, the same pixels as Pillow's decode) and the same region in its pixels (reduced pixel
    i covers full-resolution pixels [i s, (i + 1) s)); ``reduce=False`` decodes at full scale. An image that
    is already decoded comes back as it is."""
    if not isinstance(img, EncodedJpeg):
        return img, (float(box[0]), float(box[1]), float(box[2]), float(box[3]))
    scale = draft_scale(box, size, 2 if reduce else 16)
    arr = decode_scaled(img, scale, "GRAY" if img.mode == "L" else "RGB")
    return Image.fromarray(arr[:, :, 0] if img.mode == "L" else arr), _scaled_box(box, scale)


def draft_scale(box: tuple[int, int, int, int], size: tuple[int, int], smallest: int = 2) -> int:
    """The largest of 8, 4, 2 (at least ``smallest``; else 1) by which the crop ``box`` can shrink and still
    hold ``size`` = (H, W)."""
    cw, ch = box[2] - box[0], box[3] - box[1]
    return next((s for s in (8, 4, 2) if s >= smallest and cw >= s * size[1] and ch >= s * size[0]), 1)


def decode_crop_rgb(
    img: LazyImage, box: tuple[int, int, int, int], size: tuple[int, int], *, reduce: bool = True
) -> tuple[np.ndarray, tuple[float, float, float, float]]:
    """:func:`decode_crop` for an RGB model, as an (h, w, 3) uint8 array: a lazy JPEG is decoded by
    libjpeg-turbo through simplejpeg straight into the array (the same pixels as Pillow's decode -- same
    library, same default IDCT and upsampling -- without Pillow's copy out of its image memory).
    ``reduce=False`` decodes at full scale (the region then stays on whole pixels)."""
    if not isinstance(img, EncodedJpeg):
        img, region = decode_crop(img, box, size)
        return np.asarray(convert_image(img, "RGB")), region
    scale = draft_scale(box, size, 2 if reduce else 16)
    return decode_scaled(img, scale), _scaled_box(box, scale)


def _scaled_box(box: tuple[int, int, int, int], scale: int) -> tuple[float, float, float, float]:
    return box[0] / scale, box[1] / scale, box[2] / scale, box[3] / scale


def decode_scaled(jpeg: EncodedJpeg, scale: int, colorspace: str = "RGB") -> np.ndarray:
    """``jpeg`` decoded at 1/``scale`` (1, 2, 4 or 8: libjpeg's DCT scaling) by libjpeg-turbo through simplejpeg
    straight into an (ceil(height / scale), ceil(width / scale), channels) uint8 array, in ``colorspace``
    ("RGB" or "GRAY"). DataError naming it when it is corrupt or truncated, or decodes to another size."""
    import simplejpeg

    h, w = -(-jpeg.height // scale), -(-jpeg.width // scale)
    try:
        arr = simplejpeg.decode_jpeg(jpeg.data, colorspace, min_height=h, min_width=w, min_factor=scale, strict=True)
    except (OSError, ValueError) as e:
        raise DataError(f"{jpeg.name}: corrupt or truncated image ({e})") from None
    if arr.shape[:2] != (h, w):  # libjpeg scales by 1/s exactly; never silently
        raise DataError(f"{jpeg.name}: decoded to {arr.shape[1]}x{arr.shape[0]}, expected {w}x{h} (1/{scale} scale)")
    return arr


def load_image(path: str | os.PathLike[str]) -> Image.Image:
    """Decode an image file fully (so truncation is caught here), any mode, as a PIL image.

    Raises DataError naming the file when it is missing, empty, not an image, truncated, or declares more
    pixels than :func:`max_image_pixels` allows (checked from the header, before any pixel is decoded).
    """
    p = os.fspath(path)
    return decode_image(read_image_file(p), p)


class ImageTooLarge(DataError):
    """An image whose header declares more pixels than the decoder's limit (a decompression bomb), or whose
    preprocessing would ask for too much (a centre crop of a line of pixels: :meth:`Preprocess.crop_box`)."""


def decode_image(
    source: str | os.PathLike[str] | bytes,
    name: str,
    *,
    max_pixels: int | Literal["default"] | None = "default",
    draft: tuple[int, int] | None = None,
) -> Image.Image:
    """The one decoder of every command (datasets, shards, predict, analyze, serve): a file path or the encoded
    bytes -> a fully decoded PIL image (palette images as RGBA). ``name`` identifies it in errors.

    Anything Pillow rejects -- unknown format, truncation, a header declaring more than ``max_pixels`` pixels
    (default :func:`max_image_pixels`; checked before any pixel is decoded), a decoder failure on malformed
    bytes -- becomes one DataError naming the item (:class:`ImageTooLarge` for too many pixels), so
    ``skip_bad`` can count and drop it like any other bad file.

    ``draft`` = (width, height): a JPEG is decoded at the smallest of 1/8, 1/4, 1/2 scale that keeps at least that
    size (libjpeg's DCT scaling, Pillow's ``Image.draft``), for a thumbnail; other formats decode at full size.
    The pixel limit applies to the size the header declares either way.
    """
    if isinstance(source, bytes) and not source:
        raise DataError(f"{name}: empty image data (0 bytes)")
    data = source if isinstance(source, bytes) else _read_named(source, name)  # a regular file, at most the cap
    check_jpeg_scans(data, name)
    check_structure(data, name)
    limit = max_image_pixels() if max_pixels == "default" else max_pixels
    fp: Any = io.BytesIO(data)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the limit is enforced below
            with Image.open(fp, formats=IMAGE_FORMATS) as img:
                w, h = img.size
                _check_pixels(w, h, limit, name, img.mode)
                if w * h == 0:
                    raise DataError(f"{name}: image of {w}x{h} pixels has no pixels")
                if draft is not None:
                    img.draft(img.mode if img.mode in ("RGB", "L") else None, draft)  # JPEG only; else a no-op
                img.load()
                return img.copy() if img.mode != "P" else img.convert("RGBA")
    except DataError:
        raise
    except Image.DecompressionBombError as e:  # Pillow's own check in open(), at twice its limit
        raise ImageTooLarge(f"{name}: {e}") from None
    except UnidentifiedImageError:
        raise DataError(f"{name}: not a recognised image file") from None  # nor one of IMAGE_FORMATS
    except MemoryError:
        raise ImageTooLarge(f"{name}: too large to decode in memory") from None
    except Exception as e:
        raise DataError(f"{name}: corrupt or truncated image ({type(e).__name__}: {e})") from None


def _read_named(path: str | os.PathLike[str], name: str) -> bytes:
    """:func:`read_image_file` for :func:`decode_image`: errors name ``name`` (an upload's own name, not the
    server's cache path); an empty file is left to the decoder ("not a recognised image file")."""
    try:
        return read_image_file(path, empty_ok=True)
    except DataError as e:
        raise DataError(f"{name}: {str(e).removeprefix(os.fspath(path) + ': ')}") from None


def _check_pixels(width: int, height: int, limit: int | None, name: str | Callable[[], str], mode: str = "") -> None:
    """:class:`ImageTooLarge` naming the image when its header's ``width`` x ``height`` is over ``limit`` pixels
    (None: no limit), or when a 16- or 32-bit greyscale ``mode`` (:data:`MODE_PIXEL_WEIGHT`) is over its share of
    ``limit``: from its header, before any pixel memory is allocated."""
    weight = MODE_PIXEL_WEIGHT.get(mode, 1)
    if limit is not None and width * height > limit:
        raise ImageTooLarge(
            f"{_named(name)}: image of {width}x{height} = {width * height} pixels exceeds the limit of {limit} "
            "pixels (a decompression bomb or a corrupt header)"
        )
    if limit is not None and weight > 1 and width * height * weight > limit:
        raise ImageTooLarge(
            f"{_named(name)}: a {mode}-mode image of {width}x{height} pixels; such images count {weight} pixels per "
            f"pixel (their conversion to 8 bits takes {weight}x the memory), so at most {limit // weight} pixels"
        )


def _named(name: str | Callable[[], str]) -> str:
    return name if isinstance(name, str) else name()


def max_image_pixels() -> int | None:
    """Largest pixel count decoded: Pillow's ``Image.MAX_IMAGE_PIXELS`` (the ecosystem's knob; None = no
    limit). Pillow itself only warns between this and twice it; vitkit refuses everything above it."""
    limit = Image.MAX_IMAGE_PIXELS
    return None if limit is None else int(limit)


def convert_image(img: Image.Image, mode: str) -> Image.Image:
    """Any decoded image -> ``mode`` ("RGB" or "L"), the conversion every command uses.

    16-bit greyscale is rescaled to 8 bits (65535 -> 255), not clipped as Pillow's ``convert`` does (which
    would saturate nearly every pixel); 32-bit integer and float greyscale are scaled by their maximum.
    """
    if img.mode == mode:
        return img
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        arr = np.asarray(img, dtype=np.float64)
        peak = float(np.nanmax(arr)) if arr.size and not np.isnan(arr).all() else 1.0
        hi = 65535.0 if img.mode.startswith("I;16") else max(peak, 1.0)
        arr = np.nan_to_num(arr, nan=0.0)
        img = Image.fromarray(np.clip(arr / hi * 255.0 + 0.5, 0, 255).astype(np.uint8))
        if img.mode == mode:
            return img
    return img.convert(mode)
