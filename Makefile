# One-command entry points. Both install the CPU stack into .venv first (idempotent, ~3 min the first time).
PY := .venv/bin/python
RECIPE ?= configs/grpo_math_smollm2_135m.yaml

.PHONY: install slurm run draft testbed test test-numerics test-slow test-unit test-functional test-slurm test-times lint
# EXTRAS: optional extras of pyproject.toml to add (make install EXTRAS=wandb,mlflow: the W&B / MLflow clients for
# logger.wandb_enabled / logger.mlflow_enabled); the test targets install both (their tests use them), `make run` none.
EXTRAS ?=
TEST_EXTRAS := wandb,mlflow
install:
	EXTRAS="$(EXTRAS)" bash scripts/install_cpu.sh

run: install
	$(PY) examples/run_grpo.py --config $(RECIPE) $(ARGS)

# Offline EAGLE-3 draft for RECIPE (in-domain prompts, policy samples; resumable: rerun after an interruption):
# make draft [RECIPE=...] [OUT=...] [ARGS=...]. DRAFT_ARGS: the setting measured for the default recipe
# (docs/results/draft_init.md: 1,152 training samples, 400 steps; about 13 min on 2 cores with the bf16 engine).
OUT ?= results/drafts/$(basename $(notdir $(RECIPE)))
DRAFT_ARGS ?= --num-prompts 320 --samples-per-prompt 4 --eval-prompts 32 --steps 400 --batch-size 16 --threads 2
draft: install
	$(PY) examples/init_draft.py --config $(RECIPE) --out $(OUT) $(DRAFT_ARGS) $(ARGS)

# The testbed policy (built-in testbed-llama: SFT on chain sums, ~6 min on 2 cores, cached): make testbed
testbed: install
	$(PY) -c "from nemo_rl_spec.models.hf_assets import resolve_model; print(resolve_model('testbed-llama'))"

# Tests (docs/guides/testing.md). Tiers: unit (tests/unit), functional (tests/functional), slurm (test_slurm.py's jobs on
# the local Slurm that `make slurm` starts), slow (explicit marker, not in CI). `make test` is the CI test phase:
# every tier but slow: first the numerics-marked unit tests under restricted kernel paths (test-numerics), then the
# unit tier, stopping at the first failure; it leaves the JUnit XML and per-phase
# durations in $(TEST_RESULTS) for `make test-times` (docs/results/ci_test_times/test_times.md) and .ci/run's summary.
TEST_RESULTS ?= results/test
# extra pytest arguments for the test targets, e.g. make test PYTEST_ARGS="-k grpo_loop"
PYTEST_ARGS ?=
# $(call pytest_recorded,DIR): pytest writing DIR/junit.xml and DIR/phases.json (tests/conftest.py) for the time table
pytest_recorded = mkdir -p $(1) && rm -f $(1)/junit.xml $(1)/phases.json && \
  TEST_PHASES_JSON=$(1)/phases.json $(PY) -m pytest --junitxml=$(1)/junit.xml

test test-numerics test-unit test-functional test-slurm test-slow: EXTRAS = $(TEST_EXTRAS)

test: install
	bash scripts/test_numerics_isa.sh $(TEST_RESULTS)
	$(call pytest_recorded,$(TEST_RESULTS)) tests/unit tests/functional -x -q -m "not slow" $(PYTEST_ARGS)

# the numerics-sensitive unit tests under restricted kernel paths (docs/guides/testing.md;
# docs/design/numerical_tolerances.md)
test-numerics: install
	bash scripts/test_numerics_isa.sh $(TEST_RESULTS) $(PYTEST_ARGS)

# ruff (lint and format check) and the import-layer contract (pyproject.toml; docs/design/architecture.md). The unit tier
# runs them too (tests/unit/test_lint.py, tests/unit/test_import_layers.py), so `make test` fails on a lint error,
# unformatted code or a wrong import.
lint: install
	.venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/lint-imports

test-unit: install
	$(PY) -m pytest tests/unit -x -q $(PYTEST_ARGS)

test-functional: install
	$(PY) -m pytest tests/functional -x -q -m "functional and not slow" $(PYTEST_ARGS)

# needs the daemons `make slurm` starts; fails (instead of skipping) when Slurm is not there
test-slurm: install
	REQUIRE_SLURM=1 $(PY) -m pytest tests/functional/test_slurm.py -x -q -m "slurm and not slow" $(PYTEST_ARGS)

# results in $(TEST_RESULTS)/slow (time table: make test-times TEST_RESULTS=results/test/slow)
test-slow: install
	$(call pytest_recorded,$(TEST_RESULTS)/slow) tests -q --durations=25 -m slow $(PYTEST_ARGS)

# Refresh docs/results/ci_test_times/test_times.md/.json from the last `make test` (run it first; the table is of the
# machine it ran on).
test-times:
	$(PY) scripts/test_times.py table --junit $(TEST_RESULTS)/junit.xml --phases $(TEST_RESULTS)/phases.json \
	  --out docs/results/ci_test_times/test_times --title "Per-test times of the CI test phase (make test)"

# Slurm for the slurm tier: apt-get install slurm-wlm + munge (first time, about 5 min) and start munged, slurmctld
# and two slurmd on this host. Needs root (sudo make slurm); idempotent. .ci/run runs it before `make test`.
slurm:
	bash scripts/start_local_slurm.sh
