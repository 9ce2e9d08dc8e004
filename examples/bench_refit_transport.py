"""Benchmark the refit transports: Ray's object store against the collective broadcast (gloo on CPU).

The command line of :mod:`nemo_rl_spec.bench.refit_transport` (the code lives in the package, where the tests reach
it; ``--help`` lists the options).
"""

import sys

from nemo_rl_spec.bench.refit_transport import main

if __name__ == "__main__":
    sys.exit(main())
