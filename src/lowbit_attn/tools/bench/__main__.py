"""``python -m lowbit_attn.tools.bench``: the same as ``lowbit-attn bench``."""

import sys

from lowbit_attn.tools.bench.command import main

sys.exit(main())
