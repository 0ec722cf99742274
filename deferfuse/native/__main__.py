"""``python -m deferfuse.native``: build the host kernels into the cache folder (make install)."""

import sys

from .hostkernels import main

sys.exit(main())
