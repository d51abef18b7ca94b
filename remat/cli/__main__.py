"""``python -m remat.cli``: the ``remat`` command."""

import sys

from remat.cli import main

sys.exit(main())
