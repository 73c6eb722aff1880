#!/usr/bin/env bash
# The GPU benchmark on the device machine (one H200, 16 cores, nvcc, CMake, ninja, Python 3.12,
# no network): from what `python -m bench.gpu.pack` put in .gpu-payload/, build llama.cpp with
# CUDA (libllama + ggml, llama-server) through vendor/build.sh, our binding against it, make a
# 1B random-weight model, and run bench.gpu.measure (every layer on the GPU, both servers).
#
#   bash bench/gpu/run.sh [bench.gpu.measure options...]      (from the repository root)
#
# Resumable: what it built or made lives in .gpu-work/ (git-ignored), which stays between calls
# while the machine is warm, so a call cut short by its time limit is continued by the next one.
# Results: bench/results/gpu.md and gpu.json, copied with the logs into $OUT. Environment:
# GPU_CMAKE_ARGS (default below), JOBS (16), GPU_SHAPE (1b), GPU_BUILD_ONLY=1 (stop after the
# build), GPU_BUILD_BUDGET (480: seconds the build may take in this call; past them it stops,
# exit status 3, and the next call continues it), PYTHON (python3), LLAMA_TRIO_CACHE
# (.gpu-work/cache), CMAKE_GENERATOR (Ninja).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PAY=$ROOT/.gpu-payload
WORK=$ROOT/.gpu-work
OUT=${OUT:-$WORK/out}
mkdir -p "$WORK" "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
# No web UI download (no network there; our base flags already build no UI).
# GPU_CMAKE_ARGS="" (set, empty) builds for the CPU: a trial of this script on a machine with no GPU.
export CMAKE_ARGS=${GPU_CMAKE_ARGS--DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_USE_PREBUILT_UI=OFF}
export CMAKE_GENERATOR=${CMAKE_GENERATOR:-Ninja} JOBS=${JOBS:-16} PYTHON=$PY
export LLAMA_TRIO_CACHE=${LLAMA_TRIO_CACHE:-$WORK/cache}
log() { echo "gpu: $(date +%T) $*" | tee -a "$OUT/gpu.log"; }
log "start: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi'), $(nproc) cores, $($PY --version)"

# 1. The pinned source where vendor/fetch.sh looks for it; its stamp says it is the pinned tree.
# shellcheck source=/dev/null
. vendor/llama.cpp.pin
if [[ "$(cat vendor/llama.cpp/.pin-sha256 2>/dev/null)" != "$SHA256" ]]; then
  rm -rf vendor/llama.cpp
  tar -xJf "$PAY/llama.cpp.tar.xz" -C vendor
  echo "$SHA256" >vendor/llama.cpp/.pin-sha256
  log "unpacked llama.cpp"
fi

# 2. Our Python dependencies, from the carried wheels.
if [[ ! -f $WORK/site/.complete ]]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" "$PAY"/wheels/*.whl
  # Their bytecode, and ours below, written ahead as `make` does: a start that compiles its
  # imports (where PYTHONDONTWRITEBYTECODE is set, every start) would be timed for it.
  "$PY" -m compileall -q -j0 "$WORK/site" >/dev/null || true
  touch "$WORK/site/.complete"
  log "installed $(ls "$PAY"/wheels/*.whl | wc -l) wheels"
fi
export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}

# 3. llama.cpp with CUDA and llama-server (seconds summed over the calls that built), then the
#    binding against that build (build_ffi.py finds it through vendor/build.sh, as `make` does).
bin=$(vendor/build.sh --print-bin-dir)
if [[ ! -x $bin/llama-server || ! -f $(vendor/build.sh --print-prefix)/.complete ]]; then
  log "building llama.cpp ($CMAKE_ARGS) with $JOBS jobs"
  started=$SECONDS
  status=0
  timeout "${GPU_BUILD_BUDGET:-480}" vendor/build.sh llama-server >>"$OUT/build.log" 2>&1 || status=$?
  echo $((SECONDS - started + $(cat "$WORK/build-seconds" 2>/dev/null || echo 0))) >"$WORK/build-seconds"
  if [[ $status -eq 124 ]]; then
    tail -n 5 "$OUT/build.log"
    log "build not finished after $(cat "$WORK/build-seconds") s in all; call again to continue it"
    exit 3
  elif [[ $status -ne 0 ]]; then
    tail -n 40 "$OUT/build.log"
    log "build failed ($status) after $(cat "$WORK/build-seconds") s"
    exit 1
  fi
fi
build_s=$(cat "$WORK/build-seconds" 2>/dev/null || echo "?")
log "llama.cpp built: $build_s s of build"
"$PY" build_ffi.py >>"$OUT/build.log" 2>&1 || { tail -n 40 "$OUT/build.log"; exit 1; }
"$PY" -m compileall -q ffi server bench
"$PY" -c "import ffi; print('binding devices:', [(d.name, d.description) for d in ffi.backend.devices()])" | tee -a "$OUT/gpu.log"
if [[ ${GPU_BUILD_ONLY:-0} == 1 ]]; then
  exit 0
fi

# 4. The model: random weights, the default model's tokenizer.
shape=${GPU_SHAPE:-1b}
model=$WORK/model-$shape.gguf
if [[ ! -f $model ]]; then
  "$PY" -m bench.random_model --shape "$shape" --tokenizer "$PAY/tokenizer.gguf" --out "$model.part" | tee -a "$OUT/gpu.log"
  mv "$model.part" "$model"
fi

# 5. The measurement.
"$PY" -m bench.gpu.measure --model "$model" --llama-server "$bin/llama-server" \
  --build-note "the build (libllama, ggml with CUDA, llama-server; -j$JOBS) took $build_s s" \
  --cmake-args "$CMAKE_ARGS" --out "$OUT" "$@" 2>&1 | tee -a "$OUT/gpu.log"
log "done"
