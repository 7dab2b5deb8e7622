#!/usr/bin/env bash
# The Dockerfile built and used on a machine without a GPU or NVIDIA's registry.
#   bash scripts/docker_cpu.sh            # as root: base images (once), the image, a run in it, the checker on its log
# NGC's PyTorch image (the Dockerfile's BASE_IMAGE) cannot be pulled here. So a stand-in base is made from
# Debian's packages: debootstrap's Python 3.11, a CPU torch, and pip allowed to install into the system Python,
# as it is in NGC's image. The Dockerfile is built unchanged on it (--build-arg BASE_IMAGE). Then a two-rank
# closed-division run of the tiny BERT on synthetic data (`data/make_synthetic_dataset.py`) runs in the image
# through `run_and_time.sh`, and the official compliance checker (ruleset 5.0.0) judges the run's log.
# It shows that the image builds and trains. It does not show NGC's torch (2.10 in 25.12) or CUDA at work.
# Needs root, dockerd (Debian's docker.io; started here if it is not running) and debootstrap.
# Then $TESTS run in the image (pytest added to a throwaway container): by default the float8 tests, which need the
# torchao the image installs and the CPU venv leaves out (TESTS= skips them).
# Writes $OUT (results/docker_cpu): result_0.txt, the run's console, the checker's log, build.log, tests.txt and
# summary.json.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH=${TORCH:-2.13.0}  # the base's torch: pip resolves it (here, the CPU wheel on disk)
MIRROR=${MIRROR:-http://deb.debian.org/debian}
BASE=mlperf-bert-base:debian  # debootstrap's system, cached between calls
BASE_TORCH=mlperf-bert-base:cpu-torch-$TORCH
IMAGE=${IMAGE:-mlperf-bert:cpu}
OUT=${OUT:-results/docker_cpu}
TESTS=${TESTS-tests/test_fp8.py tests/test_fp8_delayed.py tests/test_fp8_transpose.py tests/test_meta_device.py}

fail() {
  echo "docker_cpu.sh: $*" >&2
  exit 1
}

[ "$(id -u)" = 0 ] || fail "needs root (debootstrap, dockerd)"
for tool in docker debootstrap; do
  command -v "$tool" >/dev/null || fail "$tool is missing: apt-get install docker.io debootstrap"
done
if ! docker info >/dev/null 2>&1; then
  command -v dockerd >/dev/null || fail "no Docker daemon answers, and there is no dockerd to start"
  (dockerd >/tmp/docker_cpu.dockerd.log 2>&1 &)
  for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && break
    sleep 1
  done
  docker info >/dev/null 2>&1 || fail "dockerd did not start (/tmp/docker_cpu.dockerd.log)"
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
seconds() { echo $(($(date +%s) - $1)); }

if ! docker image inspect "$BASE" >/dev/null 2>&1; then
  t=$(date +%s)
  debootstrap --variant=minbase --include=python3,python3-pip,ca-certificates bookworm "$work/root" "$MIRROR" \
    >"$work/debootstrap.log" 2>&1 || { tail -5 "$work/debootstrap.log" >&2; fail "debootstrap failed"; }
  rm -f "$work"/root/usr/lib/python3*/EXTERNALLY-MANAGED  # NGC's pip installs into its Python; so does this one's
  # this machine's CA bundle: a proxy that re-signs TLS (as here) is then trusted inside the image too
  cp /etc/ssl/certs/ca-certificates.crt "$work/root/etc/ssl/certs/ca-certificates.crt"
  tar -C "$work/root" -c . | docker import - "$BASE" >/dev/null
  rm -rf "$work/root"
  echo "base $BASE: $(seconds "$t") s"
fi
if ! docker image inspect "$BASE_TORCH" >/dev/null 2>&1; then
  t=$(date +%s)
  mkdir "$work/torch"
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$work/torch" "torch==$TORCH" 2>"$work/torch.log" \
    || { cat "$work/torch.log" >&2; fail "pip could not download torch==$TORCH"; }
  printf '%s\n' "FROM $BASE" "COPY *.whl /tmp/" \
    "RUN pip install --no-cache-dir /tmp/*.whl && rm /tmp/*.whl" >"$work/torch/Dockerfile"
  docker build -q -t "$BASE_TORCH" "$work/torch" >>"$work/torch.log" 2>&1 \
    || { tail -20 "$work/torch.log" >&2; fail "the torch layer did not build"; }
  echo "base $BASE_TORCH: $(seconds "$t") s"
fi

mkdir -p "$OUT"
rm -f "$OUT"/result_0.txt "$OUT"/cc.log "$OUT"/tests.txt
t=$(date +%s)
docker build --build-arg BASE_IMAGE="$BASE_TORCH" -t "$IMAGE" . >"$OUT/build.log" 2>&1 \
  || { tail -20 "$OUT/build.log" >&2; fail "the image did not build ($OUT/build.log)"; }
build_s=$(seconds "$t")

# In the image: the synthetic data, then the tiny BERT to 0.720 on 2 gloo ranks (test_train's settings).
cat >"$work/run.sh" <<'EOF'
set -euo pipefail
python3 data/make_synthetic_dataset.py --out /tmp/synthetic >/dev/null
source config_CPU_1x2.sh
export BERT_CONFIG=tiny INIT_CHECKPOINT= DATADIR_PHASE2=/tmp/synthetic/train_varlength \
  EVALDIR=/tmp/synthetic/eval_varlength BATCHSIZE=16 OPTIMIZER=lamb LR=0.01 WARMUP_STEPS=5 MAX_STEPS=300 \
  EVAL_ITER_START_SAMPLES=320 EVAL_ITER_SAMPLES=320 NUM_EVAL_EXAMPLES=256 EVAL_BATCHSIZE=128 ATTENTION=padded \
  TARGET_MLM_ACCURACY=0.72 MLPERF_DIVISION=closed SEED=7 OUTPUT_DIR=/tmp/out MLPERF_LOG=/results/result_0.txt
python3 -c 'import torch; print("torch", torch.__version__, "in", __import__("sys").version.split()[0])'
./run_and_time.sh
python3 -m mlperf_logging.compliance_checker --usage training --ruleset 5.0.0 --log_output /results/cc.log \
  /results/result_0.txt
EOF
t=$(date +%s)
status=0
docker run --rm --shm-size=1g -v "$PWD/$OUT:/results" -v "$work/run.sh:/run.sh:ro" "$IMAGE" bash /run.sh \
  >"$OUT/run.txt" 2>&1 || status=$?
run_s=$(seconds "$t")

tests="not run"
if [ -n "$TESTS" ]; then
  docker run --rm --shm-size=1g "$IMAGE" bash -c "pip install -q --no-cache-dir pytest pytest-xdist 2>/dev/null &&
    python3 -m pytest -q -n 2 -p no:cacheprovider $TESTS" >"$OUT/tests.txt" 2>&1 || status=$?
  tests=$(grep -E '^[0-9]+ (passed|failed)' "$OUT/tests.txt" | tail -1 | sed 's/ in [0-9.]*s.*//' || true)
fi

torch_line=$(grep -m1 '^torch ' "$OUT/run.txt" || true)
result=$(grep -m1 '^RESULT,bert,' "$OUT/run.txt" || true)
checker=$(grep -qx 'INFO - SUCCESS' "$OUT/cc.log" 2>/dev/null && echo SUCCESS || echo FAILED)
python3 - "$OUT/summary.json" "$build_s" "$run_s" "$status" "$torch_line" "$result" "$checker" "$tests" <<'EOF'
import json, sys
path, build_s, run_s, status, torch_line, result, checker, tests = sys.argv[1:]
summary = {"base": "Debian bookworm (debootstrap minbase) + " + torch_line, "build_s": int(build_s),
           "run_s": int(run_s), "exit_status": int(status), "result_line": result,
           "compliance_checker_5.0.0": checker, "tests_in_the_image": tests}
json.dump(summary, open(path, "w"), indent=1)
print("| " + " | ".join(summary) + " |\n|" + "---|" * len(summary) + "\n| " +
      " | ".join(str(v) for v in summary.values()) + " |")
EOF
[ "$status" = 0 ] && [ "$checker" = SUCCESS ] || fail "the run or the tests in the image failed (exit $status, checker $checker): $OUT/run.txt, $OUT/tests.txt"
