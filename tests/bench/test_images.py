"""The real-image set used for agreement checks."""

from __future__ import annotations

import torch

from vitkit.bench.sample_images import digit_images, real_image_batch, sample_photos
from vitkit.checkpoints.preprocess import Preprocess


def test_photos_crops_and_flips() -> None:
    photos = sample_photos()
    assert len(photos) == 24 and all(p.mode == "RGB" for p in photos)
    whole, mirrored = photos[0], photos[6]
    assert mirrored.size == whole.size
    assert mirrored.transpose(0).tobytes() == whole.tobytes()  # FLIP_LEFT_RIGHT undoes the mirror


def test_batch_is_preprocessed_real_content() -> None:
    x = real_image_batch(Preprocess(image_size=(32, 32)), digits=4)
    assert x.shape == (28, 3, 32, 32) and x.dtype == torch.float32
    assert x[:24].std() > 0.2  # photos, not blank
    assert len(digit_images(3)) == 3
