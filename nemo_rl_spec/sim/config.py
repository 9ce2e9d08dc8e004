"""Scenario YAML files (``configs/sim/*.yaml``): ``defaults:`` inheritance, deep merge, pydantic validation.

A file may start with ``defaults: other.yaml`` (path relative to the file); the parent is loaded first and the
file's own keys win, merged recursively (mappings merge, everything else replaces).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from nemo_rl_spec.sim.interfaces import ScenarioSpec

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "sim"


def deep_merge(base: dict, override: dict) -> dict:
    """``override`` merged into a copy of ``base``: nested mappings merge key by key, other values replace."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def load_raw(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The merged mapping of a scenario file and its ``defaults:`` chain. Raises ValueError on a cycle."""
    path = Path(path).resolve()
    if path in _seen:
        raise ValueError(f"defaults cycle: {' -> '.join(str(p) for p in (*_seen, path))}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: top level must be a mapping")
    parent = data.pop("defaults", None)
    if parent is None:
        return data
    return deep_merge(load_raw(path.parent / parent, (*_seen, path)), data)


def load_scenario(path: str | Path, **overrides: Any) -> ScenarioSpec:
    """A validated :class:`ScenarioSpec` from a YAML file, with top-level ``overrides`` merged in last."""
    return ScenarioSpec.model_validate(deep_merge(load_raw(path), overrides))


def scenario_files(config_dir: str | Path = CONFIG_DIR) -> list[Path]:
    """Every scenario YAML in ``config_dir`` (sorted)."""
    return sorted(Path(config_dir).glob("*.yaml"))
