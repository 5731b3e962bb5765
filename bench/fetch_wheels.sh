#!/usr/bin/env bash
# The wheels the GPU machine lacks (its Python has torch, torchvision, pytest, pyyaml, tqdm,
# scikit-learn and matplotlib, but not fire nor fire's termcolor), for bench/gpu_device.sh to carry.
# Pure-Python wheels: one download serves any Python 3 there.  Usage: bash bench/fetch_wheels.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
mkdir -p "$DIR"
python3 -m pip download -q --no-deps --only-binary=:all: -d "$DIR" "fire==0.7.1" "termcolor==3.3.0"
# .whl/ is in .gitignore: the wheels travel with carry, never with the tree
ls "$DIR"
