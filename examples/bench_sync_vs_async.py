"""Benchmark sync against async GRPO, autoregressive against speculative rollouts, on one recipe and seed.

The command line of :mod:`nemo_rl_spec.bench.sync_vs_async` (the code lives in the package, where the tests reach
it; ``--help`` lists the options).
"""

import sys

from nemo_rl_spec.bench.sync_vs_async import main

if __name__ == "__main__":
    sys.exit(main())
