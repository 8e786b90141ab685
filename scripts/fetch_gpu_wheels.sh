#!/usr/bin/env bash
# Wheels for scripts/gpu_check.sh on a machine with no network (the lent GPU machines: python3 3.12,
# torch and triton already there; scripts/lent_image_packages.txt lists what their image holds).
# Run it where PyPI is reachable:
#
#   bash scripts/fetch_gpu_wheels.sh                        # cp312 manylinux x86_64 into .whl/
#   bash scripts/fetch_gpu_wheels.sh --python-version 3.11 --dest .whl-cpu   # for a CPU dry run here
#
# What it fetches: deltaserve's runtime dependencies and the `gpu` extra's fla-core, each with the
# dependencies pip resolves for them, less every distribution the image already holds (their
# versions are checked on the machine by scripts/gpu_deps_check.py). Two exceptions:
# - typing-extensions is kept (pydantic needs a newer one than the image may hold; a newer
#   typing-extensions serves the image's packages too);
# - FlashInfer is skipped: flashinfer-python 0.7.4's wheel alone is 97 MiB (and it needs
#   nvidia-cutlass-dsl, cuda-python, apache-tvm-ffi, ...), past the 64 MiB a device call carries.
#   triton is the image's (3.6.0).
# It fails where the wheels come to more than $DELTASERVE_WHEEL_LIMIT_MIB (default 56: the working
# tree travels with them, 64 MiB in all).
set -euo pipefail
cd "$(dirname "$0")/.."
pyver=3.12
dest=.whl
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) pyver=$2; shift 2 ;;
    --dest) dest=$2; shift 2 ;;
    *) echo "usage: $0 [--python-version X.Y] [--dest DIR]" >&2; exit 2 ;;
  esac
done
limit_mib="${DELTASERVE_WHEEL_LIMIT_MIB:-56}"
keep="typing-extensions"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# the requirements: pyproject's runtime dependencies and fla-core, less those the image holds
python3 - "$tmp/reqs.txt" <<'EOF'
import re, sys, tomllib
image = {re.sub(r"[-_.]+", "-", l.strip().lower()) for l in open("scripts/lent_image_packages.txt") if l.strip() and not l.startswith("#")}
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
wanted = project["dependencies"] + [r for r in project["optional-dependencies"]["gpu"] if r.startswith("fla-core")]
name = lambda r: re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower())
open(sys.argv[1], "w").write("\n".join(r for r in wanted if name(r) not in image) + "\n")
EOF
echo "requirements not on the image: $(tr '\n' ' ' <"$tmp/reqs.txt")"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --only-binary=:all: --python-version "$pyver" --implementation cp "${platforms[@]}" \
  -d "$tmp/all" -r "$tmp/reqs.txt"

mkdir -p "$dest"
rm -f "$dest"/*.whl
python3 - "$tmp/all" "$dest" "$keep" <<'EOF'
import re, shutil, sys
from pathlib import Path
src, dest, keep = Path(sys.argv[1]), Path(sys.argv[2]), set(sys.argv[3].split())
norm = lambda n: re.sub(r"[-_.]+", "-", n.lower())
image = {norm(l.strip()) for l in open("scripts/lent_image_packages.txt") if l.strip() and not l.startswith("#")}
for whl in sorted(src.glob("*.whl")):
    name = norm(whl.name.split("-")[0])
    if name in image and name not in keep:
        print(f"  on the image, left out: {whl.name}")
        continue
    shutil.copy(whl, dest / whl.name)
    print(f"  {whl.name} ({whl.stat().st_size / 2**20:.1f} MiB)")
EOF
total=$(du -cb "$dest"/*.whl | tail -1 | cut -f1)
echo "$(ls "$dest"/*.whl | wc -l) wheels, $((total / 1048576)) MiB in $dest (cp${pyver/./}); FlashInfer skipped (97 MiB wheel)"
if [ "$total" -gt $((limit_mib * 1048576)) ]; then
  echo "over ${limit_mib} MiB: too large to carry" >&2
  exit 1
fi
