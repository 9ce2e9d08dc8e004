"""Performance simulator of RL post-training steps with speculative rollouts (docs/guides/simulator.md).

Layers, bottom up: ``formulas`` (closed forms), ``model_math`` (params/bytes/FLOPs), ``roofline`` (one forward),
``lengths`` + ``batching`` + ``generation`` (continuous-batching engines), ``phases`` (log-probs, training,
refit), ``step`` + ``simulate`` (sync/async RL step, AR vs speculative), ``sweeps``, ``paper``, ``cpu_profile`` +
``calibrate`` (CPU profile and measured-run fitting), ``report``; specs in ``interfaces``, presets in ``presets``,
YAML scenarios (``configs/sim``) via ``config``. CLI: ``examples/run_sim.py``.
"""

from nemo_rl_spec.sim.config import load_scenario
from nemo_rl_spec.sim.simulate import simulate

__all__ = ["load_scenario", "simulate"]
