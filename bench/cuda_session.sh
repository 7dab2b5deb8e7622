#!/usr/bin/env bash
# One device-tool call's worth of GPU work for issue 9: the steps named on the command line run in order, each
# under its own time limit, with its log (and JSON, where it writes one) under $WORK. After every step $WORK is
# packed into $OUT/cuda_session.tgz, so a call cut off at its limit still brings back every step that finished
# (the tool returns at most 8 files: one archive fits any number of steps).
#
#   bash bench/cuda_session.sh setup shards model driver-bf16 driver-autocast tests
#
# Steps (seconds each took on one H100: docs/journal.md, "On one H100"):
#   setup            install the carried wheels (.whl/: mlperf-logging, torchao), print the GPU and versions
#   shards           random-token shards with the phase-2 length mix (data/make_random_shards.py), SHARD_SAMPLES (200,000) samples:
#                    a driver step reads 150 x 96 = 14,400 of them, so a short call can make fewer
#   tests            the CUDA tests (item 8: every CUDA test passes on a GPU)
#   model            bench/model.py at batch 96: the eager variants (all eleven at once do not fit in 80 GB)
#   model-compiled   bench/model.py's compiled rows: compiled, compiled-static512, compiled-fp8 (inductor)
#   model-ours       bench/model.py's compiled rows of our kernels beside compiled/varlen: the rational GELU, the fused
#                    bias + GELU, the fused residual LayerNorm, our Triton attention (each swap alone, the model's step)
#   model-attention  bench/model.py at batch 96: flash varlen against our Triton attention and the last layer on
#                    every token
#                    (LAST_LAYER_SUBSET=0: the subset's gain) and grouped attention (one scatter per q, k, v since
#                    2026-11-25; 232 samples/s before), with each variant's kernels timed by kind; cuDNN's
#                    ragged attention needs torch >= 2.14 (bert.model.cudnn_varlen.MIN_TORCH), the machines have 2.11
#   attention-tiles  bench/attention_tiles.py: the Triton attention's candidate tiles a kernel at a time, beside
#                    FlashAttention-2, at one BERT-large layer's attention (96 sequences)
#   model-graphs     the same under reduce-overhead: do CUDA graphs pay on one fixed token count?
#   model-optimizer  bench/model.py's master-weight rows: fused AdamW, eager LAMB, compiled LAMB (COMPILE_OPTIMIZER=1
#                    over the fp32 masters, inductor, no CUDA graphs), the model eager in all three
#   host-syncs       bench/host_syncs.py on the GPU: host syncs per driver step, torch's sync debug mode beside
#                    the op count, for the bf16 and two fp16 cases (micro BERT, flash varlen)
#   fp8-linear       bench/fp8_linear.py: each encoder linear's forward + backward in bf16 and float8 (torchao
#                    tensorwise and rowwise, eager and compiled) beside its bare GEMMs: do the casts eat the gain?
#   driver-<name>    bench/train_gpu.py on config_DGXH100_1x8x96x1.sh with the settings in DRIVERS below
#                    (each under DRIVER_LIMIT seconds, default 420)
#
# DRY_RUN=1 prints each step's command instead of running it: tests/test_cuda_session.py checks on a CPU that
# every flag, variant name and driver setting below is accepted, before device time is spent on a typo.
#
# REHEARSE=1 runs the driver steps here, on the CPU, at REHEARSE_FLAGS (BERT tiny, 8 sequences, the CPU's
# attention) on small shards, under the first python3 on PATH: with the GPU machines' torch (the venv of
# `bash scripts/test_torch.sh 2.11.0`), a driver that fails to compile, or compiles again after run_start (the
# table's "compile after run_start"), shows up before device time is spent on it. CUDA-graph drivers run with
# COMPILE=default, rows of our Triton attention with its torch path; the other steps, torchao's float8 drivers and
# cuDNN's need the GPU: they are skipped. About 3 to 5 minutes a driver on the 2-core VM.
#   PATH=$PWD/.venv-torch2.11.0-py3.12/bin:$PATH REHEARSE=1 bash bench/cuda_session.sh shards driver-compiled-opt
set -u
REHEARSE=${REHEARSE:-0}
WORK=${WORK:-/tmp/cuda_session}
if [[ $REHEARSE == 1 ]]; then OUT=${OUT:-${WORK}_out} && mkdir -p "$OUT"; fi
OUT=${OUT:?the device tool sets OUT}
REHEARSE_FLAGS=${REHEARSE_FLAGS:---bert-config tiny --attention loop --batchsize 8}
# The device tool ends a call at its limit (600 s), and what the step running then had written never comes back: so a
# step's limit is cut to what the call has left (DEADLINE seconds from the start, less 15 to pack), and a step with
# under 30 s left is skipped. Set DEADLINE to the call's limit_s (budget_left_s for a last call). None in a rehearsal.
DEADLINE=${DEADLINE:-580}
SHARDS=${SHARDS:-/tmp/shards}
# Each compiled driver keeps what it compiled (COMPILE_CACHE, bert/train/compile_cache.py) in
# $CACHES/<GPU>/<row>.bin.gz, and the keys its graphs had in <row>.keys.json (bench/gpu_cache.py --diff compares them
# with the CPU's): from an empty cache BERT-large's graphs took 81 s and the compiled LAMB update 160 s on an H200,
# most of a driver step. The files written in a call come back as $OUT/compile_cache.tgz.part-NN (15 MiB
# parts: the tool returns no file over 16 MiB); unpacked into .compile_cache/ here and carried (carry [".whl",
# ".compile_cache/made_for.json", ".compile_cache/<GPU>"]: both cards' are over the 64 MiB a call carries), they let
# the next session's drivers skip code generation. bench/gpu_cache.py writes the same
# files on a CPU, for the code as it is now. Keyed by the GPU's name (CACHE_GPU overrides nvidia-smi's: gpu_cache.py's
# dry run), as torch keys them on the device anyway.
CACHES=${CACHES:-$PWD/.compile_cache}
if [[ $REHEARSE == 1 ]]; then CACHES=$WORK/compile_cache; fi  # the CPU's artifacts stay out of the carried ones
GPU=$(printf '%s\n' "${CACHE_GPU:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)}" |
  tr -c 'A-Za-z0-9\n' '_')
GPU=${GPU:-cpu}
CONFIG=${CONFIG:-config_DGXH100_1x8x96x1.sh}
mkdir -p "$WORK"
# pack_caches: what this call compiled. The device tool hands each call an empty $OUT, so a run that finds this
# script's archive there is the call's second (`bash ... a; bash ... b`): it keeps the first's start, and what both
# compiled comes back (its parts replace the first's). A rehearsal's $OUT is never emptied: each starts afresh.
if [[ $REHEARSE == 1 || ! -e $OUT/cuda_session.tgz || ! -e $WORK/.call_start ]]; then touch "$WORK/.call_start"; fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# a later call on the warm machine, without `setup`, still finds the wheels an earlier call's setup installed (one
# such call lost 50 s of device time to a missing mlperf-logging)
if [[ -d /tmp/site ]]; then export PYTHONPATH=$PYTHONPATH:/tmp/site; fi

# driver-<name>: bench/train_gpu.py flags on top of $CONFIG (bf16, MASTER_WEIGHTS=1, LAMB, 96 sequences, COMPILE=default,
# COMPILE_OPTIMIZER=1 since 2026-11-26: the eager rows say COMPILE=off)
declare -A DRIVERS=(
  [bf16]="--compile off --env COMPILE_OPTIMIZER=0"
  [autocast]="--compile off --env COMPILE_OPTIMIZER=0 --env MASTER_WEIGHTS=0"
  [compiled]="--compile default --env COMPILE_OPTIMIZER=0 --bench-repeats 0"
  [compiled-opt]="--compile default --env COMPILE_OPTIMIZER=1 --bench-repeats 0"
  # LAMB over flat buffers of whole rows (bert.optim.flat): a few passes over one buffer instead of foreach lists
  [compiled-flat]="--compile default --env COMPILE_OPTIMIZER=1 --env OPTIMIZER_LAYOUT=flat --bench-repeats 0"
  # each sublayer's bias + dropout + residual + LayerNorm our Triton kernel each way (bert.model.dropout_add_norm),
  # against compiled-opt: Philox per four elements, no fp32 x_hat, the mask as bits (2026-11-27, not yet run)
  [compiled-opt-norm]="--compile default --env COMPILE_OPTIMIZER=1 --env RESIDUAL_NORM=fused --bench-repeats 0"
  # GELU=rational (bert.model.gelu): erfc as a rational function of one exp2 in inductor's GELU kernels, a third
  # fewer instructions an element forward and 42 % backward on the fake H100 (bench/gelu_sass.py; 2026-12-02, not
  # yet run)
  [compiled-opt-gelu]="--compile default --env COMPILE_OPTIMIZER=1 --env GELU=rational --bench-repeats 0"
  # BIAS_GELU=fused (bert.model.bias_gelu): the FFN's bias + GELU our Triton kernel each way, its bias gradient
  # summed in the backward's pass (4.6 GB fewer a step by the fake H100's count; 2026-12-02, not yet run)
  [compiled-opt-biasgelu]="--compile default --env COMPILE_OPTIMIZER=1 --env BIAS_GELU=fused --bench-repeats 0"
  # our flash attention with dropout in Triton (bert.model.triton_attention) against compiled-opt's FlashAttention-2
  # (23.8 ms of the H100's step; 10-16 ms predicted by SASS, bench/attention_sass.py; 2026-11-27, not yet run)
  [compiled-opt-triton]="--compile default --attention triton --env COMPILE_OPTIMIZER=1 --bench-repeats 0"
  # both of our kernels' rows at once: the candidate fastest bf16 run if each gains on its own
  [compiled-opt-norm-triton]="--compile default --attention triton --env COMPILE_OPTIMIZER=1 --env RESIDUAL_NORM=fused --bench-repeats 0"
  # and BIAS_GELU=fused as well: every pass of ours at once
  [compiled-opt-norm-triton-biasgelu]="--compile default --attention triton --env COMPILE_OPTIMIZER=1 --env RESIDUAL_NORM=fused --env BIAS_GELU=fused --bench-repeats 0"
  # the same with each norm's backward from its output (RESIDUAL_NORM=fused-lean: no sum written)
  [compiled-opt-lean-norm-triton-biasgelu]="--compile default --attention triton --env COMPILE_OPTIMIZER=1 --env RESIDUAL_NORM=fused-lean --env BIAS_GELU=fused --bench-repeats 0"
  # the sharded masters (bert.optim.sharded_master) at world 1: that they run on NCCL, and what their eager update and
  # copies cost against the compiled unsharded one (at 8 GPUs each rank updates 1/8 of the rows)
  [compiled-sharded]="--compile default --env COMPILE_OPTIMIZER=0 --env OPTIMIZER_SHARDING=1 --env OPTIMIZER_LAYOUT=flat --bench-repeats 0"
  # the same with the reduce-scatters in 4 blocks started from the compiled backward (hooks after each accumulation)
  [compiled-sharded4]="--compile default --env COMPILE_OPTIMIZER=0 --env OPTIMIZER_SHARDING=1 --env OPTIMIZER_LAYOUT=flat --env OPTIMIZER_SHARD_BLOCKS=4 --bench-repeats 0"
  # the same through the two-dimensional plan (bert.dist.shard_plan; one node of one rank here): its two stages
  # chained on a stream of their own from the backward's hooks, on NCCL, which no CPU test reaches
  [compiled-sharded4-2d]="--compile default --env COMPILE_OPTIMIZER=0 --env OPTIMIZER_SHARDING=1 --env OPTIMIZER_LAYOUT=flat --env OPTIMIZER_SHARD_BLOCKS=4 --env OPTIMIZER_SHARD_PLAN=2d --bench-repeats 0"
  # each layer its own graph (shared by the 24 layers): compile time, and does per-layer fusion keep the speed?
  [compiled-layers]="--compile default --env COMPILE_SCOPE=layers --env COMPILE_OPTIMIZER=0 --bench-repeats 0"
  # inductor's coordinate-descent tuning of its own kernels' block sizes (LayerNorm, dropout, GELU: ~22 ms of the step)
  [compiled-cdt]="--compile default --env COMPILE_OPTIMIZER=1 --env TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 --bench-repeats 0"
  # reductions not split into partial sums: the bias gradients' sums then fuse into the kernels that make their
  # inputs (the fake H100: 62.0 GB and 315 launches a step instead of 66.8 and 489), if their fewer programs keep up
  [compiled-nosplit]="--compile default --env COMPILE_OPTIMIZER=1 --env TORCHINDUCTOR_SPLIT_REDUCTIONS=0 --bench-repeats 0"
  # the training batches read in a child process: a reading thread holds the interpreter lock the step's Python
  # launches need (bench/loader_gil.py: launches 2.2x slower beside it on the CPU)
  [compiled-proc]="--compile default --env COMPILE_OPTIMIZER=1 --env LOADER_WORKER=process --bench-repeats 0"
  # inductor's wrapper in C++: its ~1,000 kernel launches a step leave Python (launched from Python, they share
  # the GIL with the loader's thread; the H100's compiled step idled 7.3 of 135.5 ms)
  [compiled-cpp]="--compile default --env COMPILE_OPTIMIZER=1 --env TORCHINDUCTOR_CPP_WRAPPER=1 --bench-repeats 0"
  # the allocator maps growing segments instead of caching fixed blocks: the H100 held 63 GiB for a 28.9 GiB peak as
  # token counts change every step (the profile counts the allocator's calls to the driver and retries in the window)
  [compiled-expseg]="--compile default --env COMPILE_OPTIMIZER=1 --env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True --bench-repeats 0"
  # GEMMs autotuned against Triton templates, whose epilogues can take the bias and GELU (a long compile)
  [compiled-autotune]="--compile max-autotune-no-cudagraphs --env COMPILE_OPTIMIZER=1 --bench-repeats 0"
  # the candidate fastest bf16 run: graphs on the static buckets (all recorded in the warm-up), compiled LAMB
  [graphs-opt]="--compile reduce-overhead --static-tokens 512 --env COMPILE_OPTIMIZER=1 --bench-repeats 0"
  [graphs]="--compile reduce-overhead --static-tokens 512 --env COMPILE_OPTIMIZER=0 --bench-repeats 0"
  # two or three buckets to record instead of about nine, at 8 % more tokens (the padding in 9 sequences of <= 512)
  [graphs4k]="--compile reduce-overhead --static-tokens 4096 --env COMPILE_OPTIMIZER=1 --bench-repeats 0"
  # float8 GEMMs on bf16 weights with fp32 masters (the submissions' layout); fp8-autocast is the 483 samples/s
  # run of fp32 weights under bf16 autocast (MASTER_WEIGHTS=1 was refused with fp8 then)
  [fp8]="--precision fp8 --static-tokens 512 --compile default --bench-repeats 0 --window-steps 60"
  # ours: delayed scaling (the previous step's amax), no torchao, casts free to fuse into their producers; a
  # 60-step window so that the profile's kernel table comes back within the step's time
  [fp8-delayed]="--precision fp8 --static-tokens 512 --compile default --env FP8_RECIPE=delayed --bench-repeats 0 --window-steps 60"
  # and with BIAS_GELU=fused (bert.model.fp8_bias_gelu): the float8 FFN's GELU backward, its gradient's cast, amax and
  # bias sums one pass of ours instead of inductor's two (9.4 GB fewer a step on the fake H100; 2026-12-02, not yet
  # run), then with our attention as well, its QKV gradient stored in float8 by its kernels (bert.model.fp8_attention):
  # 81.8 GB against fp8-delayed's 105.0, the float8 candidate
  [fp8-delayed-biasgelu]="--precision fp8 --static-tokens 512 --compile default --env FP8_RECIPE=delayed --env BIAS_GELU=fused --bench-repeats 0 --window-steps 60"
  [fp8-delayed-triton-biasgelu]="--precision fp8 --static-tokens 512 --compile default --attention triton --env FP8_RECIPE=delayed --env BIAS_GELU=fused --bench-repeats 0 --window-steps 60"
  # RESIDUAL_NORM=fused under delayed float8 (bert.model.fp8_residual_norm): the dense output gradient's e5m2 cast in
  # the norm backward's pass; then all three of our passes under float8
  [fp8-delayed-norm]="--precision fp8 --static-tokens 512 --compile default --env FP8_RECIPE=delayed --env RESIDUAL_NORM=fused --bench-repeats 0 --window-steps 60"
  [fp8-delayed-norm-triton-biasgelu]="--precision fp8 --static-tokens 512 --compile default --attention triton --env FP8_RECIPE=delayed --env RESIDUAL_NORM=fused --env BIAS_GELU=fused --bench-repeats 0 --window-steps 60"
  # the same with each norm's backward from its output (RESIDUAL_NORM=fused-lean: no sum written, 2.4 GB fewer)
  [fp8-delayed-lean-norm-triton-biasgelu]="--precision fp8 --static-tokens 512 --compile default --attention triton --env FP8_RECIPE=delayed --env RESIDUAL_NORM=fused-lean --env BIAS_GELU=fused --bench-repeats 0 --window-steps 60"
  # and under CUDA graphs: the float8 step launches twice bf16's kernels (871 of inductor's and 292 of our ops' on the
  # fake H100, against bf16's 489 and 48) in less GPU time, and the per-layer float8 step was host-bound (83 % busy on an
  # H200); on the fake every graph is handed to the CUDA graph trees, none skipped (bench/gpu_compile.py,
  # fp8-delayed-lean-norm-triton-biasgelu-graphs-step)
  [fp8-delayed-lean-norm-triton-biasgelu-graphs]="--precision fp8 --static-tokens 512 --compile reduce-overhead --attention triton --env FP8_RECIPE=delayed --env RESIDUAL_NORM=fused-lean --env BIAS_GELU=fused --env COMPILE_OPTIMIZER=1 --bench-repeats 0 --window-steps 60"
  # COMBO_KERNELS=1: inductor's independent small kernels launched as one (the float8 scales, amax records, seeds:
  # 757 of the per-layer step's 873 launches move under 1 MB each; 344 launches with them combined, on the fake H100);
  # alone, under CUDA graphs, and the bf16 baseline with it (its compiled update's 539 launches a step: 97)
  [fp8-delayed-lean-norm-triton-biasgelu-combo]="--precision fp8 --static-tokens 512 --compile default --attention triton --env FP8_RECIPE=delayed --env RESIDUAL_NORM=fused-lean --env BIAS_GELU=fused --env COMBO_KERNELS=1 --bench-repeats 0 --window-steps 60"
  [fp8-delayed-lean-norm-triton-biasgelu-combo-graphs]="--precision fp8 --static-tokens 512 --compile reduce-overhead --attention triton --env FP8_RECIPE=delayed --env RESIDUAL_NORM=fused-lean --env BIAS_GELU=fused --env COMBO_KERNELS=1 --env COMPILE_OPTIMIZER=1 --bench-repeats 0 --window-steps 60"
  [compiled-opt-combo]="--compile default --env COMPILE_OPTIMIZER=1 --env COMBO_KERNELS=1 --bench-repeats 0"
  # the same per layer (COMPILE_SCOPE=layers: one graph shared by the 24 layers) and the update eager: the float8 model
  # compiled for 202 s as one graph on the H200, and the update 160 s, from cold; against driver-compiled-layers
  [fp8-delayed-layers]="--precision fp8 --static-tokens 512 --compile default --env FP8_RECIPE=delayed --env COMPILE_SCOPE=layers --env COMPILE_OPTIMIZER=0 --bench-repeats 0 --window-steps 60"
  # the candidate fastest: float8 per layer with the one-pass flat update compiled (7 kernels, 14.1 GB a step on the
  # fake H100: bench/gpu_compile.py), the layer's graph from fp8-delayed-layers' cache and the update's from
  # compiled-flat's when they ran before it
  [fp8-delayed-layers-flat]="--precision fp8 --static-tokens 512 --compile default --env FP8_RECIPE=delayed --env COMPILE_SCOPE=layers --env COMPILE_OPTIMIZER=1 --env OPTIMIZER_LAYOUT=flat --bench-repeats 0 --window-steps 60"
  [fp8-eager]="--precision fp8 --static-tokens 512 --compile off --env COMPILE_OPTIMIZER=0 --bench-repeats 0"
  # float8 only where fp8-linear finds it pays: the FFN (and QKV); the 1024 x 1024 attention output stays bf16
  [fp8-ffn]="--precision fp8 --static-tokens 512 --compile default --env FP8_LINEARS=ffn --bench-repeats 0"
  [fp8-ffn-qkv]="--precision fp8 --static-tokens 512 --compile default --env FP8_LINEARS=ffn-qkv --bench-repeats 0"
  # torchao's rowwise scaling (a scale per row, CUTLASS GEMMs), and with the weight-gradient GEMM kept in bf16
  [fp8-rowwise]="--precision fp8 --static-tokens 512 --compile default --env FP8_RECIPE=rowwise --bench-repeats 0"
  [fp8-rowwise-gw-hp]="--precision fp8 --static-tokens 512 --compile default --env FP8_RECIPE=rowwise-gw-hp --bench-repeats 0"
  [fp8-autocast]="--precision fp8 --static-tokens 512 --env MASTER_WEIGHTS=0 --compile default --env COMPILE_OPTIMIZER=0 --bench-repeats 0"
  [global-off]="--balance none --compile off --env COMPILE_OPTIMIZER=0"  # against driver-bf16 (eager)
  # cuDNN's ragged attention (Hopper kernels) on static shapes (its plans are cached per shape), compiled and eager;
  # refused (exit 2, seconds) on torch < 2.14, whose ragged backward is broken (bert.model.cudnn_varlen.MIN_TORCH)
  [cudnn]="--attention cudnn --static-tokens 512 --compile default --bench-repeats 0"
  [cudnn-eager]="--attention cudnn --static-tokens 512 --compile off --env COMPILE_OPTIMIZER=0 --bench-repeats 0"
  # the whole bf16 stack, now that cuDNN attention compiles into the graphs (a custom op): graphs, compiled LAMB
  [cudnn-graphs-opt]="--attention cudnn --compile reduce-overhead --static-tokens 512 --env COMPILE_OPTIMIZER=1 --bench-repeats 0"
)

# the profiler timelines (tens of MB) and any checkpoint (a driver stopped at its limit ends "pre-empted" and saves
# one: 4 GB of masters and LAMB state) stay behind: a file over 16 MiB would not come back. Written aside, then
# moved: a call cut off while packing keeps the previous archive whole.
pack() {
  tar -czf "$OUT/.cuda_session.tgz" --exclude="*.trace.json.gz" --exclude=checkpoints --exclude=compile_cache \
    --exclude=.cache_parts -C "$WORK" . &&
    mv "$OUT/.cuda_session.tgz" "$OUT/cuda_session.tgz"
  pack_caches
}

# The compile caches this call wrote (newer than its start), in 15 MiB parts, made in a folder of $OUT (a call cut
# off meanwhile brings back the previous parts whole) and then moved into place. The tool brings back 8 files and 64
# MiB in all: an archive over CACHE_LIMIT_MIB (45), or over what the session's archive leaves of 60 MiB, would come
# back cut, so it is said and left behind (name fewer compiled drivers in the call).
pack_caches() {
  [[ -d $CACHES ]] || return 0
  local files size limit parts=$OUT/.cache_parts
  # a driver stopped while saving leaves its temporary file (.<row>.bin.gz.tmp-PID): not a cache
  mapfile -t files < <(cd "$CACHES" && find . \( -name '*.bin' -o -name '*.bin.gz' -o -name '*.keys.json' \) ! -name '.*' \
    -newer "$WORK/.call_start")
  ((${#files[@]})) || return 0
  rm -rf "$parts" && mkdir -p "$parts" || return 0
  if ! tar -czf "$parts/all.tgz" -C "$CACHES" "${files[@]}"; then
    echo "== compile caches: packing failed; not brought back"
    rm -rf "$parts"
    return 0
  fi
  size=$(stat -c %s "$parts/all.tgz")
  limit=$((60 * 1048576 - $(stat -c %s "$OUT/cuda_session.tgz" 2>/dev/null || echo 0)))
  if ((limit > ${CACHE_LIMIT_MIB:-45} * 1048576)); then limit=$((${CACHE_LIMIT_MIB:-45} * 1048576)); fi
  if ((size > limit)); then
    echo "== compile caches: $((size >> 20)) MiB packed, over the $((limit >> 20)) MiB that can come back" \
      "(CACHE_LIMIT_MIB=${CACHE_LIMIT_MIB:-45}): not brought back (parts an earlier step packed stay)"
    rm -rf "$parts"
    return 0
  fi
  split -b 15m -d "$parts/all.tgz" "$parts/compile_cache.tgz.part-" && rm "$parts/all.tgz" &&
    rm -f "$OUT"/compile_cache.tgz.part-* && mv "$parts"/* "$OUT/" && rmdir "$parts"
}

# torchrun starts its workers in sessions of their own, so a step's timeout ends the launcher and not them: they
# would hold the GPU through the next steps. The machine runs nothing else of ours: whatever computes there goes.
reap() {
  command -v nvidia-smi >/dev/null || return 0  # not the GPU machine (a test of the deadline): nothing of ours to end
  local pids
  pids=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ' | tr '\n' ' ')
  if [[ -n ${pids// /} ]]; then
    echo "== reaping what still runs on the GPU: $pids"
    # shellcheck disable=SC2086  # pids are words
    kill -9 $pids 2>/dev/null
    sleep 3
  fi
  # and any driver worker the query did not list (a sandboxed GPU may not show our pids)
  pkill -9 -f run_pretraining.py 2>/dev/null && sleep 3
  return 0
}

step() {  # name limit_s command...: run it, keep its log, say how it ended
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  if [[ ${DRY_RUN:-0} == 1 ]]; then  # print the command, quoted, and run nothing (tests/test_cuda_session.py)
    printf 'DRY %s %s' "$name" "$limit"
    printf ' %q' "$@"
    echo
    return
  fi
  if [[ $REHEARSE != 1 ]]; then
    local left=$((DEADLINE - SECONDS - 15))
    if ((left < 30)); then
      skip "$name" "${left} s left before DEADLINE=${DEADLINE}"
      return 0
    fi
    if ((limit > left)); then limit=$left; fi
  fi
  echo "== $name (limit ${limit} s): $*"
  timeout -k 10 "$limit" "$@" >"$WORK/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc after $((SECONDS - start)) s"
  tail -n "${TAIL:-25}" "$WORK/$name.log"
  echo "$name exit=$rc seconds=$((SECONDS - start))" >>"$WORK/steps.txt"
  if [[ $rc == 124 || $rc == 137 ]] && [[ $REHEARSE != 1 ]]; then reap; fi
  pack
  return "$rc"
}

skip() {  # name why
  echo "== $1: skipped ($2)"
  if [[ ${DRY_RUN:-0} != 1 ]]; then echo "$1 skipped" >>"$WORK/steps.txt"; fi
}

# Every name checked before the first step: a typo found at its turn would come after device time spent on the rest.
STEPS=(setup shards tests tests-fp8 host-syncs model model-compiled model-ours model-attention attention-tiles model-graphs model-optimizer fp8-linear)
for name in "$@"; do
  if [[ $name == driver-* ]]; then
    [[ -v DRIVERS[${name#driver-}] ]] ||
      { echo "cuda_session.sh: no driver setting named ${name#driver-} (${!DRIVERS[*]})" >&2; exit 2; }
  elif [[ " ${STEPS[*]} " != *" $name "* ]]; then
    echo "cuda_session.sh: unknown step $name" >&2
    exit 2
  fi
done

for name in "$@"; do
  if [[ $REHEARSE == 1 && $name != shards && $name != driver-* ]]; then
    skip "$name" "REHEARSE=1 runs the shards and driver steps only"
    continue
  fi
  case $name in
    setup)
      # shellcheck disable=SC2016  # the inner bash expands them
      step setup 120 bash -c 'if compgen -G ".whl/*.whl" >/dev/null; then
          python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        fi
        nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv
        python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())"
        PYTHONPATH=$PYTHONPATH:/tmp/site python3 bench/gpu_cache.py --key
        PYTHONPATH=$PYTHONPATH:/tmp/site python3 -c "import mlperf_logging, torchao; print(\"torchao\", torchao.__version__)"' ||
        { echo "cuda_session.sh: setup failed (the .whl/ wheels carried?): the steps after it would fail or fall back" >&2
          exit 2; }
      export PYTHONPATH=$PYTHONPATH:/tmp/site ;;
    shards)
      if [[ $REHEARSE == 1 ]]; then
        step shards 300 python3 data/make_random_shards.py --out "$SHARDS" --samples 4000 --shards 4 --eval-samples 500
      else
        step shards 300 python3 data/make_random_shards.py --out "$SHARDS" --samples "${SHARD_SAMPLES:-200000}" --shards 16
      fi ;;
    tests)
      # xdist: a test that kills its process (a segfault in a CUDA graph) costs one worker, not the report
      step tests 300 python3 -m pytest -q -p no:cacheprovider -n 4 --tb=short -rfEs tests/test_attention.py tests/test_loader.py \
        tests/test_compile.py tests/test_fp8.py tests/test_fp8_delayed.py tests/test_fp8_transpose.py \
        tests/test_flash_varlen.py tests/test_optim_compiled.py tests/test_master_weights.py tests/test_flat_lamb.py \
        tests/test_bias_correction.py tests/test_dropout_add_norm.py tests/test_triton_attention.py tests/test_gelu.py \
        tests/test_bias_gelu.py tests/test_host_syncs.py tests/test_profile.py tests/test_cudnn_varlen.py tests/test_fusion.py \
        tests/test_resume.py::test_the_shared_state_is_loaded_onto_this_ranks_device \
        tests/test_grad_reduce.py::test_cuda_hierarchical_sum_chains_its_steps_on_streams_over_nccl \
        tests/test_ps.py::test_cuda_buckets_go_through_pinned_copies_and_come_back_summed ;;
    tests-fp8)
      # the float8 units' kernels on the GPU (their interpreter and sm_90 checks ran on the CPU): the CUDA tests only
      step tests-fp8 180 python3 -m pytest -q -p no:cacheprovider -n 4 --tb=short -rfEs -k cuda \
        tests/test_fp8_bias_gelu.py tests/test_fp8_residual_norm.py tests/test_fp8_attention.py \
        tests/test_fp8_feed_forward.py tests/test_fp8_attention_block.py tests/test_norm_from_output.py \
        tests/test_fp8_gemm.py ;;
    host-syncs)
      # the bf16 cases (the H100 configs' family); fp16: the check before plain LAMB, the skip over masters
      step host-syncs 240 python3 bench/host_syncs.py --device cuda --only " bf16 " "fp16 clip=after" \
        "fp16 master clip=after" --out "$WORK/host_syncs_cuda.json" ;;
    model)
      step model 300 python3 bench/model.py --device cuda --batch-size 96 --static-tokens 512 --precision fp8 \
        --variants padded unpadded/varlen unpadded/grouped static512/varlen master-bf16/varlen fp8/varlen \
        master-fp8/varlen hf \
        --json "$WORK/model_cuda.json" ;;
    model-compiled)
      step model-compiled 420 python3 bench/model.py --device cuda --batch-size 96 --static-tokens 512 \
        --precision fp8 --compile default --variants compiled/varlen compiled-static512/varlen compiled-fp8/varlen \
        compiled-master-fp8/varlen unpadded/varlen --json "$WORK/model_cuda_compiled.json" ;;
    model-ours)
      step model-ours 420 python3 bench/model.py --device cuda --batch-size 96 --compile default \
        --variants compiled/varlen compiled-rational-gelu/varlen compiled-bias-gelu/varlen compiled-fused-norm/varlen \
        compiled/triton --json "$WORK/model_cuda_ours.json" ;;
    model-attention)
      step model-attention 240 python3 bench/model.py --device cuda --batch-size 96 \
        --variants unpadded/varlen unpadded/triton full-last/varlen unpadded/grouped --profile \
        --json "$WORK/model_cuda_attention.json" ;;
    attention-tiles)
      step attention-tiles 180 python3 bench/attention_tiles.py --device cuda --json "$WORK/attention_tiles_cuda.json" ;;
    model-graphs)
      step model-graphs 420 python3 bench/model.py --device cuda --batch-size 96 --static-tokens 512 \
        --compile reduce-overhead --variants compiled/varlen compiled-static512/varlen unpadded/varlen \
        --json "$WORK/model_cuda_graphs.json" ;;
    model-optimizer)
      step model-optimizer 420 python3 bench/model.py --device cuda --batch-size 96 --compile default \
        --variants master-bf16/varlen master-bf16-lamb/varlen master-bf16-lamb-copt/varlen \
        --json "$WORK/model_cuda_optimizer.json" ;;
    fp8-linear)
      step fp8-linear 300 python3 bench/fp8_linear.py --device cuda --json "$WORK/fp8_linear_cuda.json" ;;
    driver-*)
      key=${name#driver-}
      flags=${DRIVERS[$key]} limit=${DRIVER_LIMIT:-420} device=cuda
      if [[ $REHEARSE == 1 ]]; then
        # FP8_RECIPE=delayed runs on the CPU (its GEMMs in fp32 there: bert/model/fp8_gemm.py); torchao's recipes
        # and cuDNN attention need the GPU
        if [[ ($flags == *"--precision fp8"* && $flags != *"FP8_RECIPE=delayed"*) || $flags == *"--attention cudnn"* ]]; then
          skip "$name" "torchao's float8 recipes and cuDNN attention need the GPU"
          continue
        fi
        rehearse=$REHEARSE_FLAGS
        # our Triton attention has a torch path on the CPU: its rows keep it, and with it the float8 attention sublayer
        if [[ $flags == *"--attention triton"* ]]; then rehearse=${rehearse//--attention loop/}; fi
        # CUDA graphs need the GPU: the rest of a graphs run (static shapes, the warm-up over buckets) compiles here
        flags="${flags//--compile reduce-overhead/--compile default} $rehearse" limit=${DRIVER_LIMIT:-900} device=cpu
      fi
      if [[ $flags != *"--compile off"* ]]; then flags+=" --env COMPILE_CACHE=$CACHES/$GPU/$key.bin.gz"; fi
      # shellcheck disable=SC2086  # the flags are words
      step "$name" "$limit" python3 bench/train_gpu.py --config "$CONFIG" --gpus 1 --data "$SHARDS" $flags \
        --json "$WORK/train_gpu_${device}_$key.json" --keep "$WORK/$name" ;;
    *)
      echo "cuda_session.sh: unknown step $name" >&2
      exit 2 ;;
  esac
done
if [[ -f $WORK/steps.txt ]]; then cat "$WORK/steps.txt"; fi
