#!/usr/bin/env bash
# Install (if needed) and run the whole test suite: ruff, shellcheck, pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
VENV=${VENV:-.venv}
"$VENV/bin/ruff" check .
mapfile -t shells < <(ls run_and_time.sh run.sub config_*.sh scripts/*.sh .ci/run 2>/dev/null)
"$VENV/bin/shellcheck" -s bash "${shells[@]}"
# Two pytest-xdist workers, a test module to each: much of the suite waits on subprocesses and the local Slurm,
# so the 2-core VM runs it in about 10 minutes instead of 13 (TEST_WORKERS=0: one process, as plain pytest).
exec "$VENV/bin/python" -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
