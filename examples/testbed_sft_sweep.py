"""Held-out accuracy of a testbed build against SFT steps: how the testbed recipe (nemo_rl_spec/models/testbed.py)
was chosen.

The command line of :mod:`nemo_rl_spec.bench.testbed_sft_sweep` (the code lives in the package, where the tests reach
it; ``--help`` lists the options).
"""

from nemo_rl_spec.bench.testbed_sft_sweep import main

if __name__ == "__main__":
    raise SystemExit(main())
