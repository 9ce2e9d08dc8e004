"""Every boolean / optional key of the schema, set one at a time on the tiny recipe, either passes every check the
CLI makes before Ray starts, or is refused there with the key (or its section) named. Which of the two is
declared per key (ss.REFUSED_BEFORE_RAY): a key is never allowed either outcome.

The keys are enumerated from the pydantic models (tests/schema_sections.py), so a new key is covered without
editing this file. The path under test is the CLI's own: ``load_config`` -> ``check_runtime_support`` ->
``grpo_setup.preflight`` (draft/model/data files, MTP drafter, TP split, placement plan), whose ConfigError
``examples/run_grpo.py`` turns into exit status 2. The variants that pass are run for one real GRPO step in
tests/functional/test_schema_sections_run.py.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Literal, Optional

import pytest
from pydantic import BaseModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import schema_sections as ss  # noqa: E402

from nemo_rl_spec.utils.config import ConfigError  # noqa: E402

VARIANTS = ss.recipe_variants()
VARIANTS_BY_PATH = [(sw.path, o) for sw, o in VARIANTS]


@pytest.fixture(scope="module")
def cached_tokenizers():
    """AutoTokenizer.from_pretrained memoised (85% of a preflight is re-reading the same tokenizer files)."""
    from transformers import AutoTokenizer

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AutoTokenizer, "from_pretrained", functools.lru_cache(maxsize=None)(AutoTokenizer.from_pretrained))
        yield


@pytest.mark.parametrize("switch, overrides", VARIANTS, ids=[sw.path for sw, _ in VARIANTS])
def test_switch_passes_preflight_or_is_refused_as_the_table_says(switch, overrides, cached_tokenizers):
    """Each key has one expected outcome: refused with the fragment in ss.REFUSED_BEFORE_RAY (and the key or its
    section named), or, for every key not in that table (a new key included), passing the pre-Ray checks."""
    outcome, message = ss.pre_ray_outcome(overrides)
    fragment = ss.expected_refusal(switch.path)
    if fragment is None:
        assert (outcome, message) == ("ok", None), f"{overrides}: expected to pass (not in REFUSED_BEFORE_RAY)"
    else:
        assert outcome == "refused", f"{overrides}: expected refused with {fragment!r}, but it passes"
        assert fragment in message, f"{overrides}: refused, but not with {fragment!r}: {message}"
        assert ss.names_key(message, switch.path), f"{overrides}: refused without naming the key: {message}"


def test_the_refusal_table_names_only_schema_keys():
    """A table entry for a key that left the schema would silently expect nothing."""
    assert set(ss.REFUSED_BEFORE_RAY) <= {sw.path for sw, _ in VARIANTS}


def test_packing_conflicts_by_hand():
    """A section switch or an ``enabled`` flag conflicts with every key under its section; siblings do not."""
    sw = {s.path: s for s in ss.schema_switches()}
    assert ss.conflicts(sw["checkpointing.enabled"], sw["checkpointing.save_consolidated"])
    assert ss.conflicts(sw["grpo.dynamic_sampling.enabled"], sw["grpo.dynamic_sampling"])
    assert ss.conflicts(sw["policy.dynamic_batching"], sw["policy.dynamic_batching.enabled"])
    assert not ss.conflicts(sw["checkpointing.resume"], sw["checkpointing.save_consolidated"])
    assert not ss.conflicts(sw["grpo.val_at_start"], sw["grpo.normalize_rewards"])
    assert ss.conflicts(sw["loss_fn.token_level_loss"], sw["grpo.dynamic_sampling"])  # ss.HIDES: trains on nothing


def test_a_switch_that_acts_only_with_other_keys_is_turned_on_with_them():
    """ss.WITH: loss_fn.use_kl_in_reward is inert (refused) alone on the tiny recipe; its variant sets the KL
    coefficient and the estimator that reads it, and packing keeps it from the grpo estimator's options it hides."""
    sw = {s.path: s for s in ss.schema_switches()}
    overrides = dict(VARIANTS_BY_PATH)["loss_fn.use_kl_in_reward"]
    assert overrides == [
        "+loss_fn.use_kl_in_reward=true",
        "loss_fn.reference_policy_kl_penalty=0.01",
        "grpo.adv_estimator.name=reinforce_plus_plus",
    ]
    assert ss.pre_ray_outcome(overrides[:1])[0] == "refused"
    assert ss.conflicts(sw["loss_fn.use_kl_in_reward"], sw["grpo.normalize_rewards"])
    assert not ss.conflicts(sw["loss_fn.use_kl_in_reward"], sw["grpo.adv_estimator.minus_baseline"])
    assert ss.variant(sw["loss_fn.use_kl_in_reward"], {"loss_fn": {"use_kl_in_reward": True}}) == [
        "loss_fn.use_kl_in_reward=false"  # turned off: nothing to set with it
    ]


def test_packed_groups_greedy_by_hand():
    """With a fake pre-Ray outcome that refuses "b" with "c": a, b, d share group 1 (no conflicts), c opens group 2;
    refused-by-table keys are left out; a key refused alone is an error."""

    def fake(path):
        return ss.Switch(path, "bool", None, bool)

    def outcome(overrides):
        return ("refused", "x") if {"b=1", "c=1"} <= set(overrides) or overrides == ["e=1"] else ("ok", None)

    variants = [(fake(p), [f"{p}=1"]) for p in ("a", "b", "c", "d", "policy.draft.online")]
    got = [[s.path for s, _ in g] for g in ss.packed_groups(variants, outcome)]
    assert got == [["a", "b", "d"], ["c"]]
    with pytest.raises(AssertionError, match="e: .* is refused alone"):
        ss.packed_groups([(fake("e"), ["e=1"])], outcome)


def test_enumeration_walks_nested_and_optional_sections_by_hand():
    class Inner(BaseModel):
        on: bool = True
        size: Optional[int] = None
        count: int = 3
        mode: Optional[Literal["fast", "slow"]] = None

    class Outer(BaseModel):
        flag: bool
        name: str
        limit: Optional[float] = None
        inner: Optional[Inner] = None
        always: Inner = Inner()

    got = [(s.path, s.kind) for s in ss.schema_switches(Outer)]
    assert got == [
        ("flag", "bool"),
        ("limit", "optional"),
        ("inner", "section"),
        ("inner.on", "bool"),
        ("inner.size", "optional"),
        ("inner.mode", "optional"),
        ("always.on", "bool"),
        ("always.size", "optional"),
        ("always.mode", "optional"),
    ]
    sw = {s.path: s for s in ss.schema_switches(Outer)}
    raw = {"flag": True, "name": "x", "limit": 0.5}
    assert ss.variant(sw["flag"], raw) == ["flag=false"]
    assert ss.variant(sw["limit"], raw) == ["limit=null"]
    assert ss.variant(sw["inner"], raw) == ["+inner={}"]
    assert ss.variant(sw["inner.on"], raw) == ["+inner.on=false"]  # default True, flipped
    assert ss.variant(sw["inner.size"], raw) == ["+inner.size=2"]  # first candidate an int accepts
    assert ss.variant(sw["inner.mode"], raw) == ['+inner.mode="fast"']  # a Literal: its first value


def test_the_schema_enumeration_reaches_known_switches():
    paths = {sw.path for sw, _ in VARIANTS}
    for key in (
        "grpo.val_at_start",
        "grpo.async_grpo",
        "grpo.async_grpo.in_flight_weight_updates",
        "grpo.pilot_commit.bind_pilot_to_commit",
        "loss_fn.truncated_importance_sampling_ratio",
        "policy.draft.online",
        "policy.generation.dynamic_speculation",
        "logger.verbose",
        "checkpointing.metric_name",
        "cluster.ray_address",
    ):
        assert key in paths, key
    assert len(paths) == len(VARIANTS) >= 60


def test_names_key_accepts_the_key_or_its_section_only():
    assert ss.names_key("grpo.async_grpo.enabled=true trains on ...", "grpo.async_grpo.enabled")
    assert ss.names_key(
        "policy.megatron_cfg.scheduler: start_weight_decay=2.0 ...", "policy.megatron_cfg.scheduler.start_weight_decay"
    )
    assert not ss.names_key("grpo: rollout_budget_per_step=8 leaves no commit slot", "grpo.pilot_commit")
    assert not ss.names_key("invalid value", "logger.verbose")


def test_refusal_is_a_config_error_before_ray():
    """The outcome helper reports a refused key as the CLI would (a ConfigError, no Ray started)."""
    import ray

    outcome, message = ss.pre_ray_outcome(
        ["policy.sequence_packing.enabled=true", "policy.dynamic_batching.enabled=true"]
    )
    assert outcome == "refused" and "policy.sequence_packing.enabled=true" in message and not ray.is_initialized()
    with pytest.raises(ConfigError):
        ss.pre_ray_checks(["+grpo.pilot_commit={}"])


def test_ray_address_is_checked_before_ray_starts():
    """A cluster.ray_address nobody listens on is a ConfigError naming the key (ray.init would retry for minutes)."""
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for addr, why in ((f"127.0.0.1:{port}", "nothing answers"), ("head-node", "expected null, auto")):
        outcome, message = ss.pre_ray_outcome([f"cluster.ray_address={addr}"])
        assert outcome == "refused" and f"cluster.ray_address='{addr}'" in message and why in message
    with socket.socket() as srv:  # something listening: passes (Ray itself is not contacted here)
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        assert ss.pre_ray_outcome([f"cluster.ray_address=127.0.0.1:{srv.getsockname()[1]}"]) == ("ok", None)
