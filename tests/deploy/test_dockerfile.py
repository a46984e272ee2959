"""Dockerfile, .dockerignore, deploy/docker/ and scripts/image.sh: what can be checked without a
container engine, and the real build where one is.

Without an engine (a plain `make test`): hadolint (with its ShellCheck) on the Dockerfiles and
ShellCheck on the scripts; the stages,
arguments, user, signal, health check and command, read from the Dockerfile; that the build
context (.dockerignore) holds everything the COPY lines need and none of the built models; each
script the build runs (install-deps.sh with pip and python stubbed, check-build.py,
assemble-repository.sh) on this machine; that the GPU base image's CUDA major is the one of the
torch wheels the gpu stage installs; check-build.py's CUDA provider checks, on a library built
here and ONNX Runtime's CPU build; and the runtime stage's command line, run with the
runtime stage's environment on a repository assembled as the image's is: it must serve, answer
the image's health check, and drain in-flight requests on SIGTERM (STOPSIGNAL); the build inputs
(CA bundle, wheel folder) as scripts/image.sh gathers them, and as the build's pip steps see them.

With an engine and BATCHLINE_IMAGE_TESTS=1 (or BATCHLINE_IMAGE=TAG, as `make image-test` sets
it): the image is built by scripts/image.sh (cached layers) and its configuration is read back
against the Dockerfile's. Running it is tests/image's work.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import re
import shlex
import signal
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from loadtest.localserver import bound_port, free_port
from tests.deploy.contract import ROOT, run, tool
from tests.integration.conftest import MODELS, linked_repository

DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
DOCKER_DIR = ROOT / "deploy" / "docker"
BASE_DOCKERFILE = DOCKER_DIR / "base.Dockerfile"
IMAGE_SCRIPT = ROOT / "scripts" / "image.sh"
SCRIPTS = [DOCKER_DIR / "install-deps.sh", DOCKER_DIR / "assemble-repository.sh", DOCKER_DIR / "with-build-inputs.sh",
           ROOT / "scripts" / "prometheus.sh", ROOT / "scripts" / "test-tools.sh", IMAGE_SCRIPT]
INPUTS_MOUNT = "--mount=type=bind,from=build-inputs,target=/run/build-inputs"


# ---- a Dockerfile reader -------------------------------------------------------------------
@dataclass
class Instruction:
    keyword: str
    arguments: str

    def exec_form(self) -> list[str] | None:
        text = self.arguments
        text = text.removeprefix("CMD ")
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            return None
        return parsed if isinstance(parsed, list) else None


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def one(self, keyword: str) -> Instruction:
        (found,) = self.all(keyword)
        return found

    def args(self) -> dict[str, str | None]:
        found: dict[str, str | None] = {}
        for instruction in self.all("ARG"):
            name, _, default = instruction.arguments.partition("=")
            found[name] = default if _ else None
        return found

    def env(self) -> dict[str, str]:
        found = {}
        for instruction in self.all("ENV"):
            for pair in shlex.split(instruction.arguments):
                key, _, value = pair.partition("=")
                found[key] = value
        return found


def read_dockerfile(path: Path = DOCKERFILE) -> tuple[dict[str, str | None], list[Stage]]:
    """Global ARGs and the stages, continuation lines joined, comments dropped."""
    logical: list[str] = []
    current = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not current):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        logical.append(current + stripped)
        current = ""
    assert not current, "the Dockerfile ends inside a continuation"
    global_args: dict[str, str | None] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, arguments = line.partition(" ")
        keyword = keyword.upper()
        arguments = re.sub(r"\s+", " ", arguments).strip()
        if keyword == "FROM":
            match = re.fullmatch(r"(?:--platform=\S+ )?(\S+) AS (\S+)", arguments, re.IGNORECASE)
            assert match, f"every stage is named: FROM {arguments}"
            stages.append(Stage(match.group(2), match.group(1)))
        elif not stages:
            assert keyword == "ARG", f"{keyword} before the first FROM"
            name, _, default = arguments.partition("=")
            global_args[name] = default if _ else None
        else:
            stages[-1].instructions.append(Instruction(keyword, arguments))
    return global_args, stages


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str | None], dict[str, Stage]]:
    global_args, stages = read_dockerfile()
    names = [s.name for s in stages]
    assert len(names) == len(set(names))
    assert names[-1] == "runtime", "the last stage is what `docker build` tags"
    return global_args, {s.name: s for s in stages}


# ---- linters -------------------------------------------------------------------------------
@pytest.mark.parametrize("dockerfile_path", [DOCKERFILE, BASE_DOCKERFILE], ids=["Dockerfile", "base.Dockerfile"])
def test_hadolint_passes(dockerfile_path: Path) -> None:
    run(tool("hadolint"), str(dockerfile_path))


def test_hadolint_can_fail(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.read_text().replace("FROM base AS runtime", "FROM ubuntu:latest AS runtime\nRUN cd /tmp"))
    assert run(tool("hadolint"), str(bad), check=False).returncode != 0


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_shellcheck_passes(script: Path) -> None:
    run(tool("shellcheck"), "--severity=style", str(script))


# ---- structure -----------------------------------------------------------------------------
def test_the_variants_and_their_bases(dockerfile) -> None:  # type: ignore[no-untyped-def]
    global_args, stages = dockerfile
    assert global_args["VARIANT"] == "cpu"
    assert re.fullmatch(r"python:3\.(11|12)-slim(-\w+)?", global_args["PYTHON_IMAGE"] or ""), \
        "tested on Python 3.11 and 3.12"
    cuda = global_args["CUDA_IMAGE"] or ""
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-cudnn-runtime-ubuntu24\.04", cuda), \
        f"{cuda}: an nvidia/cuda runtime image with cuDNN on Ubuntu 24.04 (python3 3.12)"
    assert stages["base-cpu"].base == "${PYTHON_IMAGE}"
    assert stages["base-gpu"].base == "${CUDA_IMAGE}"
    assert "python3-venv" in stages["base-gpu"].one("RUN").arguments
    assert stages["base"].base == "base-${VARIANT}"
    for variant in ("cpu", "gpu"):
        assert (ROOT / "requirements" / f"{variant}.txt").is_file()
    for name in ("deps", "runtime"):
        assert "VARIANT" in stages[name].args(), f"{name} must declare ARG VARIANT to see it"
    assert stages["deps"].args()["TORCH_INDEX_URL"] == "auto"
    (install,) = stages["deps"].all("RUN")
    assert install.arguments == (f"{INPUTS_MOUNT} sh deploy/docker/with-build-inputs.sh /run/build-inputs "
                                 'sh deploy/docker/install-deps.sh "$VARIANT" "$TORCH_INDEX_URL" /opt/venv')
    assert stages["deps"].base == "base" and stages["models"].base == "deps" and stages["runtime"].base == "base"
    assert stages["wheel"].base == "deps"
    assert not [c for c in stages["deps"].all("COPY") if re.search(r"\b(server|loadtest|models|README\.md)\b", c.arguments)], \
        "the dependencies' layer holds none of the code, so editing it reuses that layer"


def test_the_models_are_built_offline_in_their_own_stage(dockerfile) -> None:  # type: ignore[no-untyped-def]
    _, stages = dockerfile
    models = stages["models"]
    assert models.env()["HF_HUB_OFFLINE"] == "1" and models.env()["TRANSFORMERS_OFFLINE"] == "1"
    build = models.all("RUN")[-1].arguments
    for script in sorted(MODELS.glob("*/build.py")):
        assert f"python {script.relative_to(ROOT)}" in build, f"{script} is not run"
    assert "assemble-repository.sh models /opt/batchline/models" in build
    copies = [c.arguments for c in stages["runtime"].all("COPY")]
    assert "--from=deps /opt/venv /opt/venv" in copies
    assert "--from=models /opt/batchline/models /opt/batchline/models" in copies
    assert not any("--from=models /opt/venv" in c for c in copies), "the build extra stays out of the image"
    (install,) = stages["runtime"].all("RUN")[1:]
    assert install.arguments == ("--mount=type=bind,from=wheel,source=/wheels,target=/wheels "
                                 "pip install --no-deps --no-index /wheels/batchline-*.whl")
    assert "pip wheel --no-deps --wheel-dir /wheels ." in stages["wheel"].one("RUN").arguments


def test_the_runtime_stage(dockerfile) -> None:  # type: ignore[no-untyped-def]
    _, stages = dockerfile
    runtime = stages["runtime"]
    user = runtime.one("USER").arguments
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", user), f"USER {user}: numeric and not root (runAsNonRoot checks)"
    uid = user.split(":")[0]
    assert f"--uid {uid}" in runtime.all("RUN")[0].arguments
    assert runtime.one("STOPSIGNAL").arguments == "SIGTERM"
    assert runtime.one("CMD").exec_form() == ["batchline", "serve", "--host", "0.0.0.0"]
    env = runtime.env()
    assert env["BATCHLINE_MODEL_REPOSITORY"] == "/opt/batchline/models"
    assert runtime.one("EXPOSE").arguments.split() == [env["BATCHLINE_HTTP_PORT"], env["BATCHLINE_GRPC_PORT"]] == ["8000", "8001"]
    healthcheck = runtime.one("HEALTHCHECK").arguments
    command = Instruction("HEALTHCHECK", healthcheck[healthcheck.index("CMD "):]).exec_form()
    assert command == ["python", "/opt/batchline/healthcheck.py"], healthcheck
    assert "deploy/docker/healthcheck.py deploy/docker/check-build.py /opt/batchline/" in \
        [c.arguments for c in runtime.all("COPY")], "the health check, and check-build.py to run where the GPU is"
    assert "/v2/health/live" in (DOCKER_DIR / "healthcheck.py").read_text()
    start_period = re.search(r"--start-period=(\d+)s", healthcheck)
    assert start_period and int(start_period.group(1)) >= 30


# ---- the build context ---------------------------------------------------------------------
def dockerignore_patterns() -> list[tuple[bool, str]]:
    """(exclude?, pattern) as Docker reads .dockerignore: cleaned, leading / dropped, ! re-includes."""
    patterns = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        patterns.append((not include, pattern))
    return patterns


def _match(pattern: str, path: str) -> bool:
    """Go's filepath.Match per path element, plus `**` for any number of elements (moby's
    patternmatcher)."""
    regex = ""
    for i, part in enumerate(pattern.split("/")):
        if part == "**":
            regex += "(?:[^/]+/)*" if i < len(pattern.split("/")) - 1 else ".*"
            continue
        regex += fnmatch.translate(part).removeprefix("(?s:").removesuffix(")\\Z").replace(".*", "[^/]*")
        regex += "/"
    regex = regex.rstrip("/")
    regex = regex.replace("(?:[^/]+/)*/", "(?:[^/]+/)*")
    return re.fullmatch(regex, path) is not None


def in_context(path: str) -> bool:
    """Whether `path` (relative to the root) is sent to the builder: the last pattern that matches
    it or one of its parent folders decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for exclude, pattern in dockerignore_patterns():
        if any(_match(pattern, p) for p in prefixes):
            excluded = exclude
    return not excluded


def tracked_files(path: str) -> list[str]:
    done = subprocess.run(["git", "ls-files", "--", path], cwd=ROOT, capture_output=True, text=True, check=False)
    files = done.stdout.split() if done.returncode == 0 else []
    if not files:  # not a git checkout, or not committed yet: the files on disk, caches aside
        base = ROOT / path
        candidates = [base] if base.is_file() else [p for p in base.rglob("*") if p.is_file()]
        files = [str(p.relative_to(ROOT)) for p in candidates
                 if "__pycache__" not in p.parts and not re.search(r"^models/[^/]+/\d+/", str(p.relative_to(ROOT)))]
    return files


def test_the_dockerignore_matcher() -> None:
    assert _match("models/*/[0-9]*", "models/minilm/1") and not _match("models/*/[0-9]*", "models/minilm/config.yaml")
    assert _match("**/__pycache__", "server/http/__pycache__") and _match("**/__pycache__", "__pycache__")
    assert _match("*", "tests") and not _match("*", "tests/unit")


def test_the_build_context_holds_what_the_copies_need(dockerfile) -> None:  # type: ignore[no-untyped-def]
    _, stages = dockerfile
    sources = []
    for stage in stages.values():
        for copy in stage.all("COPY"):
            if copy.arguments.startswith("--from="):
                continue
            *srcs, _dest = copy.arguments.split(" ")
            sources += srcs
    assert sources
    for source in sources:
        source = source.rstrip("/")
        assert (ROOT / source).exists(), f"COPY {source}: no such file"
        files = tracked_files(source)
        assert files, f"COPY {source}: nothing there"
        left_out = [f for f in files if not in_context(f)]
        assert not left_out, f".dockerignore leaves out what COPY {source} needs: {left_out[:5]}"


def test_the_build_context_leaves_out_built_models_and_the_rest() -> None:
    for path in ("models/minilm/1/model.onnx", "models/digits/1/model.pt2", "server/__pycache__/cli.cpython-311.pyc",
                 "tests/unit/test_config.py", ".git/HEAD", ".venv/bin/python", "docs/architecture.md",
                 "deploy/k8s/base/deployment.yaml", "out/suite.json"):
        assert not in_context(path), f"{path} is sent to the builder"
    for path in ("models/minilm/build.py", "models/minilm/config.yaml", "server/cli.py", "requirements/cpu.txt",
                 "deploy/docker/healthcheck.py", "pyproject.toml", "README.md"):
        assert in_context(path), f"{path} is not sent to the builder"


# ---- build inputs: a CA bundle and a wheel folder for pip, never in a layer ------------------
def test_every_pip_step_sees_the_build_inputs_and_no_layer_keeps_them(dockerfile) -> None:  # type: ignore[no-untyped-def]
    """The stage `build-inputs` is empty (FROM scratch, nothing else) unless the build is given
    that context; each RUN that installs with pip mounts it for that step only, through
    with-build-inputs.sh; no COPY takes from it."""
    _, stages = dockerfile
    assert stages["build-inputs"].base == "scratch" and not stages["build-inputs"].instructions
    online = [i.arguments for stage in stages.values() for i in stage.all("RUN")
              if re.search(r"pip (install|wheel)|install-deps\.sh", i.arguments) and "--no-index" not in i.arguments]
    assert len(online) == 3, online  # the runtime venv (deps), the package (wheel), the build extra (models)
    for arguments in online:
        assert arguments.startswith(f"{INPUTS_MOUNT} "), arguments
        assert re.search(r"(^|&& )sh deploy/docker/with-build-inputs\.sh /run/build-inputs (pip|sh deploy/docker/install-deps)",
                         arguments.removeprefix(f"{INPUTS_MOUNT} ")), arguments
    copies = [c.arguments for stage in stages.values() for c in stage.all("COPY")]
    assert not [c for c in copies if "--from=build-inputs" in c]
    assert "deploy/docker/with-build-inputs.sh" in " ".join(c.arguments for c in stages["deps"].all("COPY"))


def test_with_build_inputs_hands_pip_the_ca_bundle_and_the_wheels(tmp_path: Path) -> None:
    """pip itself (`pip config list`) sees what the folder holds, and nothing when it is empty
    (a plain `docker build`)."""
    script = str(DOCKER_DIR / "with-build-inputs.sh")
    pip_config = [sys.executable, "-m", "pip", "config", "list"]
    clean = {"PIP_CERT": "", "PIP_FIND_LINKS": ""}
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    done = run("sh", script, str(inputs), *pip_config, env=clean)
    assert ":env:.cert" not in done.stdout.replace(":env:.cert=''", "") and "build inputs:" not in done.stderr
    (inputs / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    (inputs / "wheels").mkdir()
    (inputs / "wheels" / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    done = run("sh", script, str(inputs), *pip_config, env=clean)
    assert f":env:.cert='{inputs}/ca.crt'" in done.stdout, done.stdout
    assert f":env:.find-links='{inputs}/wheels'" in done.stdout, done.stdout
    assert "1 wheels" in done.stderr
    assert run("sh", script, str(inputs), check=False).returncode == 2


def fake_wheels(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name in ("torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
                 "torch-2.13.0+cu130-cp311-cp311-manylinux_2_28_x86_64.whl",
                 "tokenizers-0.22.1-cp39-abi3-manylinux_2_17_x86_64.whl"):
        (folder / name).write_text(name)
    return folder


@pytest.mark.parametrize(("variant", "kept", "left_out"), [("cpu", "+cpu", "+cu130"), ("gpu", "+cu130", "+cpu")])
def test_the_image_script_gathers_the_inputs_for_its_variant(tmp_path: Path, variant: str, kept: str,
                                                             left_out: str) -> None:
    """`scripts/image.sh inputs`: the CA bundle and the wheels, the other variant's torch left
    out (a +cpu wheel sorts above PyPI's CUDA torch of the same version; a CUDA one would put
    CUDA into the CPU image), and the variant's torch wheel announced."""
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    wheels = fake_wheels(tmp_path / "wheels")
    out = tmp_path / "out"
    done = run("bash", str(IMAGE_SCRIPT), "inputs", str(out), "--variant", variant, "--no-host-pip",
               "--ca-bundle", str(ca), "--wheels", str(wheels))
    assert (out / "ca.crt").read_text() == ca.read_text()
    names = sorted(p.name for p in (out / "wheels").iterdir())
    assert [n for n in names if n.startswith("torch-")] == [f"torch-2.13.0{kept}-cp311-cp311-manylinux_2_28_x86_64.whl"]
    assert any(n.startswith("tokenizers-") for n in names) and not any(left_out in n for n in names)
    assert "TORCH_INDEX_URL=" in done.stderr

    bare = tmp_path / "bare"
    done = run("bash", str(IMAGE_SCRIPT), "inputs", str(bare), "--variant", variant, "--no-host-pip")
    assert list(bare.iterdir()) == [] and "TORCH_INDEX_URL" not in done.stderr
    assert run("bash", str(IMAGE_SCRIPT), "inputs", str(bare), "--wheels", str(tmp_path / "none"),
               check=False).returncode != 0
    assert run("bash", str(IMAGE_SCRIPT), "inputs", str(bare), "--variant", "tpu", check=False).returncode != 0


def test_the_image_script_reads_the_hosts_pip_configuration(tmp_path: Path) -> None:
    """Without options, the CA bundle (cert) and wheel folders (find-links) of the host's pip
    configuration, as `pip config list` shows it: here through pip's own variables."""
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE----- host\n")
    wheels = fake_wheels(tmp_path / "wheels")
    out = tmp_path / "out"
    run("bash", str(IMAGE_SCRIPT), "inputs", str(out), env={"PIP_CERT": str(ca), "PIP_FIND_LINKS": str(wheels)})
    assert (out / "ca.crt").read_text() == ca.read_text()
    assert (out / "wheels" / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").is_file()
    assert not (out / "wheels" / "torch-2.13.0+cu130-cp311-cp311-manylinux_2_28_x86_64.whl").exists()


# ---- the scripts the build runs ------------------------------------------------------------
def stubbed(tmp_path: Path, real_python: bool) -> tuple[dict[str, str], Path]:
    """PATH with a `python3` whose `-m venv DIR` makes DIR/bin/pip (logs its arguments and the
    pins file) and DIR/bin/python (this Python, or a stub that succeeds)."""
    bin_dir = tmp_path / "stub-bin"
    bin_dir.mkdir()
    log = tmp_path / "pip.log"
    python = sys.executable if real_python else "true"
    (bin_dir / "python3").write_text(f"""#!/bin/sh
[ "$1" = -m ] && [ "$2" = venv ] || exec {sys.executable} "$@"
mkdir -p "$3/bin"
cat > "$3/bin/pip" <<'EOF'
#!/bin/sh
printf '%s\\n' "$@" > "{log}"
n=0
while [ "$#" -gt 0 ]; do [ "$1" = -r ] && n=$((n + 1)) && cp "$2" "{log}.r$n"; shift; done
EOF
printf '#!/bin/sh\\nexec {python} "$@"\\n' > "$3/bin/python"
chmod +x "$3/bin/pip" "$3/bin/python"
""")
    (bin_dir / "python3").chmod(stat.S_IRWXU)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}, log


def install_deps(tmp_path: Path, variant: str, index: str, real_python: bool = False) -> tuple[subprocess.CompletedProcess[str], list[str], str, str]:
    """(the run, pip's arguments, its first -r file: the pins, its second: the package's needs)"""
    env, log = stubbed(tmp_path, real_python)
    done = run("sh", str(DOCKER_DIR / "install-deps.sh"), variant, index, str(tmp_path / "venv"), env=env, check=False)
    pip_args = log.read_text().splitlines() if log.exists() else []
    pins, needs = (Path(f"{log}.r{n}").read_text() if Path(f"{log}.r{n}").exists() else "" for n in (1, 2))
    return done, pip_args, pins, needs


def package_requirements(*extras: str) -> list[str]:
    """pyproject.toml's dependencies and those of `extras`, read here with tomllib."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = list(project["dependencies"])
    for extra in extras:
        found += [r for r in project["optional-dependencies"][extra] if r not in found]
    return found


def test_requirements_of_follows_the_packages_own_extras(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "pkg"\ndependencies = ["a>=1"]\n'
                         '[project.optional-dependencies]\nx = ["b", "pkg[y]"]\ny = ["c==2", "a>=1"]\n')
    script = str(DOCKER_DIR / "requirements-of.py")
    assert run(sys.executable, script, str(pyproject), "x").stdout.split() == ["a>=1", "b", "c==2"]
    assert run(sys.executable, script, str(pyproject), "--extras-only", "y").stdout.split() == ["c==2", "a>=1"]
    done = run(sys.executable, script, str(pyproject), "z", check=False)
    assert done.returncode != 0 and "no extra 'z'" in done.stderr


def requirement_pins(variant: str) -> str:
    lines = (ROOT / "requirements" / f"{variant}.txt").read_text().splitlines()
    return "".join(f"{line}\n" for line in lines if line.strip() and not line.startswith(("#", "-e")))


@pytest.mark.parametrize(("variant", "index", "expected_index"), [
    ("cpu", "auto", "https://download.pytorch.org/whl/cpu"),
    ("gpu", "auto", "https://download.pytorch.org/whl/cu130"),
    ("cpu", "", None),
    ("gpu", "https://mirror.invalid/whl/cu126", "https://mirror.invalid/whl/cu126"),
])
def test_install_deps_picks_the_index_and_pins(tmp_path: Path, variant: str, index: str, expected_index: str | None) -> None:
    done, pip_args, pins, needs = install_deps(tmp_path, variant, index)
    assert done.returncode == 0, done.stderr
    expected = ["install"] + (["--extra-index-url", expected_index] if expected_index else [])
    assert pip_args[: len(expected)] == expected
    assert pip_args[len(expected)] == "-r" and pip_args[len(expected) + 2] == "-r" and len(pip_args) == len(expected) + 4
    assert pins == requirement_pins(variant)
    wanted = needs.splitlines()
    assert wanted == package_requirements(variant, "torchao", "quantize")
    assert not [r for r in wanted if r.startswith("batchline")], "the package itself comes in a later layer"
    names = {re.split(r"[\[<>=!~ ]", r)[0] for r in wanted}
    assert {"torch", "torchao", "onnx", "scikit-learn", "fastapi"} <= names
    other_ort = "onnxruntime" if variant == "gpu" else "onnxruntime-gpu"
    assert f"onnxruntime{'-gpu' if variant == 'gpu' else ''}" in names and other_ort not in names, \
        "the CPU and GPU requirement sets stay apart"
    if variant == "cpu":
        assert re.search(r"^torch==", pins, re.MULTILINE), "the CPU image pins torch"


def test_install_deps_refuses_an_unknown_variant(tmp_path: Path) -> None:
    done, pip_args, _, _ = install_deps(tmp_path, "tpu", "auto")
    assert done.returncode == 2 and not pip_args


def this_machines_variant() -> tuple[str, str]:
    """(the variant this venv holds, the other one): cpu here and on CI, gpu after `make GPU=1`."""
    import torch

    return ("cpu", "gpu") if torch.version.cuda is None else ("gpu", "cpu")


def test_install_deps_fails_when_the_build_is_the_wrong_one(tmp_path: Path) -> None:
    """With this machine's torch (CPU here), the other variant's check fails the build."""
    _, other = this_machines_variant()
    done, _, _, _ = install_deps(tmp_path, other, "auto", real_python=True)
    assert done.returncode != 0 and f"not the {other} build" in done.stderr


def test_check_build_knows_this_machine() -> None:
    """This venv passes its own variant's check (on a GPU machine: the CUDA provider and torch
    run on the GPU) and fails the other's on both torch and onnxruntime."""
    script = str(DOCKER_DIR / "check-build.py")
    mine, other = this_machines_variant()
    assert run(sys.executable, script, mine).returncode == 0
    wrong = run(sys.executable, script, other, check=False)
    assert wrong.returncode == 1 and "torch" in wrong.stderr and "onnxruntime" in wrong.stderr
    assert run(sys.executable, script, "tpu", check=False).returncode == 2


def cuda_major_of_index(url: str) -> int:
    """PyTorch's wheel index for CUDA X.Y is .../cuXY (cu130: CUDA 13.0)."""
    match = re.search(r"/cu(\d+)(\d)/?$", url)
    assert match, f"{url} names no CUDA version"
    return int(match.group(1))


def test_the_gpu_base_is_the_cuda_major_of_its_wheels(dockerfile, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A CUDA 12 base under CUDA 13 wheels has only .so.12 libraries (and admits drivers the
    wheels cannot use): the base's CUDA major is the one of the torch index the gpu stage installs
    from by default. (PyPI's onnxruntime-gpu names no CUDA in its name or index; check-build.py
    fails the build where its CUDA major differs, or its provider's libraries do not load.)"""
    global_args, stages = dockerfile
    base = re.fullmatch(r"nvidia/cuda:(\d+)\.\d+\.\d+-.*", global_args["CUDA_IMAGE"] or "")
    assert base, global_args["CUDA_IMAGE"]
    assert stages["deps"].args()["TORCH_INDEX_URL"] == "auto"
    done, pip_args, _, _ = install_deps(tmp_path, "gpu", "auto")
    assert done.returncode == 0, done.stderr
    index = pip_args[pip_args.index("--extra-index-url") + 1]
    assert cuda_major_of_index(index) == int(base.group(1)) == 13, \
        f"base {global_args['CUDA_IMAGE']}, torch from {index}: PyPI's torch and onnxruntime-gpu are CUDA 13"
    assert cuda_major_of_index("https://mirror.invalid/whl/cu126") == 12


# ---- check-build.py's CUDA checks, on what this machine has --------------------------------
@pytest.fixture(scope="module")
def check_build():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("check_build", DOCKER_DIR / "check-build.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_check_builds_model_is_a_matmul_that_runs(check_build) -> None:  # type: ignore[no-untyped-def]
    import onnx
    import onnxruntime

    model = onnx.load_from_string(check_build.MATMUL_MODEL)
    onnx.checker.check_model(model)
    assert [n.op_type for n in model.graph.node] == ["MatMul"]
    assert check_build.session_problem(onnxruntime, "CPUExecutionProvider") is None


def test_check_build_sees_onnxruntime_fall_back_to_the_cpu(check_build) -> None:  # type: ignore[no-untyped-def]
    """ONNX Runtime gives the CPU when a provider cannot be had (here: CUDA's, on a CPU build)
    with only a warning or a log line; the session's providers show it."""
    import onnxruntime

    available = onnxruntime.get_available_providers()
    missing = next(p for p in ("CUDAExecutionProvider", "ROCMExecutionProvider") if p not in available)
    with pytest.warns(UserWarning, match="not in available provider names"):
        problem = check_build.session_problem(onnxruntime, missing)
    assert problem and f"fell back from {missing}" in problem, problem


def compile_library(source: str, output: Path, *inputs: Path, soname: str | None = None) -> Path:
    c_file = output.with_suffix(".c")
    c_file.write_text(source)
    soname_flag = [f"-Wl,-soname,{soname}"] if soname else []
    run("gcc", "-shared", "-fPIC", *soname_flag, "-o", str(output), str(c_file), "-Wl,--no-as-needed",
        *map(str, inputs))
    c_file.unlink()
    return output


def test_check_build_opens_the_cuda_provider_library(check_build, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The provider library must load with its dependencies bound: one linked against a CUDA
    library of another major (a soname this machine lacks) fails, with that soname named."""
    capi = tmp_path / "capi"
    capi.mkdir()
    assert "has no libonnxruntime_providers_cuda.so" in check_build.provider_library_problem(capi)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cublas = compile_library("int cublas_probe(void) { return 13; }\n", elsewhere / "libcublasLt-fake.so",
                             soname="libcublasLt.so.99")
    compile_library("int shared_probe(void) { return 1; }\n", capi / "libonnxruntime_providers_shared.so")
    provider = "int cublas_probe(void);\nint provider_probe(void) { return cublas_probe(); }\n"
    compile_library(provider, capi / "libonnxruntime_providers_cuda.so", cublas)
    problem = check_build.provider_library_problem(capi)
    assert problem and "does not load" in problem and "libcublasLt.so.99" in problem, problem

    compile_library("int provider_probe(void) { return 13; }\n", capi / "libonnxruntime_providers_cuda.so")
    assert check_build.provider_library_problem(capi) is None


def test_check_build_wants_one_cuda_major(check_build, tmp_path: Path,  # type: ignore[no-untyped-def]
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """torch, onnxruntime and the base image (CUDA_VERSION) on one CUDA major, else no further;
    then the provider's library (no GPU visible: nothing more)."""
    from types import SimpleNamespace

    def fakes(torch_cuda: str, ort_cuda: str) -> tuple[SimpleNamespace, SimpleNamespace]:
        no_gpu = SimpleNamespace(is_available=lambda: False)
        torch = SimpleNamespace(version=SimpleNamespace(cuda=torch_cuda), cuda=no_gpu)
        package = tmp_path / "onnxruntime" / "__init__.py"
        return torch, SimpleNamespace(cuda_version=ort_cuda, __file__=str(package))  # no preload_dlls

    monkeypatch.delenv("CUDA_VERSION", raising=False)
    (problem,) = check_build.cuda_problems(*fakes("13.0", "12.8"))
    assert "one CUDA major" in problem and "torch CUDA 13" in problem and "onnxruntime CUDA 12" in problem
    (problem,) = check_build.cuda_problems(*fakes("13.0", ""))
    assert "onnxruntime CUDA ?" in problem
    monkeypatch.setenv("CUDA_VERSION", "12.6.3")
    (problem,) = check_build.cuda_problems(*fakes("13.0", "13.0"))
    assert "the base image (CUDA_VERSION) CUDA 12" in problem
    monkeypatch.setenv("CUDA_VERSION", "13.0.1")
    (problem,) = check_build.cuda_problems(*fakes("13.0", "13.0"))
    assert "has no libonnxruntime_providers_cuda.so" in problem, "one major: on to the provider's library"
    capi = tmp_path / "onnxruntime" / "capi"
    capi.mkdir(parents=True)
    compile_library("int provider_probe(void) { return 13; }\n", capi / "libonnxruntime_providers_cuda.so")
    assert check_build.cuda_problems(*fakes("13.0", "13.0")) == [], "no GPU visible: the library is all"


def test_assemble_repository_copies_configs_and_versions_only(tmp_path: Path) -> None:
    source = linked_repository(tmp_path / "models")
    target = tmp_path / "repository"
    run("sh", str(DOCKER_DIR / "assemble-repository.sh"), str(source), str(target))
    for model in (p for p in source.iterdir() if (p / "config.yaml").is_file()):
        copied = sorted(p.name for p in (target / model.name).iterdir())
        versions = sorted(p.name for p in model.iterdir() if p.is_dir() and p.name.isdigit())
        assert copied == sorted(["config.yaml", *versions]), f"{model.name}: {copied}"
        for version in versions:
            assert sorted(p.name for p in (target / model.name / version).iterdir()) == \
                sorted(p.name for p in (model / version).iterdir())


def test_assemble_repository_refuses_an_unbuilt_model(tmp_path: Path) -> None:
    source = tmp_path / "source"
    (source / "unbuilt").mkdir(parents=True)
    (source / "unbuilt" / "config.yaml").write_text("name: unbuilt\n")
    done = run("sh", str(DOCKER_DIR / "assemble-repository.sh"), str(source), str(tmp_path / "out"), check=False)
    assert done.returncode == 1 and "no built version" in done.stderr
    (source / "unbuilt" / "config.yaml").unlink()
    done = run("sh", str(DOCKER_DIR / "assemble-repository.sh"), str(source), str(tmp_path / "out2"), check=False)
    assert done.returncode == 1 and "no config.yaml" in done.stderr


# ---- the runtime stage's command, run here -------------------------------------------------
_BLOCKER = """\
# Written by tests/deploy: hide the packages the image does not install, as if absent.
import os, sys

_blocked = frozenset(filter(None, os.environ.get("BATCHLINE_IMAGE_BLOCKED", "").split(",")))


class _Hiding:
    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _blocked:
            return None
        find = getattr(self._finder, "find_spec", None)
        return find(name, path, target) if find else None

    def __getattr__(self, attribute):  # find_distributions, invalidate_caches, ...
        return getattr(self._finder, attribute)


sys.meta_path[:] = [_Hiding(finder) for finder in sys.meta_path]
"""


def not_in_the_image() -> list[str]:
    """Top-level modules installed here but not in the runtime image, whose venv holds
    batchline[cpu,torchao,quantize] and what it needs (the deps stage): the build, test,
    load-test and other extras' packages, and this venv's tools."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    keep: set[str] = set()
    stack: list[tuple[str, frozenset[str]]] = [("batchline", frozenset({"cpu", "torchao", "quantize"}))]
    seen: set[tuple[str, frozenset[str]]] = set()
    while stack:
        name, extras = stack.pop()
        if (canonicalize_name(name), extras) in seen:
            continue
        seen.add((canonicalize_name(name), extras))
        keep.add(canonicalize_name(name))
        try:
            requirements = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requirements:
            requirement = Requirement(line)
            environments = [{"extra": e} for e in (*extras, "")]
            if requirement.marker is None or any(requirement.marker.evaluate(e) for e in environments):
                stack.append((requirement.name, frozenset(requirement.extras)))
    installed = {canonicalize_name(d.metadata["Name"]) for d in metadata.distributions()}
    excluded = installed - keep
    return sorted(module for module, dists in metadata.packages_distributions().items()
                  if dists and all(canonicalize_name(d) in excluded for d in dists) and module.isidentifier())


def image_python_env(tmp_path: Path) -> dict[str, str]:
    """PYTHONPATH and variables that make this venv import only what the image's venv has."""
    site = tmp_path / "image-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_BLOCKER)
    return {"PYTHONPATH": str(site), "BATCHLINE_IMAGE_BLOCKED": ",".join(not_in_the_image())}


def test_the_image_venv_lacks_the_extras(tmp_path: Path) -> None:
    """The stand-in for the image's venv hides the packages the image does not install (and so
    the server test below fails if `batchline serve` needs one of them)."""
    blocked = not_in_the_image()
    for module in ("sentence_transformers", "transformers", "pytest", "locust", "tritonclient"):
        assert module in blocked, module
    for module in ("torch", "onnxruntime", "fastapi", "uvicorn", "numpy", "tokenizers", "prometheus_client", "yaml",
                   "onnx", "sklearn", "torchao"):  # the last three: builds at load (the quantize extra)
        assert module not in blocked, module
    env = image_python_env(tmp_path)
    hidden = run(sys.executable, "-c", "import sentence_transformers", env=env, check=False)
    assert hidden.returncode != 0 and "No module named 'sentence_transformers'" in hidden.stderr
    probe = "import importlib.util as u; assert u.find_spec('pytest') is None and u.find_spec('onnx')"
    run(sys.executable, "-c", probe, env=env)
    run(sys.executable, "-c", "import torch, onnxruntime, server.cli", env=env)

def test_the_image_serves_torchao_int8_programs(tmp_path: Path) -> None:
    """A torch INT8 build (torchao dynamic) loads and answers with only the image's packages."""
    from server.quantize.api import build

    repository = linked_repository(tmp_path / "models", ("digits",))
    built = build(repository, "digits", "torch", "int8", progress=lambda _: None, benchmark=False)
    assert built.servable
    probe = (
        "import sys, numpy as np\n"
        "from pathlib import Path\n"
        "from server.config import load_model_config\n"
        "from server.devices import Device\n"
        "from server.engines import create_engine\n"
        "folder = Path(sys.argv[1])\n"
        "engine = create_engine(load_model_config(folder / 'config.yaml'), folder / '1', Device('CPU'))\n"
        "images = np.load(sys.argv[2])['images'][:4]\n"
        "print(engine.run({'image': images})['probabilities'].argmax(1).tolist())\n"
    )
    done = run(sys.executable, "-c", probe, str(repository / built.variant), str(MODELS / "digits/1/heldout.npz"),
               env={**os.environ, **image_python_env(tmp_path)})
    assert len(json.loads(done.stdout.strip().splitlines()[-1])) == 4


def test_healthcheck_fails_without_a_server() -> None:
    port = free_port()
    done = run(sys.executable, str(DOCKER_DIR / "healthcheck.py"), check=False,
               env={"BATCHLINE_HTTP_PORT": str(port), "BATCHLINE_HOST": "0.0.0.0"})
    assert done.returncode == 1 and f"127.0.0.1:{port}" in done.stderr


def _texts(n: int) -> list[str]:
    return [f"sentence {i}: " + "dynamic batching trades a little latency for throughput " * 20 for i in range(n)]


@pytest.mark.integration
def test_the_image_command_serves_checks_health_and_drains_on_sigterm(dockerfile, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The runtime stage's CMD and ENV, on a repository assembled as the image's, with only the
    image's Python packages importable: it serves every model, the HEALTHCHECK script passes,
    and requests in flight at SIGTERM complete before the process exits 0."""
    _, stages = dockerfile
    runtime = stages["runtime"]
    repository = tmp_path / "models"
    source = linked_repository(tmp_path / "source")
    run("sh", str(DOCKER_DIR / "assemble-repository.sh"), str(source), str(repository))
    env = {**os.environ, **runtime.env(), "BATCHLINE_MODEL_REPOSITORY": str(repository), "HOME": str(tmp_path),
           **image_python_env(tmp_path)}
    env["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # the image's /opt/venv/bin first
    command = runtime.one("CMD").exec_form()
    assert command is not None
    port_file = tmp_path / "port"
    # Loopback only here: later flags win, so the image's --host 0.0.0.0 is overridden; port 0 and
    # the port file: the server binds a free port itself, nobody can take it in between.
    with open(tmp_path / "server.log", "w+") as log:
        process = subprocess.Popen([*command, "--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0",
                                    "--port-file", str(port_file)],
                                   cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 180
            port = bound_port(port_file, process, tmp_path / "server.log", deadline)
            url = f"http://127.0.0.1:{port}"
            while True:
                assert process.poll() is None, f"the server exited {process.returncode}: {log.seek(0) or log.read()}"
                try:
                    if httpx.get(f"{url}/v2/health/ready", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "not ready in 180 s"
                time.sleep(0.3)
            models = {m.name for m in repository.iterdir()}
            index = httpx.post(f"{url}/v2/repository/index", json={"ready": True}).json()
            assert {m["name"] for m in index} == models

            health = run(sys.executable, str(DOCKER_DIR / "healthcheck.py"), check=False,
                         env={"BATCHLINE_HTTP_PORT": str(port), "BATCHLINE_HOST": env["BATCHLINE_HOST"]})
            assert health.returncode == 0, health.stderr

            statuses: list[int] = []
            body = {"inputs": [{"name": "text", "shape": [8, 1], "datatype": "BYTES", "data": _texts(8)}]}

            def send() -> None:
                try:
                    statuses.append(httpx.post(f"{url}/v2/models/minilm/infer", json=body, timeout=60).status_code)
                except httpx.HTTPError as exc:
                    statuses.append(-1)
                    print("request failed:", exc)

            senders = [threading.Thread(target=send) for _ in range(6)]
            for sender in senders:
                sender.start()

            def pending() -> float:
                text = httpx.get(f"{url}/metrics", timeout=5).text
                match = re.search(r'^batchline_pending_requests\{model="minilm",version="1"\} (\S+)$', text, re.MULTILINE)
                return float(match.group(1)) if match else 0.0

            def all_taken_in() -> bool:  # every request admitted, at least two not yet answered
                answered = len(statuses)  # read first: one answered in between is then counted in neither
                waiting = pending()
                return waiting >= 2 and waiting + answered >= len(senders)

            deadline = time.monotonic() + 30
            while not all_taken_in() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert all_taken_in(), f"the requests were not all in flight: {pending()} pending, {statuses} answered"
            process.send_signal(signal.SIGTERM)
            for sender in senders:
                sender.join(timeout=60)
            assert process.wait(timeout=45) == 0  # a clean stop, after the drain
            assert statuses == [200] * 6, f"requests in flight at SIGTERM: {statuses}"
            log.seek(0)
            assert "Traceback" not in log.read()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


# ---- the real build (opt-in: BATCHLINE_IMAGE_TESTS=1, or BATCHLINE_IMAGE=TAG) ----------------
def _duration_ns(text: str) -> int:
    match = re.fullmatch(r"(\d+)s", text)
    assert match, text
    return int(match.group(1)) * 1_000_000_000


@pytest.mark.image
def test_the_built_image_is_the_dockerfiles(dockerfile) -> None:  # type: ignore[no-untyped-def]
    """Built by scripts/image.sh with the engine found here, the image's configuration is what
    the runtime stage says: command, user, environment, port, stop signal, health check."""
    from tests.image.engine import healthcheck_of, image_under_test, inspect_image

    _, stages = dockerfile
    runtime = stages["runtime"]
    inspected = inspect_image(image_under_test())
    config = inspected["Config"]
    assert config["Cmd"] == runtime.one("CMD").exec_form()
    assert config["User"] == runtime.one("USER").arguments
    assert config["WorkingDir"] == runtime.one("WORKDIR").arguments
    assert config["StopSignal"] == runtime.one("STOPSIGNAL").arguments
    assert all(f"{port}/tcp" in config["ExposedPorts"] for port in runtime.one("EXPOSE").arguments.split())
    env = dict(pair.split("=", 1) for pair in config["Env"])
    for key, value in {**stages["base"].env(), **runtime.env()}.items():
        if "$" not in value:
            assert env.get(key) == value, key
    assert env["PATH"].startswith("/opt/venv/bin:")
    healthcheck = runtime.one("HEALTHCHECK").arguments
    command = Instruction("HEALTHCHECK", healthcheck[healthcheck.index("CMD "):]).exec_form()
    built = healthcheck_of(inspected)
    assert built["Test"] == ["CMD", *command]
    options = dict(re.findall(r"--([a-z-]+)=(\S+)", healthcheck))
    assert built["Interval"] == _duration_ns(options["interval"])
    assert built["Timeout"] == _duration_ns(options["timeout"])
    assert built["StartPeriod"] == _duration_ns(options["start-period"])
    assert built["Retries"] == int(options["retries"])
