"""Benchmarks and result tables behind the ``examples/bench_*.py`` command lines (and ``pc_ablation_table``,
``testbed_sft_sweep``): each module's ``main(argv)`` is the command, and its helpers (run schedules, summaries,
tables, plots) are what the unit tests check. Top layer of the import contract (docs/design/architecture.md): nothing in the
package imports it.
"""
