"""The configuration check on the command line (`bert.config` holds the sections and the parser).

    python -m bert.train.config --check-env   # validate the environment: "config OK" or one error line, exit 2
    python -m bert.train.config [--flag v]    # print the resolved configuration, section by section

`run_and_time.sh` runs the check before `STARTING TIMING RUN`, so a typo in any variable (a selector
such as BALANCE or ATTENTION included) stops the job before anything is logged.
"""

from __future__ import annotations

import json
import sys

from bert.config import ConfigError, from_env_and_args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    check = "--check-env" in argv
    try:
        cfg = from_env_and_args([a for a in argv if a != "--check-env"])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("config OK" if check else json.dumps(cfg.to_dict(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
