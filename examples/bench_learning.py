"""Does a recipe learn? Held-out validation accuracy before and after GRPO, over seeds, with an interval.

The command line of :mod:`nemo_rl_spec.bench.learning` (the code lives in the package, where the tests reach
it; ``--help`` lists the options).
"""

import sys

from nemo_rl_spec.bench.learning import main

if __name__ == "__main__":
    sys.exit(main())
