"""``python -m ascend_fa`` is ``ascend-fa``."""

import sys

from ascend_fa.cli import main

sys.exit(main())
