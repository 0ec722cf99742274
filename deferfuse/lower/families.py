"""Imports every op-family module so that its lowerings register."""

from . import (attention, creation, fastpath, fft, grouped_mm, histogram, linalg, movement, nn,  # noqa: F401
               nn_backward, pointwise, prims, reduction, rnn, special)
