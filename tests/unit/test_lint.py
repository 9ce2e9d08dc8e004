"""ruff (pyproject.toml [tool.ruff]) passes on the whole repository, lint and format, and its configuration does flag
a lint error and unformatted code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUFF = Path(sys.executable).with_name("ruff")


def _ruff(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    if not RUFF.exists():
        pytest.fail(f"{RUFF} missing: ruff is in the test extra of pyproject.toml (make install)")
    return subprocess.run([str(RUFF), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_ruff_check_passes():
    res = _ruff("check", "--no-cache", ".")
    assert res.returncode == 0, res.stdout + res.stderr


def test_ruff_config_flags_an_unused_import_and_unsorted_imports(tmp_path):
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "bad.py").write_text('"""Scratch."""\nimport sys\nimport os\n\nprint(os.sep)\n')
    res = _ruff("check", "--no-cache", "--output-format", "concise", ".", cwd=tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "bad.py:2:1: I001" in res.stdout and "F401" in res.stdout, res.stdout


def test_ruff_format_check_passes():
    """The code stays as `ruff format` writes it (pyproject [tool.ruff.format]); run `ruff format .` to fix."""
    res = _ruff("format", "--check", "--no-cache", ".")
    assert res.returncode == 0, res.stdout + res.stderr


def test_ruff_format_check_flags_unformatted_code(tmp_path):
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "bad.py").write_text('"""Scratch."""\nx = {  "a":1 }\n')
    res = _ruff("format", "--check", "--no-cache", ".", cwd=tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr  # 1: would reformat (2 would be a config error)
    assert "bad.py" in res.stdout, res.stdout
