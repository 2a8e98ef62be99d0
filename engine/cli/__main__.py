"""``python -m engine.cli`` runs the ``engine`` command (as ``python -m engine`` does)."""

import sys

from engine.cli import main

if __name__ == "__main__":
    sys.exit(main())
