"""Compare MTP co-training modes (detach, ce, policy, occ) on a GRPO recipe over several seeds.

The command line of :mod:`nemo_rl_spec.bench.occ` (the code lives in the package, where the tests reach
it; ``--help`` lists the options).
"""

import os
import sys

from nemo_rl_spec.bench.occ import main

if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
