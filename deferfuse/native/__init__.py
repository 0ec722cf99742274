"""Native code deferfuse builds for itself: the host kernels (hostkernels.py, host_kernels.cc)."""
