"""The `coxswain` command line (`python -m services.cli`, the `coxswain` script): `main`
reads the arguments (`parser.py`) and runs the command they name (`engine.py`,
`patch_store.py`, `cluster.py`, `train.py`), a CoxswainError as one line on stderr.
"""

from __future__ import annotations

import sys

from services.cli.parser import build_parser
from services.common.errors import CoxswainError


def main(argv: list[str] | None = None) -> int:
    """Run the command `argv` (default: the process's arguments) names; its exit status."""
    parser = build_parser()
    # argparse.REMAINDER cannot take flags that come first (`pretrain --out DIR`), so a
    # command with its own parser gets what this one does not know.
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "passes_flags_on", False):
        args.rest = rest
    elif rest:
        args.command_parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.func(args)
    except CoxswainError as e:
        print(f"coxswain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("coxswain: interrupted", file=sys.stderr)
        return 130
