#!/usr/bin/env bash
# gpu-check.sh: on a machine with an NVIDIA GPU, run the GPU day for real
# (`make gpu-check`): check the driver, the GPU's modes and the CUDA build
# of ONNX Runtime (`make setup-gpu`), start an MPS control daemon of its own
# unless one runs, serve the demo models on CUDA device 0 under every share
# policy (loadtest/scenarios/gpu-day-cuda.yaml) and print the same
# comparison table as the simulated GPU day. POLICY_RUNS=N repeats the day
# and prints the medians. Exit codes: 0 done, 2 no usable GPU here, 1 any
# other failure.
#
# Never run on a GPU: our machines have none. What runs here is its refusal
# (e2e TestGPUCheckScript, with stand-ins for nvidia-smi).
set -euo pipefail
# shellcheck source=scripts/lib.sh
. "$(dirname "$0")/lib.sh"

VERSION=1.30.0
GPU_LIB=${SLOSERVE_ONNXRUNTIME_GPU_LIBRARY:-$ROOT/deps/onnxruntime-gpu/libonnxruntime.so.$VERSION}
SLOSERVE=${SLOSERVE_BIN:-$ROOT/bin/sloserve}
OUT=${GPU_CHECK_OUT:-$ROOT/loadtest-results/gpu-day-cuda}
RUNS=${POLICY_RUNS:-1}
SCENARIO=$ROOT/loadtest/scenarios/gpu-day-cuda.yaml

nogpu() { echo "gpu-check: $*" >&2; exit 2; }

command -v nvidia-smi >/dev/null 2>&1 ||
  nogpu "no NVIDIA driver here (nvidia-smi not found); this check needs a machine with an NVIDIA GPU, see docs/gpu.md"
gpus=$(nvidia-smi --query-gpu=index,name,compute_mode,mig.mode.current --format=csv,noheader 2>&1) ||
  nogpu "nvidia-smi failed: $gpus"
[ -n "$gpus" ] || nogpu "nvidia-smi lists no GPU"
first=$(head -n 1 <<<"$gpus")
IFS=, read -r index name mode mig <<<"$first"
read -r mode <<<"$mode"
read -r mig <<<"$mig"
log "GPU $index:$name, compute mode $mode, MIG $mig ($(wc -l <<<"$gpus") GPU(s); the day uses GPU 0)"
case "$mode" in
  Prohibited | "Exclusive_Thread") nogpu "GPU 0 is in compute mode $mode, which refuses MPS clients; set Default or Exclusive_Process (nvidia-smi -c)" ;;
esac
[ "$mig" != Enabled ] || nogpu "GPU 0 is in MIG mode, where MPS shares are not what the day measures; disable MIG (nvidia-smi -mig 0)"

[ -f "$GPU_LIB" ] && [ -f "$(dirname "$GPU_LIB")/libonnxruntime_providers_cuda.so" ] ||
  die "no CUDA build of ONNX Runtime at $GPU_LIB: run make setup-gpu first"
[ -x "$SLOSERVE" ] || die "no $SLOSERVE: run make build first"

# An MPS control daemon: the one that runs, or one of our own, stopped at exit.
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}
if [ -p "$CUDA_MPS_PIPE_DIRECTORY/control" ]; then
  log "an MPS control daemon runs ($CUDA_MPS_PIPE_DIRECTORY)"
else
  need nvidia-cuda-mps-control
  export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-$(mktemp -d)}
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY"
  CUDA_VISIBLE_DEVICES=0 nvidia-cuda-mps-control -d || die "nvidia-cuda-mps-control -d failed (log: $CUDA_MPS_LOG_DIRECTORY)"
  trap 'echo quit | nvidia-cuda-mps-control || true' EXIT
  for _ in $(seq 50); do [ -p "$CUDA_MPS_PIPE_DIRECTORY/control" ] && break; sleep 0.1; done
  [ -p "$CUDA_MPS_PIPE_DIRECTORY/control" ] || die "the MPS control daemon did not open $CUDA_MPS_PIPE_DIRECTORY/control"
  log "started an MPS control daemon ($CUDA_MPS_PIPE_DIRECTORY, log $CUDA_MPS_LOG_DIRECTORY)"
fi

export SLOSERVE_ONNXRUNTIME_LIBRARY=$GPU_LIB
export SLOSERVE_CONTROL_PROFILE_CACHE_DIR=${SLOSERVE_CONTROL_PROFILE_CACHE_DIR:-$ROOT/.cache/profiles-cuda}
for i in $(seq 1 "$RUNS"); do
  "$SLOSERVE" loadtest --compare --out "$OUT-$i" "$SCENARIO"
done
if [ "$RUNS" -gt 1 ]; then
  "$ROOT/scripts/policy-medians.py" $(seq -f "$OUT-%g" 1 "$RUNS")
fi
