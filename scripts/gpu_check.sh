#!/usr/bin/env bash
# The prepared device check (issues 20, 44), with the machine's own `python3` (the lent GPU
# machines: 3.12, torch 2.11, triton 3.6, no network) and no venv:
#   0. the wheels in .whl/ (scripts/fetch_gpu_wheels.sh, run where PyPI is reachable; the device
#      tool carries them: `carry: [".whl"]`) installed with pip --no-index --no-deps into a
#      target folder put on PYTHONPATH, then scripts/gpu_deps_check.py (every runtime dependency
#      at an admitted version, the gpu extra reported, the server/engine/Triton modules import);
#   1. the Triton kernel tests (tests/triton, marker `triton`) on CUDA, no interpreter;
#   2. the engine check (scripts/gpu_engine_check.py): Triton on CUDA against the reference on CPU,
#      tiny K3 and Kimi-Linear, fp32 tokens equal, bf16 within its stated KL / first-token
#      tolerance of the fp32 reference, prefix caching off and on;
#   3. `deltaserve bench latency --device cuda` on a `mini` K3 checkpoint;
#   4. the KDA prefill kernel bench (ours, ours with exports, fla-core) at T = 4k..32k beside the
#      HBM and tensor-core rooflines it measures;
#   5. the MLA attention bench (prefill: ours, torch's flash varlen, padded SDPA; extend over a
#      cached prefix: ours through the page table, gather + SDPA) at the same T.
# Meant to finish in a few minutes on one GPU (each step has a time limit, about 16 min in all:
# `--steps 1,2` then `--steps 3,4,5` splits it over two device calls of at most 10 minutes each).
# Logs go to $OUT (or a temp dir) as well as stdout; the exit status is 1 if any step failed.
#
#   bash scripts/gpu_check.sh            # on a machine with CUDA
#   bash scripts/gpu_check.sh --dry-run  # on CPU: the same steps, tiny, kernels in the interpreter
#   bash scripts/gpu_dry_run.sh          # that dry run with an interpreter that sees only what the
#                                        # lent image holds, and wheels fetched for it (.whl-cpu/)
#   ... --setup-only                     # step 0 alone
#   ... --steps 1,2                      # step 0 and these (a device call runs 10 minutes at most)
# Environment: PYTHON (default python3), DELTASERVE_WHEELS (default .whl), DELTASERVE_SITE (the
# install target, default a fresh temp folder).
set -euo pipefail
cd "$(dirname "$0")/.."
dry=0 setup_only=0 steps=1,2,3,4,5
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1; shift ;;
    --setup-only) setup_only=1; shift ;;
    --steps) steps=$2; shift 2 ;;
    *) echo "usage: $0 [--dry-run] [--setup-only] [--steps 1,2,...]" >&2; exit 2 ;;
  esac
done
want() { [[ ",$steps," == *",$1,"* ]]; }
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"
work="$(mktemp -d)"
py="${PYTHON:-python3}"
wheels="${DELTASERVE_WHEELS:-.whl}"
site="${DELTASERVE_SITE:-$work/site}"
export TIKTOKEN_CACHE_DIR="$work/tiktoken"
status=0

step() { echo; echo "=== $*"; }
run() {  # run a step under a time limit (seconds), log it, remember a failure, go on
  local name=$1 limit=$2; shift 2
  if timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"; then echo "--- $name: ok"
  else echo "--- $name: FAILED (or over ${limit}s)"; status=1; fi
}

step "0. environment: $py, wheels from $wheels"
if compgen -G "$wheels/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl \
    || { echo "--- install: FAILED"; exit 1; }
  echo "installed $(ls "$wheels"/*.whl | wc -l) wheels into $site"
else
  echo "no wheels in $wheels (bash scripts/fetch_gpu_wheels.sh where PyPI is reachable): using what $py has"
fi
export PYTHONPATH="$PWD/src:$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
if [ "$dry" = 1 ]; then
  export TRITON_INTERPRET=1 DEVICE=cpu
else
  DEVICE=cuda
  "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "no CUDA device: use --dry-run"; exit 2; }
fi
"$py" - <<'EOF' | tee "$out/environment.log"
import importlib.util, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "-")
for mod in ("triton", "fla", "flashinfer"):
    print(mod, "importable" if importlib.util.find_spec(mod) else "missing")
EOF
run deps 120 "$py" scripts/gpu_deps_check.py
if [ "$setup_only" = 1 ]; then
  rm -rf "$work"
  echo "gpu_check setup $([ "$status" = 0 ] && echo passed || echo FAILED)"
  exit "$status"
fi

if want 1; then
  step "1. Triton kernel tests on $DEVICE"
  if [ "$dry" = 1 ]; then
    run tests 300 "$py" -m pytest -p no:cacheprovider -q -m triton tests/triton/test_kda_kernels.py -k "offsets or slot_ids"
  else
    run tests 240 "$py" -m pytest -p no:cacheprovider -q -m triton tests/triton
  fi
fi

if want 2; then
  step "2. engine check, Triton on $DEVICE vs the fp32 reference on cpu"
  if [ "$dry" = 1 ]; then
    # fp32 only: in Triton's interpreter (bf16 stored as uint16) the bf16 run fails (KL 1.27 nats on
    # 2026-12-06, not traced to an op); bf16 is judged on a GPU, its verdict unit-tested on CPU
    # (tests/engine/test_gpu_check.py)
    run engine 300 "$py" scripts/gpu_engine_check.py --device cpu --families kimi_k3 --dtypes float32 --max-tokens 2
  else
    run engine 300 "$py" scripts/gpu_engine_check.py --device cuda
  fi
fi

if want 3; then
  step "3. bench latency"
  if [ "$dry" = 1 ]; then
    "$py" -m deltaserve.cli make-tiny --family kimi_k3 --preset tiny --out "$work/k3" >/dev/null
    run latency 120 env DELTASERVE_TRITON=0 "$py" -m deltaserve.cli bench latency --model "$work/k3" --device cpu \
      --dtype float32 --prompt-len 32 --output-len 4 --reps 1 --roofline-reps 1 --bandwidth-mib 16 --gemm-sizes 128
  else
    timeout 240 "$py" -m deltaserve.cli make-tiny --family kimi_k3 --preset mini --out "$work/k3-mini" >/dev/null \
      || { echo "--- make-tiny mini: FAILED"; status=1; }
    run latency 150 "$py" -m deltaserve.cli bench latency --model "$work/k3-mini" --device cuda --dtype bfloat16 \
      --prompt-len 4096 --output-len 64 --reps 2
  fi
fi

if want 4; then
  step "4. KDA prefill kernel bench"
  if [ "$dry" = 1 ]; then
    run kda_bench 120 "$py" scripts/kda_bench.py --device cpu --lengths 64,160 --heads 1 --head-dim 16 --reps 1 --export-every 32 \
      --bandwidth-mib 16 --gemm 256 --torch
  else
    run kda_bench 150 "$py" scripts/kda_bench.py --device cuda --lengths 4096,8192,16384,32768 --torch
  fi
fi

if want 5; then
  step "5. MLA attention bench"
  if [ "$dry" = 1 ]; then
    run mla_bench 120 "$py" scripts/mla_bench.py --device cpu --lengths 48 --heads 2 --nope 16 --rope 8 --v-dim 16 \
      --rank 32 --chunk 16 --reps 1 --bandwidth-mib 16 --gemm 256
  else
    run mla_bench 120 "$py" scripts/mla_bench.py --device cuda --lengths 4096,8192,16384,32768
  fi
fi

rm -rf "$work"
echo
echo "gpu_check $([ "$dry" = 1 ] && echo '(dry run) ')$([ "$status" = 0 ] && echo passed || echo FAILED); logs in $out"
exit "$status"
