"""Acceptance length of the MTP layers of finished OCC runs served as vLLM's ``mtp`` drafter (k = 1, 3).

The command line of :mod:`nemo_rl_spec.bench.mtp_acceptance` (the code lives in the package, where the tests reach
it; ``--help`` lists the options).
"""

import os
import sys

from nemo_rl_spec.bench.mtp_acceptance import main

if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
