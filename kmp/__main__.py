"""`python -m kmp doctor`: the same as the `kmp` console script."""

import sys

from kmp.cli import main

if __name__ == "__main__":
    sys.exit(main())
