"""Data: image decoding and preprocessing, datasets, augmentation."""
