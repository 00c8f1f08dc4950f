"""``python -m kvblocks.cli``: the same as the ``kvblocks`` console script."""

import sys

from kvblocks.cli import main

sys.exit(main())
