"""User-facing errors.

Everything raised as :class:`VitkitError` is a problem with the user's input (a file, an option, a
checkpoint) rather than a bug; the CLI prints it as one line without a traceback.
"""

from __future__ import annotations


class VitkitError(Exception):
    """A problem with the user's input, reported as one line by the CLI."""


class CheckpointError(VitkitError):
    """A checkpoint that cannot be loaded: unknown layout, missing/unexpected keys, wrong shapes."""


class DataError(VitkitError):
    """A dataset or image that cannot be read: missing, corrupt, empty or inconsistent."""


class ConfigError(VitkitError):
    """An invalid model, training or CLI option."""
