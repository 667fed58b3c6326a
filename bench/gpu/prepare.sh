#!/usr/bin/env bash
# Download the pinned wheels the GPU machine lacks (bench/gpu/wheels.txt) into .whl/ at the repo
# root (ignored by git), for Python 3.12 on x86-64 Linux, and check every file's sha256. Needs
# PyPI; run it here, then name .whl in the device call's `carry`. Idempotent: a wheel already
# there with the right hash is kept.
#
#   bench/gpu/prepare.sh            # -> .whl/*.whl (about 46 MB)
#   WHL_DIR=/tmp/w bench/gpu/prepare.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
dest="${WHL_DIR:-$root/.whl}"
python="${PYTHON:-python3}"
mkdir -p "$dest"

# pip matches each manylinux tag exactly: 2_24 must be named or bitsandbytes falls back to an
# older wheel without CUDA 13
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)

want=()
while read -r spec file sha; do
  [[ -z "$spec" || "$spec" == \#* ]] && continue
  if [[ -f "$dest/$file" ]] && echo "$sha  $dest/$file" | sha256sum -c --status; then
    continue
  fi
  want+=("$spec")
done <"$here/wheels.txt"

if ((${#want[@]})); then
  args=()
  for p in "${platforms[@]}"; do args+=(--platform "$p"); done
  "$python" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${args[@]}" -d "$dest" "${want[@]}"
fi

status=0
while read -r spec file sha; do
  [[ -z "$spec" || "$spec" == \#* ]] && continue
  if [[ ! -f "$dest/$file" ]]; then
    echo "prepare.sh: $spec: pip saved no $file (another platform tag picked?)" >&2; status=1; continue
  fi
  if ! echo "$sha  $dest/$file" | sha256sum -c --status; then
    echo "prepare.sh: $file: sha256 differs from bench/gpu/wheels.txt (refused, removed)" >&2
    rm -f "$dest/$file"; status=1
  fi
done <"$here/wheels.txt"
# one version of each: a stray wheel (an older pin) would stop the install on the device
for f in "$dest"/*.whl; do
  grep -q " $(basename "$f") " "$here/wheels.txt" || { echo "prepare.sh: removing unpinned $(basename "$f")"; rm -f "$f"; }
done
((status == 0)) || exit "$status"
echo "prepare.sh: $(ls "$dest"/*.whl | wc -l) wheels, $(du -sh "$dest" | cut -f1), sha256 checked, in $dest"
