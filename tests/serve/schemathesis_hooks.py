"""Schemathesis hooks for the fuzzing test (loaded through SCHEMATHESIS_HOOKS): what an image is.

The OpenAPI schema says a /predict body (raw, or the multipart part) is an ``image/*`` file; JSON Schema cannot say
more about binary content, so schemathesis would send arbitrary bytes as "valid" data, which the server rightly
refuses. Registered here, every image body is a real image: random pixels in any mode Pillow writes (RGB, RGBA,
palette, greyscale, 1-bit, 16-bit, CMYK, greyscale + alpha), sizes from 1x1 up, elongated ones included, in PNG,
JPEG, GIF (some animated), WebP, BMP and TIFF. All stay within the limits the test server runs with (1 MiB upload,
1 MP, the centre crop's 1000:1), so each is one the server must answer 200.
"""

from __future__ import annotations

import io

import numpy as np
import schemathesis
from hypothesis import strategies as st
from PIL import Image

MODES = ["RGB", "RGBA", "P", "L", "1", "I;16", "CMYK", "LA"]
FORMATS = ["PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF"]


@st.composite
def images(draw: st.DrawFn) -> bytes:
    small = st.integers(1, 64)
    width, height = draw(
        st.one_of(
            st.tuples(small, small),
            st.tuples(st.integers(65, 700), st.integers(65, 500)),
            st.tuples(st.integers(100, 900), st.integers(1, 3)),  # a line of pixels, under 1000:1
            st.tuples(st.integers(1, 3), st.integers(100, 900)),
        )
    )
    mode, fmt = draw(st.sampled_from(MODES)), draw(st.sampled_from(FORMATS))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rgb = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    img = rgb.convert("I;16") if mode == "I;16" else rgb.convert(mode)
    buf = io.BytesIO()
    frames = [rgb.convert("P").rotate(90 * i) for i in range(1, 3)] if fmt == "GIF" and draw(st.booleans()) else []
    try:
        img.save(buf, format=fmt, **({"save_all": True, "append_images": frames} if frames else {}))
    except (OSError, ValueError, KeyError):  # a mode this format cannot hold
        buf = io.BytesIO()
        rgb.save(buf, format=fmt)
    return buf.getvalue()


for media_type in ("image/*", "application/octet-stream"):
    schemathesis.openapi.media_type(media_type, images())
