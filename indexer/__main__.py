"""``python -m indexer``: the ``kv-indexer`` command line under another name (one
parser, in ``api/cli``; ``python -m indexer --help`` lists its commands).

The one import of ``api`` from ``indexer``, made when the command runs, never when the
library is imported (the layer contract in ``pyproject.toml`` names this exception).
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """The ``kv-indexer`` parser, under the name ``python -m indexer``."""
    from api.cli import main as cli_main

    return cli_main(argv, prog="python -m indexer")


if __name__ == "__main__":
    raise SystemExit(main())
