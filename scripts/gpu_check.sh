#!/usr/bin/env bash
# GPU check of the Megatron policy worker (examples/gpu_check.py): one command, under 5 minutes on the GPU.
#
#   bash scripts/gpu_check.sh prepare   # here (CPU, the project's .venv): tiny model + CPU reference + wheels in .gpu_check/
#   bash scripts/gpu_check.sh run       # on the GPU machine (torch + CUDA, no vLLM, no network)
#
# The GPU machine's image has torch, transformers and safetensors but not megatron-core, pydantic or omegaconf: `prepare`
# downloads their wheels (Python 3.12, manylinux x86_64) into .gpu_check/wheels and `run` installs them into /tmp/site
# without network. .gpu_check/ is git-ignored; carry it to the machine (device tool: carry [".gpu_check"]).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=.gpu_check
case "${1:-}" in
  prepare)
    mkdir -p "$DIR/wheels"
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$DIR/wheels" megatron-core==0.19.2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
      omegaconf==2.4.0 antlr4-python3-runtime==4.13.2
    .venv/bin/python examples/gpu_check.py prepare --dir "$DIR"
    du -sh "$DIR"
    ;;
  run)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$DIR"/wheels/*
    PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 timeout 300 python3 examples/gpu_check.py run --dir "$DIR"
    ;;
  *)
    echo "usage: bash scripts/gpu_check.sh prepare|run" >&2
    exit 2
    ;;
esac
