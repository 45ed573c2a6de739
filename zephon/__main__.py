"""``python -m zephon``: the same as the ``zephon`` command."""

import sys

from .cli import main

sys.exit(main())
