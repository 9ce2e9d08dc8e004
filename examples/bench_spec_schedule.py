"""A recipe's own speculative engine against autoregressive decoding: rollout phase and running-batch sweep.
``python examples/bench_spec_schedule.py --config RECIPE --out FILE.json [key=value ...]``;
see :mod:`nemo_rl_spec.bench.spec_schedule`.
"""

import sys

from nemo_rl_spec.bench.spec_schedule import main

if __name__ == "__main__":
    sys.exit(main())
