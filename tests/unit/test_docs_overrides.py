"""Every command line the docs show must work against the schema.

From README.md, CHANGELOG.md and docs/**/*.md, each inline code span and each line of a fenced block is one
"command". Its ``key=value`` / ``+key=value`` overrides are applied together with utils/config.py's loader and validated by the schema, on the
recipe the command names (``configs/*.yaml``) or, when it names none, on any shipped recipe (the command is fine
if one recipe accepts it: ``+key`` only applies where the key is new). A value that is a placeholder
(``<draft dir>``, ``a|b``, or empty before a wrapped line) is checked for its key only. Every ``configs/*.yaml``,
``examples/*.py`` and ``scripts/*.sh`` path shown must exist, and every recipe shown must load.
"""

import copy
import functools
import re
import shlex
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from nemo_rl_spec.utils.config import (
    ConfigError,
    apply_overrides,
    load_config,
    load_yaml_with_defaults,
    validate_config,
)

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
FIRST = ("grpo_math_tiny.yaml", "grpo_math_smollm2_135m.yaml")  # tried first: most commands target them
RECIPES = sorted((ROOT / "configs").glob("*.yaml"), key=lambda p: (p.name not in FIRST, p.name))
TOP_KEYS = "grpo|loss_fn|policy|data|env|logger|checkpointing|cluster"
_OVERRIDE = re.compile(rf"^\+?(?:{TOP_KEYS})\.[\w.]+=")
_CODE = re.compile(r"```[^\n]*\n(.*?)```|`([^`]+)`", re.S)
_PATH = re.compile(r"(?<![\w/.-])((?:configs|examples|scripts)/[\w./-]+\.(?:yaml|py|sh))")


def commands(text: str) -> list[str]:
    """The commands of a Markdown text, in order: each inline code span, and each line of a fenced block
    (``\\`` continuations joined)."""
    out = []
    for m in _CODE.finditer(text):
        out += re.sub(r"\\\n", " ", m.group(1)).splitlines() if m.group(1) is not None else [m.group(2)]
    return out


def _tokens(command: str) -> list[str]:
    """Shell words of a command, line by line (``\\`` continuations joined, ``#`` comments dropped);
    ``ARGS="a=1 b=2"`` / ``RECIPE=x`` contribute their value's words."""
    words = []
    for line in re.sub(r"\\\n", " ", command).splitlines():
        try:
            words += shlex.split(line, comments=True)
        except ValueError:  # an unbalanced quote in prose-like code: fall back to whitespace
            words += line.split()
    return [
        w
        for word in words
        for w in (shlex.split(word.split("=", 1)[1]) if word.startswith(("ARGS=", "RECIPE=")) else [word])
    ]


@functools.cache
def _raw(recipe: Path):
    return load_yaml_with_defaults(recipe)


def _is_placeholder(value: str) -> bool:
    return value == "" or "<" in value or re.search(r"\w\|\w", value) is not None


def _key_exists(key: str, merged: list) -> bool:
    """``key`` (or, for a ``+key``, its parent section) is present in some shipped recipe."""
    new = key.startswith("+")
    key = key.lstrip("+")
    probe = key.rsplit(".", 1)[0] if new else key
    return any(OmegaConf.select(c, probe, default="__missing__") != "__missing__" for c in merged)


def override_problems(command: str, merged: list) -> list[str]:
    """Why the overrides of one command do not validate ([] when they do, or when it has none)."""
    overrides = [t for t in _tokens(command) if _OVERRIDE.match(t)]
    if not overrides:
        return []
    concrete = [o for o in overrides if not _is_placeholder(o.split("=", 1)[1])]
    problems = [
        f"{o.split('=', 1)[0]}: no such key in any recipe"
        for o in overrides
        if o not in concrete and not _key_exists(o.split("=", 1)[0], merged)
    ]
    named = [ROOT / p for p in _PATH.findall(command) if p.startswith("configs/") and (ROOT / p).exists()]
    errors = []
    schema = "run_sim.py" not in command  # the simulator applies overrides to the raw YAML, unvalidated
    for recipe in named or RECIPES:
        try:
            cfg = apply_overrides(copy.deepcopy(_raw(recipe)), concrete)
            if schema:
                validate_config(OmegaConf.to_container(cfg, resolve=True), source=recipe.name)
            return problems
        except ConfigError as exc:
            errors.append(f"{recipe.name}: {str(exc).splitlines()[0]}")
    return problems + [
        f"{' '.join(concrete)} -> {errors[0] if named else 'rejected by every recipe, e.g. ' + errors[0]}"
    ]


@pytest.fixture(scope="module")
def merged():
    return [load_yaml_with_defaults(p) for p in RECIPES]


def _doc_commands():
    return [(doc.relative_to(ROOT).as_posix(), c) for doc in DOCS for c in commands(doc.read_text())]


def test_the_docs_show_overrides_and_recipes():
    """The extraction finds what the docs are known to show (so an empty extraction cannot pass)."""
    found = {t for _, c in _doc_commands() for t in _tokens(c) if _OVERRIDE.match(t)}
    assert {"grpo.max_num_steps=2", "grpo.pilot_commit.n_pilot=2", "policy.draft.online=true"} <= found
    assert len(found) >= 15


def test_every_override_in_the_docs_validates(merged):
    bad = [f"{doc}: `{c.strip()[:80]}`: {p}" for doc, c in _doc_commands() for p in override_problems(c, merged)]
    assert bad == []


def test_every_path_in_the_docs_exists_and_every_recipe_loads():
    paths = sorted({p for doc in DOCS for p in _PATH.findall(doc.read_text()) if "<" not in p})
    assert any(p.startswith("configs/") for p in paths) and any(p.startswith("examples/") for p in paths)
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert missing == []
    for p in paths:
        if p.startswith("configs/") and p.count("/") == 1:
            load_config(ROOT / p)


def test_the_checker_rejects_unknown_keys_in_commands(merged):
    """docs/guides/scale_out.md once showed these two keys; neither exists, so the checker must name both."""
    doc = (
        "`policy.megatron_cfg.mtp_coef_mode=occ` and "
        "`examples/run_grpo.py --config configs/grpo_math_tiny_spec.yaml policy.draft.train=true`"
    )
    problems = [p for c in commands(doc) for p in override_problems(c, merged)]
    assert len(problems) == 2
    assert "policy.megatron_cfg.mtp_coef_mode" in problems[0] and "policy.draft.train" in problems[1]
    assert (
        override_problems("+policy.megatron_cfg.mtp_num_layers=1 +policy.megatron_cfg.mtp_loss_mode=occ", merged) == []
    )


def test_the_docs_stand_alone():
    """A user's clone has no ../shared: the docs must not send readers there, and each Markdown file a doc names
    exists (relative to the doc, to the repository root or to docs/)."""
    text = "\n".join(doc.read_text() for doc in DOCS)
    assert [w for w in ("../shared", "DESIGN.md", "PAPERS.md") if w in text] == []
    missing = []
    for doc in DOCS:
        for name in set(re.findall(r"(?<![\w/.-])((?:\.\./|[\w-]+/)*[\w-]+\.md)\b", doc.read_text())):
            if not any((base / name).exists() for base in (doc.parent, ROOT, ROOT / "docs")):
                missing.append(f"{doc.relative_to(ROOT)}: {name}")
    assert missing == []
