"""Checks, fixtures and small builders that the tests, the examples and the benchmarks share.

Nothing in the training runtime imports this package: it sits above ``algorithms`` in the layer contract
(pyproject.toml ``[tool.importlinter]``, docs/design/architecture.md). ``checks`` drives real vLLM engines (greedy and
speculative generation, refit scenarios), ``mtp_checks`` does the same for megatron-core MTP drafters, ``lossless``
holds the exact-distribution tools of the lossless-sampling tests.
"""
