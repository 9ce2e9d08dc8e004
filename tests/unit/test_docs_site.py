"""The docs site (mkdocs.yml, MkDocs with the Material theme) builds with ``--strict``: a broken link, a broken anchor
or a page missing from the site fails the unit tier. The second test builds a copy of the docs with one broken link
added and checks that the same command fails on it and names it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MKDOCS = Path(sys.executable).with_name("mkdocs")


def _build(root: Path, site: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of the project at ``root`` into ``site``."""
    if not MKDOCS.exists():
        pytest.fail(f"{MKDOCS} missing: mkdocs is in the test extra of pyproject.toml (make install)")
    # not --quiet: it hides the warnings that --strict counts, and the build passes with them
    cmd = [str(MKDOCS), "build", "--strict", "--site-dir", str(site)]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about its successor, printed on every build
    return subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300, env=env)


def test_site_builds_strict(tmp_path):
    res = _build(ROOT, tmp_path / "site")
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "guides").is_dir(), "docs/guides is not in the site"


def test_a_broken_link_fails_the_strict_build(tmp_path):
    copy = tmp_path / "repo"
    copy.mkdir()
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", copy / "docs")  # the tree the first test builds, plus one page below
    (copy / "docs" / "guides" / "broken_link.md").write_text("# Broken\n\nSee [the missing page](no_such_page.md).\n")
    res = _build(copy, tmp_path / "site")
    assert res.returncode != 0, "a broken link did not fail mkdocs build --strict"
    assert "no_such_page.md" in res.stdout + res.stderr, res.stdout + res.stderr
