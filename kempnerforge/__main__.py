"""`python -m kempnerforge` runs the same command as the `kempnerforge` script."""

import sys

from kempnerforge.cli import main

if __name__ == "__main__":
    sys.exit(main())
