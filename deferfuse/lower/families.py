"""Imports every op-family module so that its lowerings register."""

from . import pointwise  # noqa: F401
