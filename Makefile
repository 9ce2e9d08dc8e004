# One-command entry points. Both install the CPU stack into .venv first (idempotent, ~3 min the first time).
PY := .venv/bin/python
RECIPE ?= configs/grpo_math_smollm2_135m.yaml

.PHONY: install run draft testbed test test-slow test-unit test-functional
install:
	bash scripts/install_cpu.sh

run: install
	$(PY) examples/run_grpo.py --config $(RECIPE) $(ARGS)

# Offline EAGLE-3 draft for RECIPE (in-domain prompts, policy samples; resumable: rerun after an interruption):
# make draft [RECIPE=...] [OUT=...] [ARGS=...]. DRAFT_ARGS: the setting measured for the default recipe
# (docs/speculative.md: 1,152 samples, 400 steps, ~25 min on 2 cores).
OUT ?= results/drafts/$(basename $(notdir $(RECIPE)))
DRAFT_ARGS ?= --num-prompts 320 --samples-per-prompt 4 --eval-prompts 32 --steps 400 --batch-size 16 --threads 2
draft: install
	$(PY) examples/init_draft.py --config $(RECIPE) --out $(OUT) $(DRAFT_ARGS) $(ARGS)

# The testbed policy (built-in testbed-llama: SFT on chain sums, ~6 min on 2 cores, cached): make testbed
testbed: install
	$(PY) -c "from nemo_rl_spec.models.hf_assets import resolve_model; print(resolve_model('testbed-llama'))"

test: install
	$(PY) -m pytest tests -x -q --durations=25 -m "not slow"

test-slow: install
	$(PY) -m pytest tests -q --durations=25 -m slow

test-unit: install
	$(PY) -m pytest tests/unit -q

test-functional: install
	$(PY) -m pytest tests/functional -x -q
