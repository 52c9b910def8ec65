"""`python -m services.cli`: what the `coxswain` script runs."""

import sys

from services.cli import main

if __name__ == "__main__":
    sys.exit(main())
