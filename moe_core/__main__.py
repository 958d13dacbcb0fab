"""``python -m moe_core COMMAND``: the library's commands (`moe_core.cli`), with no orchestration import."""

import sys

from moe_core.cli import main

sys.exit(main())
