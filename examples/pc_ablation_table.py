"""Pilot-Commit ablation table: one row per ablation (and uniform GRPO), from the benchmark JSONs that
``examples/bench_pilot_commit.py`` wrote, one file per ablation (``docs/results/pilot_commit/ablations/<name>.json``).

The command line of :mod:`nemo_rl_spec.bench.pc_ablation_table` (the code lives in the package, where the tests reach
it; ``--help`` lists the options).
"""

import sys

from nemo_rl_spec.bench.pc_ablation_table import main

if __name__ == "__main__":
    sys.exit(main())
