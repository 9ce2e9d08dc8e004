"""Offline EAGLE-3 draft initialisation: ``python examples/init_draft.py --config RECIPE.yaml --out DIR``.

The command line of :mod:`nemo_rl_spec.cli.init_draft` (the code lives in the package, where the tests reach
it; ``--help`` lists the options).
"""

import sys

from nemo_rl_spec.cli.init_draft import main

if __name__ == "__main__":
    sys.exit(main())
