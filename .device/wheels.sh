#!/usr/bin/env bash
# Fetch, here (with the package registry reachable), the wheels the device machine lacks: it has
# Python 3.12 with jax, flax, optax and orbax, no network. `.device/run` installs them from
# .device/wheels (git-ignored; name it in the device tool's `carry`). About 31 MiB.
set -euo pipefail
cd "$(dirname "$0")"
rm -rf wheels && mkdir -p wheels
python -m pip download --quiet --dest wheels --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any \
  "grain>=0.2.12" "ml_collections>=1.0" "tensorboardX>=2.6" "tqdm>=4.66" "matplotlib>=3.8" \
  "safetensors>=0.4" "absl-py>=2.0"
# the machine has these already (and the copies would not fit the 64 MiB that travels)
rm -f wheels/numpy-* wheels/protobuf-*
du -sh wheels
