"""Imports every op-family module so that its lowerings register."""

from . import creation, fft, linalg, movement, nn, pointwise, prims, reduction, special  # noqa: F401
