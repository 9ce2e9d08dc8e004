"""Is speculative GRPO indistinguishable from autoregressive GRPO on a policy that learns?

The command line of :mod:`nemo_rl_spec.bench.spec_learning` (the code lives in the package, where the tests reach
it; ``--help`` lists the options).
"""

import sys

from nemo_rl_spec.bench.spec_learning import main

if __name__ == "__main__":
    sys.exit(main())
