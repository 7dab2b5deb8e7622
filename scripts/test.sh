#!/usr/bin/env bash
# Install (if needed) and run the whole test suite: ruff, shellcheck, pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
VENV=${VENV:-.venv}
"$VENV/bin/ruff" check .
mapfile -t shells < <(ls run_and_time.sh run.sub config_*.sh scripts/*.sh .ci/run 2>/dev/null)
"$VENV/bin/shellcheck" -s bash "${shells[@]}"
exec "$VENV/bin/python" -m pytest -q "$@"
