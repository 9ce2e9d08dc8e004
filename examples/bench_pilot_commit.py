"""Rollouts to a target validation accuracy: uniform GRPO vs DAPO dynamic sampling vs Pilot-Commit, real loop.

The command line of :mod:`nemo_rl_spec.bench.pilot_commit` (the code lives in the package, where the tests reach
it; ``--help`` lists the options).
"""

import sys

from nemo_rl_spec.bench.pilot_commit import main

if __name__ == "__main__":
    sys.exit(main())
