"""``python -m ckptstream.cli``: the same as the ``ckptstream`` console script."""

import sys

from . import main

sys.exit(main())
