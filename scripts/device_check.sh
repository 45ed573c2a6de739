#!/usr/bin/env bash
# The device check's entry (scripts/device_check.py says what it runs): the repository and both plugins on
# PYTHONPATH, after whatever is there already (on the GPU machine: /tmp/site, the carried wheels).
#   bash scripts/device_check.sh --prepare [--megatron-lm-src DIR]   here: wheels, size check, the `run` call
#   bash scripts/device_check.sh                                      on the GPU machine: $OUT/device_check.json
#   bash scripts/device_check.sh --cpu --out FILE.json                anywhere: every part on CPU, in seconds
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:$PWD/plugins/torchtitan:$PWD/plugins/megatron${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" scripts/device_check.py "$@"
