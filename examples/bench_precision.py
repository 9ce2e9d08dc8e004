"""float32 against bfloat16 GRPO: seconds per step of each phase, measured on this machine's CPU.

The command line of :mod:`nemo_rl_spec.bench.precision` (the code lives in the package, where the tests reach
it; ``--help`` lists the options).
"""

import sys

from nemo_rl_spec.bench.precision import main

if __name__ == "__main__":
    sys.exit(main())
