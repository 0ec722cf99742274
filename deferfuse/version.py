"""The package version (a leaf: the disk cache keys executables by it)."""

__version__ = "0.1.0"
