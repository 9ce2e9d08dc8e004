"""The multi-family testbed policy (built-in ``testbed-pool-llama``), shipped as a file pinned by sha256.

The SFT build under bf16 autocast gives different bits on CPUs with and without AMX, so a policy rebuilt on
another machine would start every run from another point. This one is built once (:data:`~nemo_rl_spec.models.
testbed.TESTBED_POOL`, weights rounded to bf16 and stored as fp32) and shipped in the repository as
``assets/testbed-pool-llama.tar.xz``; installing it checks the weights' sha256 against :data:`POOL_SHA256`.
``python -m nemo_rl_spec.models.testbed_pool --rebuild DIR`` rebuilds it from scratch and says whether this
machine reproduces the pinned bits; ``--pack`` (maintainers) rebuilds and rewrites the archive.
"""

from __future__ import annotations

import argparse
import hashlib
import tarfile
from pathlib import Path

from nemo_rl_spec.models.testbed import TESTBED_POOL, build_testbed

POOL_ARCHIVE = Path(__file__).resolve().parent / "assets" / "testbed-pool-llama.tar.xz"
POOL_SHA256 = "b3f680ae635577924c22e821dd839dbd51eca4683a1cf88a760ab01f76b8f71b"
"""sha256 of the shipped ``model.safetensors``."""


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def install_testbed_pool(out_dir: Path, archive: Path = POOL_ARCHIVE) -> None:
    """Extract the shipped checkpoint into ``out_dir`` and check its weights.

    Raises:
        FileNotFoundError: ``archive`` is missing (a checkout without the asset).
        RuntimeError: the extracted ``model.safetensors`` does not hash to :data:`POOL_SHA256`.
    """
    if not archive.is_file():
        raise FileNotFoundError(f"testbed-pool-llama: the shipped archive {archive} is missing")
    with tarfile.open(archive, "r:xz") as tar:
        tar.extractall(out_dir, filter="data")
    got = file_sha256(Path(out_dir) / "model.safetensors")
    if got != POOL_SHA256:
        raise RuntimeError(f"testbed-pool-llama: {archive} holds weights with sha256 {got}, pinned {POOL_SHA256}")


def pack(out_dir: Path, archive: Path) -> str:
    """Build :data:`TESTBED_POOL` into ``out_dir`` and write its files (flat) into ``archive`` (xz); returns the
    weights' sha256."""
    build_testbed(out_dir, TESTBED_POOL)
    with tarfile.open(archive, "w:xz", preset=9) as tar:
        for path in sorted(Path(out_dir).iterdir()):
            tar.add(path, arcname=path.name)
    return file_sha256(Path(out_dir) / "model.safetensors")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Rebuild the multi-family testbed policy and compare its weights.")
    parser.add_argument("--rebuild", metavar="DIR", required=True, help="build into DIR (an HF checkpoint)")
    parser.add_argument("--pack", action="store_true", help=f"also rewrite {POOL_ARCHIVE} from the build")
    args = parser.parse_args(argv)
    out = Path(args.rebuild)
    if args.pack:
        POOL_ARCHIVE.parent.mkdir(parents=True, exist_ok=True)
        sha = pack(out, POOL_ARCHIVE)
    else:
        build_testbed(out, TESTBED_POOL)
        sha = file_sha256(out / "model.safetensors")
    same = "reproduces" if sha == POOL_SHA256 else "does NOT reproduce"
    print(f"built {out}: model.safetensors sha256 {sha}; this machine {same} the pinned {POOL_SHA256}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
