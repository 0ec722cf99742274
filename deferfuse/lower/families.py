"""Imports every op-family module so that its lowerings register."""

from . import creation, linalg, movement, nn, pointwise, reduction  # noqa: F401
