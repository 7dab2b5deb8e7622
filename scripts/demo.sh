#!/usr/bin/env bash
# README command 1, on a fresh machine: install everything, prepare the embedded Wikipedia corpus, train the
# CPU default (config_CPU_1x2.sh + run_and_time.sh), check the result log with the official compliance checker
# and logging/verify_result.py, plot it, and print where the log and the plot are.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export PATH="$PWD/${VENV:-.venv}/bin:$PATH"

# shellcheck source=config_CPU_1x2.sh
source config_CPU_1x2.sh
# manifest.json is written last: its presence means a complete dataset (a cut-short one resumes).
[ -f "$BERT_DATA/manifest.json" ] || python data/prepare.py --embedded --out "$BERT_DATA"
# The phase-1 checkpoint the config continues from: MiniLM's encoder with MLM/NSP heads fitted to it on this corpus
# (written atomically: its presence means complete).
phase1=$BERT_DATA/phase1/minilm_mlm.safetensors
[ "$INIT_CHECKPOINT" != "$phase1" ] || [ -f "$phase1" ] || python data/phase1_heads.py --data "$BERT_DATA"

results=$PWD/results/$DGXSYSTEM/bert
mkdir -p "$results"
i=0
until (set -o noclobber; : >"$results/result_$i.txt") 2>/dev/null; do i=$((i + 1)); done  # never overwrite
export MLPERF_LOG=$results/result_$i.txt
export OUTPUT_DIR=$PWD/results/$DGXSYSTEM/output/$i
./run_and_time.sh 2>&1 | tee "$results/demo_$i.log"

python -m mlperf_logging.compliance_checker --usage training --ruleset 5.0.0 \
  --log_output "$results/compliance_$i.log" "$MLPERF_LOG"
python logging/verify_result.py "$MLPERF_LOG" --target "$TARGET_MLM_ACCURACY" --eval-samples "$NUM_EVAL_EXAMPLES" \
  --eval-start "$EVAL_ITER_START_SAMPLES" --eval-every "$EVAL_ITER_SAMPLES"
python logging/plot_run.py "$MLPERF_LOG" --metrics "$OUTPUT_DIR/metrics.jsonl" --target "$TARGET_MLM_ACCURACY" \
  --out "${MLPERF_LOG%.txt}.png"
echo "result log: $MLPERF_LOG (passes the compliance checker 5.0.0 and verify_result.py)"
echo "plot:       ${MLPERF_LOG%.txt}.png"
