"""Append the `cache_clear` event to a result log, before the driver appends the rest of the run.

The launcher knows whether the page cache was dropped (run.sub does it on every node where permitted);
the compliance checker needs the event in every log whatever its value.

    python logging/log_cache_clear.py results/CPU_1x2/bert/result_0.txt --cleared false
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from mlperf_logging import mllog
from mlperf_logging.mllog import constants


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log", type=Path, help="result log to append to")
    p.add_argument("--cleared", choices=("true", "false"), required=True, help="whether the caches were dropped")
    args = p.parse_args(argv)
    # Our own append-mode logger: mllog's default one would also echo the line to stdout.
    logger = logging.getLogger("cache_clear")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(logging.FileHandler(args.log, mode="a"))
    mllog.config(logger=logger)
    mllog.get_mllogger().event(key=constants.CACHE_CLEAR, value=args.cleared == "true", stack_offset=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
