#!/usr/bin/env bash
# The numerics-sensitive unit tests (marker `numerics`, docs/design/numerical_tolerances.md) again under the
# restricted kernel paths this machine can emulate, so a tolerance that holds on one CPU family's kernels only fails
# here first (CI runs on AMD EPYC with AVX512-BF16 and on Intel Xeon with AMX):
#   avx2:            ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 (torch's vector
#                    kernels, oneDNN and MKL's fp32 GEMMs without AVX-512 or AMX; every x86-64 machine of this kind)
#   avx512_core_bf16: ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 (only on a machine with AMX: oneDNN without its AMX kernels,
#                    i.e. the bf16 path of an AVX512-BF16 machine)
# Usage: scripts/test_numerics_isa.sh RESULTS_DIR [pytest args...]; JUnit XML per path in RESULTS_DIR/isa_<path>.xml.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: test_numerics_isa.sh RESULTS_DIR [pytest args...]}; shift
mkdir -p "$out"
paths=("avx2:ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2")
grep -qw amx_tile /proc/cpuinfo && paths+=("avx512_core_bf16:ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16")
for entry in "${paths[@]}"; do
  name=${entry%%:*}
  echo "[numerics] kernel path $name: ${entry#*:}"
  env ${entry#*:} .venv/bin/python -c "import torch; print('[numerics] torch cpu capability:', torch.backends.cpu.get_cpu_capability())"
  env ${entry#*:} .venv/bin/python -m pytest tests/unit -q -m numerics -p no:cacheprovider \
    --junitxml="$out/isa_$name.xml" -o junit_suite_name="numerics_$name" "$@"
done
