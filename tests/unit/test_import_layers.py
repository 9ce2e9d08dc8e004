"""The import layers of docs/design/architecture.md, checked three ways:

* ``lint-imports`` (import-linter) keeps pyproject.toml's layer contract on the package, and catches a deliberately
  wrong import (a function-local ``speculative -> models`` import, the shape of the cycle the contract replaced)
  in a scratch copy of the package;
* every function-local import of the package is a third-party module that is slow to import or optional, or one of
  two named package imports that pull such a module in, and carries a one-line reason comment;
* no module of the package or of ``examples/`` uses another module's private (``_name``) function or variable.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "nemo_rl_spec"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

# third-party top-level modules a function may import lazily (slow to import, optional, or absent on CPU)
LAZY_THIRD_PARTY = {
    "torch",
    "vllm",
    "transformers",
    "matplotlib",
    "wandb",
    "mlflow",
    "reasoning_gym",
    "math_verify",
    "pyarrow",
    "huggingface_hub",
    "tokenizers",
    "triton",
    "ray",
    "megatron",
    "scipy",
}
# package modules that import ray, megatron-core or vllm when imported: the only package imports a function may
# make lazily (the reason on the line)
LAZY_INTERNAL = {
    f"nemo_rl_spec.{m}"
    for m in (
        "algorithms.async_grpo",
        "algorithms.grpo",
        "algorithms.grpo_setup",
        "algorithms.refit",
        "distributed.virtual_cluster",
        "distributed.worker_group",
        "models.generation.vllm_generation",
        "models.generation.vllm_worker_extension",
        "models.policy.lm_policy",
        "models.policy.megatron_model",
        "models.policy.megatron_worker",
        "testing.mtp_checks",
    )
}


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} missing: import-linter is in the test extra of pyproject.toml (make install)")
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def _function_local_imports(tree: ast.AST):
    """(import node) for every import statement inside a function body (at any depth)."""

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            yield from visit(child, inside)

    yield from visit(tree, False)


def test_layer_contract_is_kept():
    res = _lint_imports(ROOT)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "nemo_rl_spec layers run one way KEPT" in out and "0 broken" in out, out


def test_a_wrong_import_breaks_the_contract(tmp_path):
    shutil.copytree(PACKAGE, tmp_path / "nemo_rl_spec", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    clean = _lint_imports(tmp_path)
    assert clean.returncode == 0, clean.stdout + clean.stderr  # the copy alone keeps the contract
    # speculative sits below models: a lazy import upwards, as the old function-local imports did
    (tmp_path / "nemo_rl_spec" / "speculative" / "scratch_wrong.py").write_text(
        '"""Scratch module: an import the layer contract forbids."""\n\n\n'
        "def policy_class():\n"
        '    """Imports upwards, inside a function."""\n'
        "    from nemo_rl_spec.models.policy.lm_policy import Policy\n\n"
        "    return Policy\n"
    )
    broken = _lint_imports(tmp_path)
    out = broken.stdout + broken.stderr
    assert broken.returncode != 0, out
    assert "nemo_rl_spec layers run one way BROKEN" in out, out
    assert "nemo_rl_spec.speculative.scratch_wrong -> nemo_rl_spec.models.policy.lm_policy" in out, out


def test_function_local_imports_are_lazy_heavy_dependencies_with_a_reason():
    stdlib = set(sys.stdlib_module_names)
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        lines = source.splitlines()
        for node in _function_local_imports(ast.parse(source)):
            target = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            top = (target or "").split(".")[0]
            where = f"{path.relative_to(ROOT)}:{node.lineno} ({target})"
            if getattr(node, "level", 0) or top in stdlib or top not in LAZY_THIRD_PARTY | {"nemo_rl_spec"}:
                bad.append(f"{where}: import it at the top of the module")
            elif top == "nemo_rl_spec" and target not in LAZY_INTERNAL:
                bad.append(f"{where}: a package import belongs at the top (the layer contract orders them)")
            elif "#" not in lines[node.lineno - 1] and not lines[node.lineno - 2].lstrip().startswith("# lazy"):
                bad.append(f"{where}: give the lazy import a one-line reason comment (on its line or just above)")
    assert not bad, "\n".join(bad)


def test_the_function_local_import_check_can_fail(tmp_path, monkeypatch):
    """The check above flags a stdlib import, a package import and a heavy import without a reason."""
    fake_root = tmp_path
    (fake_root / "nemo_rl_spec").mkdir()
    (fake_root / "nemo_rl_spec" / "m.py").write_text(
        "def f():\n    import json\n    from nemo_rl_spec.utils import config\n    import vllm\n"
        "    import torch  # lazy: a reason\n    # lazy: a reason\n    import wandb\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake_root)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake_root / "nemo_rl_spec")
    with pytest.raises(AssertionError) as err:
        test_function_local_imports_are_lazy_heavy_dependencies_with_a_reason()
    msg = str(err.value)
    assert "m.py:2 (json)" in msg and "m.py:3 (nemo_rl_spec.utils)" in msg and "m.py:4 (vllm)" in msg
    assert "m.py:5" not in msg and "m.py:7" not in msg


def _private_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    modules, found = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nemo_rl_spec"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}.{alias.name}")
                modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("nemo_rl_spec"):
                    modules[alias.asname or alias.name.split(".")[0]] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
        ):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {modules[node.value.id]}.{node.attr}")
    return found


def test_no_private_name_is_used_across_modules():
    found = [
        use for d in ("nemo_rl_spec", "examples") for p in sorted((ROOT / d).rglob("*.py")) for use in _private_uses(p)
    ]
    assert not found, "make these public (with a docstring) or move them:\n" + "\n".join(found)


def test_the_private_use_check_can_fail(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    path = tmp_path / "x.py"
    path.write_text(
        "from nemo_rl_spec.testing import checks\nfrom nemo_rl_spec.a import _b\nchecks._generate(1)\nchecks.make_llm\n"
    )
    assert _private_uses(path) == [
        "x.py:2 imports nemo_rl_spec.a._b",
        "x.py:3 uses nemo_rl_spec.testing.checks._generate",
    ]
