"""Trainer against engine log-probs under each sampling option (the command line of
:mod:`nemo_rl_spec.bench.sampling_agreement`; ``--help`` lists the options)."""

import sys

from nemo_rl_spec.bench.sampling_agreement import main

if __name__ == "__main__":
    sys.exit(main())
