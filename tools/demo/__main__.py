"""``python -m tools.demo``: the demo (the same as ``runlog demo``)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from runlog.cli._demo_cmd import add_arguments
from tools.demo import run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.demo", description=run.__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run.run(args)


if __name__ == "__main__":
    sys.exit(main())
