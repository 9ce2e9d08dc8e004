"""Several seeds of the loop benchmark (``examples/bench_sync_vs_async.py`` outputs) in one table: per-seed ratios to
autoregressive, their mean and a bootstrap 90% interval.

The command line of :mod:`nemo_rl_spec.bench.loop_seeds` (the code lives in the package, where the tests reach it;
``--help`` lists the options).
"""

import sys

from nemo_rl_spec.bench.loop_seeds import main

if __name__ == "__main__":
    sys.exit(main())
