"""``python -m app.batch ...``: the batch command on its own (``python -m app batch ...`` is the usual way)."""

import sys

from app.batch.cli import main

sys.exit(main())
