"""A decoding worker of ``vitkit serve`` (:mod:`vitkit.serve.decoding`, loaded by path: no torch) whose decoder
never finishes a 7x7 image -- a decoder bomb's cost, whatever the image checks refuse -- and decodes every other
image as the real one does. Run by the tests as the worker script (``decoding.CHILD_SCRIPT``)."""

import importlib.util
import time
from pathlib import Path

import vitkit  # the package only (no torch): where the real worker module is

spec = importlib.util.spec_from_file_location("decoding", Path(vitkit.__file__).parent / "serve" / "decoding.py")
assert spec is not None and spec.loader is not None
decoding = importlib.util.module_from_spec(spec)
spec.loader.exec_module(decoding)
real = decoding.decode_image


def hanging(data, name, **kwargs):  # type: ignore[no-untyped-def]
    img = real(data, name, **kwargs)
    if img.size == (7, 7):
        time.sleep(3600)
    return img


decoding.decode_image = hanging
decoding._child()
