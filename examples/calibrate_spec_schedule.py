"""Calibrate the batch-size-aware speculation schedule for this machine, engine dtype and model:
``python examples/calibrate_spec_schedule.py --config configs/<recipe>.yaml [key=value ...]``.

The command line of :mod:`nemo_rl_spec.bench.spec_calibration` (``--help`` lists the options); it writes the entry
that ``policy.generation.dynamic_speculation.step_costs: auto`` finds
(docs/guides/speculation_schedule.md).
"""

import sys

from nemo_rl_spec.bench.spec_calibration import main

if __name__ == "__main__":
    sys.exit(main())
