"""Command lines behind ``examples/run_grpo.py``, ``examples/init_draft.py`` and ``examples/run_sim.py``: each
module's ``main(argv)`` parses the arguments and returns the exit status. Top layer of the import contract
(docs/design/architecture.md): nothing in the package imports it.
"""
