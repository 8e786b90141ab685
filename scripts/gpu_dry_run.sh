#!/usr/bin/env bash
# scripts/gpu_check.sh --dry-run with the lent machine's situation rebuilt on CPU: an interpreter
# that sees only the distributions the lent image holds (scripts/lent_image_packages.txt, linked
# from this machine's python3 into a venv with no site packages of its own; triton, which the
# image has, from $DELTASERVE_DRY_TRITON, installed there once if absent), the wheels fetched for
# this python3 by the same scripts/fetch_gpu_wheels.sh (into .whl-cpu/), and then the same steps:
# pip --no-index --no-deps into a target folder, the deps check, the kernel tests in Triton's
# interpreter, the engine check, the benches. Nothing else reaches the network.
#
#   bash scripts/gpu_dry_run.sh                # fetch .whl-cpu/ if empty, then the whole dry run
#   bash scripts/gpu_dry_run.sh --setup-only   # the interpreter, the install and the deps check
#                                              # (no triton needed: nothing imports it before a kernel runs)
set -euo pipefail
cd "$(dirname "$0")/.."
wheels="${DELTASERVE_WHEELS:-.whl-cpu}"
image="$(mktemp -d)"
trap 'rm -rf "$image"' EXIT
triton_dir="${DELTASERVE_DRY_TRITON:-${TMPDIR:-/tmp}/deltaserve-dry-triton}"
pyver=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
compgen -G "$wheels/*.whl" >/dev/null || bash scripts/fetch_gpu_wheels.sh --python-version "$pyver" --dest "$wheels"

# the image's distributions, as this python3 has them, linked into one folder
python3 - "$image/site" <<'EOF'
import re, sys
from importlib.metadata import distributions
from pathlib import Path
out = Path(sys.argv[1]); out.mkdir()
norm = lambda n: re.sub(r"[-_.]+", "-", (n or "").lower())
image = {norm(l.strip()) for l in open("scripts/lent_image_packages.txt") if l.strip() and not l.startswith("#")}
found = set()
for dist in distributions():
    name = norm(dist.metadata["Name"])
    if name not in image or name in found or not dist.files:
        continue
    found.add(name)
    base = Path(dist.locate_file(""))
    for top in {f.parts[0] for f in dist.files if f.parts and f.parts[0] not in ("..", "__pycache__")}:
        if (base / top).exists() and not (out / top).exists():
            (out / top).symlink_to(base / top)
print(f"image-like site: {len(found)} of the image's {len(image)} distributions are on this machine")
EOF
if [[ " $* " != *" --setup-only "* ]] && ! PYTHONPATH="$triton_dir" python3 -c "import triton" 2>/dev/null \
  && [ ! -e "$image/site/triton" ]; then
  python3 -m pip install -q --target "$triton_dir" "triton>=3.0"  # the image's own triton, for the interpreter
fi
python3 -m venv --without-pip "$image/venv"
purelib=$("$image/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
printf '%s\n%s\n' "$image/site" "$triton_dir" >"$purelib/lent_image.pth"
"$image/venv/bin/python" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('fastapi') is None else 1)" \
  || { echo "the image-like interpreter sees fastapi: it must not"; exit 1; }
echo "image-like python: $("$image/venv/bin/python" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)')"
# the venv has no pip of its own (as the image has one): run pip from the linked site
PYTHON="$image/venv/bin/python" DELTASERVE_WHEELS="$wheels" bash scripts/gpu_check.sh --dry-run "$@"
