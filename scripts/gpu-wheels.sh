#!/usr/bin/env bash
# Download the light dependencies of the GPU pack as wheels for the GPU machine (CPython 3.12, x86-64 Linux),
# which has torch but no package registry. Run where pip can reach an index; the folder travels next to the
# repository copy (under 64 MiB in all). Usage: scripts/gpu-wheels.sh [DIR]   (default: wheels/)
# Then on the GPU machine: python3 scripts/gpu_pack.py --wheels DIR
# PYVER=3.11 makes a set for another CPython (a rehearsal on a machine without 3.12).
set -euo pipefail
pyver="${PYVER:-3.12}"
dir="${1:-$(cd "$(dirname "$0")/.." && pwd)/wheels}"
mkdir -p "$dir"
# asyncconn's own dependencies (not torch: the machine has it) and the test runner with its dependencies.
# numpy: the codec hands tensors' bytes over through it (torch does not depend on it).
packages=(
  numpy prometheus_client pyzmq "redis[hiredis]" redis hiredis uvloop xxhash
  pytest pluggy iniconfig packaging pygments typing_extensions pytest-asyncio pytest-timeout
)
python3 -m pip download --only-binary=:all: --no-deps --dest "$dir" \
  --python-version "$pyver" --implementation cp --abi "cp${pyver/./}" --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any "${packages[@]}"
total=$(du -cb "$dir"/*.whl | tail -1 | cut -f1)
echo "$(ls "$dir"/*.whl | wc -l) wheels, $((total / 1024 / 1024)) MiB in $dir"
if [ "$total" -gt $((64 * 1024 * 1024)) ]; then
  echo "over 64 MiB: too much to carry" >&2
  exit 1
fi
