#!/usr/bin/env bash
# Install (if needed) and run the whole test suite: ruff, shellcheck, pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
VENV=${VENV:-.venv}
"$VENV/bin/ruff" check .
mapfile -t shells < <(ls run_and_time.sh run.sub config_*.sh scripts/*.sh .ci/run 2>/dev/null)
"$VENV/bin/shellcheck" -s bash "${shells[@]}"
# Four pytest-xdist workers, a test module to each: much of the suite waits on subprocesses, sleeps and the local
# Slurm (with two workers the 2-core VM's cores were busy 43 % of the time), so from a cold start (fresh venv, empty
# inductor cache, as CI) it ran in 13 minutes instead of 23 (TEST_WORKERS=0: one process, as plain pytest).
# --no-loadscope-reorder: the workers take the modules in the order tests/conftest.py gives them.
exec "$VENV/bin/python" -m pytest -q -n "${TEST_WORKERS:-4}" --dist loadfile --no-loadscope-reorder "$@"
