"""Imports every op-family module so that its lowerings register."""

from . import attention, creation, fft, histogram, linalg, movement, nn, nn_backward, pointwise, prims, reduction, special  # noqa: F401
