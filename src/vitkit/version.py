"""The package version (a floor module: anything may import it)."""

__version__ = "0.1.0"
