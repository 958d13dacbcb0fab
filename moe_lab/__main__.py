"""``python -m moe_lab COMMAND``: the ``moe-lab`` program."""

import sys

from moe_lab.cli import main

sys.exit(main())
