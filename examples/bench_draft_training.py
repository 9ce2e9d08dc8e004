"""The online EAGLE-3 draft's training step before / after its restriction to the scored tokens, at the default
speculative recipe's shapes (docs/results/draft_training_cost.md).

The command line of :mod:`nemo_rl_spec.bench.draft_training` (``--help`` lists the options).
"""

import sys

from nemo_rl_spec.bench.draft_training import main

if __name__ == "__main__":
    sys.exit(main())
