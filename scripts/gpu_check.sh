#!/usr/bin/env bash
# The prepared device check (issue 20): in its own venv (system site packages + the `gpu` extra),
#   1. the Triton kernel tests (tests/triton, marker `triton`) on CUDA, no interpreter;
#   2. engine greedy equality, Triton on CUDA vs the reference on CPU, tiny K3 and Kimi-Linear,
#      fp32 (must match) and bf16 (reported), prefix caching off and on;
#   3. `deltaserve bench latency --device cuda` on a `mini` K3 checkpoint;
#   4. the KDA prefill kernel bench (ours, ours with exports, fla-core) at T = 4k..32k beside the
#      HBM and tensor-core rooflines it measures;
#   5. the MLA attention bench (prefill: ours, torch's flash varlen, padded SDPA; extend over a
#      cached prefix: ours through the page table, gather + SDPA) at the same T.
# Meant to finish in a few minutes on one GPU (each step has a time limit, about 14 min in all).
# Logs go to $OUT (or a temp dir) as well as stdout; the exit status is 1 if any step failed.
#
#   bash scripts/gpu_check.sh            # on a machine with CUDA
#   bash scripts/gpu_check.sh --dry-run  # on CPU: the same steps, tiny, kernels in the interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
dry=0
[ "${1:-}" = "--dry-run" ] && dry=1
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"
work="$(mktemp -d)"
venv="${DELTASERVE_GPU_VENV:-${TMPDIR:-/tmp}/deltaserve-gpu-venv}"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TIKTOKEN_CACHE_DIR="$work/tiktoken"
status=0

step() { echo; echo "=== $*"; }
run() {  # run a step under a time limit (seconds), log it, remember a failure, go on
  local name=$1 limit=$2; shift 2
  if timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"; then echo "--- $name: ok"
  else echo "--- $name: FAILED (or over ${limit}s)"; status=1; fi
}

step "environment"
[ -x "$venv/bin/python" ] || python -m venv --system-site-packages "$venv"
py="$venv/bin/python"
if [ "$dry" = 1 ]; then
  export TRITON_INTERPRET=1 DEVICE=cpu
  "$py" -c "import triton" 2>/dev/null || "$py" -m pip install -q "triton>=3.0"  # never fla-core on CPU
else
  DEVICE=cuda
  "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "no CUDA device: use --dry-run"; exit 2; }
  if ! "$py" -c "import triton, fla.ops.kda, flashinfer" 2>/dev/null; then  # the gpu extra; wheels in .whl/ if any
    extra=$("$py" -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['gpu']))")
    links=(); [ -d .whl ] && links=(--find-links .whl)
    # shellcheck disable=SC2086
    "$py" -m pip install -q --retries 0 --timeout 10 "${links[@]}" $extra \
      || echo "warning: could not install the gpu extra ($extra); going on with what imports"
  fi
fi
"$py" - <<'EOF' | tee "$out/environment.log"
import importlib.util, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "-")
for mod in ("triton", "fla", "flashinfer"):
    print(mod, "importable" if importlib.util.find_spec(mod) else "missing")
EOF

step "1. Triton kernel tests on $DEVICE"
if [ "$dry" = 1 ]; then
  run tests 300 "$py" -m pytest -p no:cacheprovider -q -m triton tests/triton/test_kda_kernels.py -k "offsets or slot_ids"
else
  run tests 240 "$py" -m pytest -p no:cacheprovider -q -m triton tests/triton
fi

step "2. engine greedy equality, Triton on $DEVICE vs reference on cpu"
if [ "$dry" = 1 ]; then
  run engine 300 "$py" scripts/gpu_engine_check.py --device cpu --families kimi_k3 --dtypes float32 --max-tokens 3
else
  run engine 200 "$py" scripts/gpu_engine_check.py --device cuda
fi

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

step "4. KDA prefill kernel bench"
if [ "$dry" = 1 ]; then
  run kda_bench 120 "$py" scripts/kda_bench.py --device cpu --lengths 64,160 --heads 1 --head-dim 16 --reps 1 --export-every 32 \
    --bandwidth-mib 16 --gemm 256 --torch
else
  run kda_bench 150 "$py" scripts/kda_bench.py --device cuda --lengths 4096,8192,16384,32768 --torch
fi

step "5. MLA attention bench"
if [ "$dry" = 1 ]; then
  run mla_bench 120 "$py" scripts/mla_bench.py --device cpu --lengths 48 --heads 2 --nope 16 --rope 8 --v-dim 16 \
    --rank 32 --chunk 16 --reps 1 --bandwidth-mib 16 --gemm 256
else
  run mla_bench 120 "$py" scripts/mla_bench.py --device cuda --lengths 4096,8192,16384,32768
fi

rm -rf "$work"
echo
echo "gpu_check $([ "$dry" = 1 ] && echo '(dry run) ')$([ "$status" = 0 ] && echo passed || echo FAILED); logs in $out"
exit "$status"
