#!/usr/bin/env bash
# The GPU check of issue 14, run on a machine with one NVIDIA GPU (docs/benchmarks.md,
# "GPU"): the CUDA tests, then benchmarks.run --device cuda on both graph families (the seed
# model end to end against DGL's GPU recipe, with the share of the host-to-device copy hidden
# behind compute), the dropout row, the trainer's feature cache on the GPU and the trainer
# with 2 torch threads, then a profile of the GPU trainer's step (about 9 minutes on an H200
# machine, most important first: a device
# check that runs out of time still brings back its first steps). Each step
# has its own time limit and the script goes on after a failed one; each step's JSON summary
# goes to OUT/<step>.json, the log to OUT/log.txt.
#
#   OUT=dir bash benchmarks/gpu_check.sh [wheel dir]
#   OUT=dir STEPS="tests main" TESTS="tests/test_models.py" bash benchmarks/gpu_check.sh [wheel dir]
#
# STEPS names the steps to run (default: all, in the order below); TESTS the test files of
# the first step (default: every file with CUDA tests).
#
# Where the project is not installed (a bare machine with torch and CUDA), the wheels in the
# given directory (pyzmq, dgl, ogb and theirs) are installed into /tmp/site first.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu-check}"
mkdir -p "$OUT"
LOG="$OUT/log.txt"
WHL="${1:-}"
export PYTHONUNBUFFERED=1 OUTDATED_IGNORE=1
PY="${PYTHON:-python3}"
t0=$(date +%s)
say() { echo "[gpu-check +$(( $(date +%s) - t0 ))s] $*" | tee -a "$LOG" >&2; }

if [ -n "$WHL" ]; then
  say "installing $(ls "$WHL" | tr '\n' ' ')"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHL"/*.whl >>"$LOG" 2>&1 || { say "wheel install failed"; exit 1; }
  export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$LOG" 2>&1
nproc >>"$LOG"
"$PY" -c "import torch, numpy; print('torch', torch.__version__, 'numpy', numpy.__version__, \
'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0))" >>"$LOG" 2>&1
"$PY" -m common.native >>"$LOG" 2>&1 || say "native kernels not built (numpy paths run)"
"$PY" -c "from common.dgl_compat import import_dgl; print('dgl', import_dgl().__version__)" \
  >>"$LOG" 2>&1 || say "dgl does not import"

step() {  # step NAME LIMIT_S COMMAND...: stdout (the JSON summary) to OUT/NAME.json
  local name=$1 limit=$2; shift 2
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return; fi
  say "step $name: $*"
  timeout -k 10 "$limit" "$@" >"$OUT/$name.json" 2>>"$LOG"
  say "step $name exit $?"
}

# 1. what CI cannot run: the tests that need a CUDA device
read -r -a TEST_FILES <<< "${TESTS:-tests/test_models.py tests/test_hetero_model.py \
tests/test_prefetch.py tests/test_worker_mode.py tests/test_feature_cache.py}"
step tests 200 "$PY" -m pytest -q -p no:cacheprovider "${TEST_FILES[@]}" \
  -k "cuda or pin_memory or threads_cover or default_synthetic"

COMMON=(--family products,rmat --train-frac 0.1 --epochs 2 --device cuda
        --skip dgl-sample,server,ddp,step,datapath,limits,wire,hetero,multilabel
        --worker-servers 4 --server-workers 3 --inflight 8)
WORKER_ONLY=(--skip dgl-train,dgl-sample,server,ddp,step,datapath,limits,wire,hetero,multilabel)
# 2. the headline on the GPU: seed model, DGL's GPU recipe (its default threads, its best) vs
#    worker mode (a GPU trainer's default: 1 torch thread). DGL_WORKERS=0,1,4 adds DataLoader
#    workers: 3-4x slower than 0 on an H200 machine in session 34
step main 240 "$PY" -m benchmarks.run "${COMMON[@]}" --dropout 0 \
  --dgl-workers "${DGL_WORKERS:-0}"
# 3. the dropout row
step dropout 200 "$PY" -m benchmarks.run "${COMMON[@]}" --dropout 0.5 \
  --dgl-workers "${DGL_WORKERS:-0}"
# 4. the trainer's feature cache in GPU memory (20% hottest nodes), worker mode only
step cache 120 "$PY" -m benchmarks.run "${COMMON[@]}" --dropout 0 "${WORKER_ONLY[@]}" \
  --cache-ratio 0.2
# 5. the trainer with 2 torch threads instead of the default 1 (session 35, one run each:
#    1 ahead on RMAT, even on products; 16 was 3-4x slower)
step threads2 120 "$PY" -m benchmarks.run "${COMMON[@]}" --dropout 0 "${WORKER_ONLY[@]}" \
  --num-threads 2
# 6. where a GPU trainer's step goes: worker mode on the RMAT graph the steps above made,
#    torch.profiler over 20 steps (--profile-steps; host operators and CUDA kernels), the
#    table in OUT/profile.txt; the summary's stages_s.loss_read_s says how long the host
#    waited for the device
RMAT_PARTS=$(ls -d data/bench/rmat1-*-1part 2>/dev/null | head -1)
if [ -n "$RMAT_PARTS" ]; then
  step profile 120 "$PY" -m deploy.worker_mode --parts "$RMAT_PARTS" --device cuda --epochs 1 \
    --fanouts 15,10,5 --batch-size 1024 --hidden 256 --dropout 0 --max-inflight 8 \
    --servers-per-part 4 --server-num-workers 3 --profile-steps 20 --checkpoint-every 0 \
    --work-dir "$OUT/profile-run" --no-progress
  find "$OUT/profile-run" -name profile.txt -exec cp {} "$OUT/profile.txt" \; 2>/dev/null
  rm -rf "$OUT/profile-run"
fi
say "done"
