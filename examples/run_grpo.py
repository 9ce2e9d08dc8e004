"""Run GRPO: ``python examples/run_grpo.py --config configs/<recipe>.yaml [key=value ...] [+new.key=value ...]``.

The command line of :mod:`nemo_rl_spec.cli.run_grpo` (the code lives in the package, where the tests reach
it; ``--help`` lists the options).
"""

import sys

from nemo_rl_spec.cli.run_grpo import main

if __name__ == "__main__":
    sys.exit(main())
