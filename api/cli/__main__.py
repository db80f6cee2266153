"""``python -m api.cli``: the ``kv-indexer`` command line."""

import sys

from api.cli import main

sys.exit(main())
