"""nemo_rl_spec: NeMo-RL-style RL post-training with speculative rollouts."""
