"""Performance simulator of RL steps with speculative rollouts (nemo_rl_spec.sim).

The command line of :mod:`nemo_rl_spec.cli.run_sim` (the code lives in the package, where the tests reach
it; ``--help`` lists the options).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a bare checkout, as before

from nemo_rl_spec.cli.run_sim import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
