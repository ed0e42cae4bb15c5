#!/usr/bin/env bash
# Build and run the images with Debian's podman, as a user would with Docker: CI's check that
# the documented container commands work (.ci/run calls it after the tests).
#
#   scripts/container_check.sh
#
# CPU image: builds Dockerfile.cpu, starts it with deploy/README.md's documented CPU
# `docker run` command (docker -> podman, detached, host port $NTS_CHECK_PORT), waits for
# /health, sends a chat completion with the `openai` client, fetches the status page and
# /v1/nts/status, runs the image's HEALTHCHECK command, stops the container.
# GPU image: builds Dockerfile against a stand-in base passed as VLLM_IMAGE, and runs its entry
# point with --help (nothing more can be checked without a GPU).
#
# Stand-ins, because Docker Hub is not reachable from CI:
# - the CPU image's base `python:3.11-slim-bookworm` is a debootstrap of Debian bookworm with
#   Debian's python3 and pip, imported under that name; the official image is the same Debian
#   release with its own build of Python 3.11;
# - the GPU image's base `vllm/vllm-openai` is the CPU image as root, with a `vllm` distribution
#   record at the version the Dockerfile pins; it checks the GPU Dockerfile's own steps only.
#
# Build-time network: pip reaches its index with this machine's CA bundle and its local wheel
# folder (find-links; the CPU torch wheel lies there), mounted into the build's RUN steps only,
# never into an image layer. TORCH_INDEX_URL is PyPI: the torch wheel comes from find-links.
#
# Needs root (or sudo) for apt and rootful podman. Exits non-zero on the first failure.
# Environment: NTS_CHECK_PORT (default 8000), NTS_CHECK_START_TIMEOUT_S (default 1200),
# NTS_CHECK_WORKDIR (default: a fresh temporary folder), NTS_VENV (default .venv: the client's
# Python, with the `openai` package).
set -euo pipefail
cd "$(dirname "$0")/.."

port=${NTS_CHECK_PORT:-8000}
start_timeout_s=${NTS_CHECK_START_TIMEOUT_S:-1200}
venv=${NTS_VENV:-.venv}
work=${NTS_CHECK_WORKDIR:-$(mktemp -d -t nts-container-check.XXXXXX)}
cpu_image=localhost/noisy-temp-server:cpu
gpu_image=localhost/noisy-temp-server:gpu-check
container=nts-container-check
t0=$SECONDS
started=$SECONDS
phase() { echo "container-check: $1 took $((SECONDS - t0)) s"; t0=$SECONDS; }
fail() { echo "container-check: FAILED: $*" >&2; exit 1; }

sudo_cmd=()
(( EUID == 0 )) || sudo_cmd=(sudo)
# `env` runs the podman program, not this function.
podman() { "${sudo_cmd[@]}" env CONTAINERS_CONF="$work/containers.conf" podman "$@"; }
# --format docker: the OCI image format has no HEALTHCHECK, and podman would drop it.
build() { podman build --format docker --pull=never "$@"; }

install_tools() {
    local missing=()
    for tool in podman runc debootstrap; do
        command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
    done
    (( ${#missing[@]} )) || return 0
    echo "container-check: installing ${missing[*]} (apt)"
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq \
        --no-install-recommends podman runc debootstrap uidmap iptables >/dev/null
}

write_containers_conf() {
    # runc: crun's cgroup handling fails in CI's sandbox. The ulimits: podman's defaults are
    # the host's hard limits, which a nested sandbox may not raise to.
    cat >"$work/containers.conf" <<'EOF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
}

# What Debian's own slim image sets up, so that the stand-in and the layers built on it weigh
# what they would on the official base: apt keeps no package caches or downloaded packages
# (docker-clean), dpkg installs no documentation, manual pages or translations. Only ever
# called on the debootstrap folder.
slim_like_debian_image() {
    local root=$1
    [[ -n "$root" && "$root" != / && -d "$root/etc/apt" ]] || fail "not a debootstrap folder: $root"
    local clean='rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb'
    clean+=' /var/cache/apt/*.bin || true'
    printf '%s\n' "DPkg::Post-Invoke { \"$clean\"; };" "APT::Update::Post-Invoke { \"$clean\"; };" \
        'Dir::Cache::pkgcache "";' 'Dir::Cache::srcpkgcache "";' \
        | "${sudo_cmd[@]}" tee "$root/etc/apt/apt.conf.d/docker-clean" >/dev/null
    printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-include /usr/share/doc/*/copyright' \
        'path-exclude /usr/share/man/*' 'path-exclude /usr/share/locale/*' \
        | "${sudo_cmd[@]}" tee "$root/etc/dpkg/dpkg.cfg.d/docker" >/dev/null
    "${sudo_cmd[@]}" find "$root/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
    "${sudo_cmd[@]}" rm -rf "$root/usr/share/man" "$root/usr/share/locale" \
        "$root/var/cache/apt/archives" "$root/var/lib/apt/lists"
    "${sudo_cmd[@]}" mkdir -p "$root/usr/share/man" "$root/usr/share/locale" \
        "$root/var/cache/apt/archives/partial" "$root/var/lib/apt/lists/partial"
}

build_python_standin() {
    local root="$work/bookworm"
    if podman image exists python:3.11-slim-bookworm; then
        echo "container-check: base python:3.11-slim-bookworm already present"
        return 0
    fi
    "${sudo_cmd[@]}" debootstrap --variant=minbase \
        --include=python3,python3-pip,python-is-python3,ca-certificates \
        bookworm "$root" http://deb.debian.org/debian >"$work/debootstrap.log" \
        || fail "debootstrap (log: $work/debootstrap.log)"
    # The official image's Python is not Debian's, so pip may install into it system-wide.
    "${sudo_cmd[@]}" rm -f "$root"/usr/lib/python3*/EXTERNALLY-MANAGED
    slim_like_debian_image "$root"
    "${sudo_cmd[@]}" tar -C "$root" -c . | podman import \
        --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' \
        - python:3.11-slim-bookworm >/dev/null
    "${sudo_cmd[@]}" rm -rf "$root"
}

# podman build arguments that give the RUN steps this machine's pip configuration.
pip_build_mounts=()
prepare_pip_mounts() {
    local ca wheels
    ca=$("$venv/bin/python" -m pip config get global.cert 2>/dev/null \
        || echo "${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}")
    wheels=${PIP_FIND_LINKS:-$("$venv/bin/python" -m pip config get global.find-links \
        2>/dev/null || true)}
    {
        echo "[global]"
        echo "cert = /etc/nts-build/ca.crt"
        [[ -d "$wheels" ]] && echo "find-links = /etc/nts-build/wheels"
    } >"$work/pip.conf"
    pip_build_mounts=(--volume "$work/pip.conf:/etc/pip.conf:ro"
        --volume "$ca:/etc/nts-build/ca.crt:ro")
    [[ -d "$wheels" ]] && pip_build_mounts+=(--volume "$wheels:/etc/nts-build/wheels:ro")
    return 0
}

build_cpu_image() {
    build "${pip_build_mounts[@]}" \
        --build-arg TORCH_INDEX_URL=https://pypi.org/simple \
        -f Dockerfile.cpu -t "$cpu_image" . >"$work/build-cpu.log" 2>&1 \
        || { tail -40 "$work/build-cpu.log" >&2; fail "building Dockerfile.cpu"; }
    echo "container-check: image size $(podman image inspect --format '{{.Size}}' "$cpu_image" \
        | awk '{printf "%.2f GB", $1 / 1e9}')"
}

# deploy/README.md's CPU `docker run` command, continuation lines joined, as podman arguments
# (detached, named, on $port), e.g. `run --restart unless-stopped --ipc=host -p ...`.
documented_cpu_run() {
    "$venv/bin/python" - "$port" "$container" <<'EOF'
import re, shlex, sys
port, name = sys.argv[1:]
text = open("deploy/README.md").read().replace("\\\n", " ")
(line,) = [l for l in text.splitlines() if l.startswith("docker run") and l.split()[-1].endswith(":cpu")]
words = shlex.split(line)[2:]
words = [f"{port}:8000" if w == "8000:8000" else w for w in words]
print(shlex.join(["run", "--detach", "--name", name, *words[:-1], "localhost/" + words[-1]]))
EOF
}

run_cpu_container() {
    local run_args
    run_args=$(documented_cpu_run)
    echo "container-check: podman $run_args"
    podman rm --force --ignore "$container" >/dev/null
    podman volume rm --force nts-cache >/dev/null 2>&1 || true
    eval "podman $run_args" >/dev/null || fail "starting the container"
    local deadline=$((SECONDS + start_timeout_s))
    until curl -fsS "http://127.0.0.1:$port/health" >/dev/null 2>&1; do
        [[ "$(podman inspect --format '{{.State.Running}}' "$container")" == true ]] \
            || { podman logs --tail 60 "$container" >&2; fail "the container exited"; }
        (( SECONDS < deadline )) \
            || { podman logs --tail 60 "$container" >&2; fail "no /health in ${start_timeout_s} s"; }
        sleep 5
    done
}

exercise_cpu_container() {
    local key
    key=$(podman inspect --format '{{range .Config.Env}}{{println .}}{{end}}' "$container" \
        | sed -n 's/^NTS_API_KEY=//p')
    NTS_CHECK_KEY=$key "$venv/bin/python" - "$port" <<'EOF' || fail "the clients' requests"
import os, sys
import httpx, openai
base = f"http://127.0.0.1:{sys.argv[1]}"
key = os.environ["NTS_CHECK_KEY"] or "none"
client = openai.OpenAI(base_url=f"{base}/v1", api_key=key)
(model,) = [m.id for m in client.models.list().data]
reply = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8)
assert reply.choices[0].message.content, reply
page = httpx.get(f"{base}/dashboard", timeout=30)
assert page.status_code == 200 and "<html" in page.text.lower(), page.status_code
status = httpx.get(f"{base}/v1/nts/status", headers={"Authorization": f"Bearer {key}"}, timeout=30)
assert status.status_code == 200, status.text
print(f"container-check: chat completion from {model}: {reply.choices[0].message.content!r}")
EOF
    podman healthcheck run "$container" || fail "the image's HEALTHCHECK command"
    podman stop --time 30 "$container" >/dev/null || fail "stopping the container"
    podman rm "$container" >/dev/null
}

check_gpu_dockerfile() {
    local version
    version=$(sed -n 's/^ARG VLLM_IMAGE=vllm\/vllm-openai:v//p' Dockerfile)
    [[ -n "$version" ]] || fail "Dockerfile: no ARG VLLM_IMAGE=vllm/vllm-openai:v<version>"
    # The stand-in base: root, no nts user (the Dockerfile creates it), a vllm record.
    cat >"$work/Containerfile.vllm-standin" <<EOF
FROM $cpu_image
USER root
RUN userdel --remove nts && rm -rf /cache /models /profiles \\
    && site=\$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \\
    && mkdir "\$site/vllm-$version.dist-info" \\
    && printf 'Metadata-Version: 2.1\\nName: vllm\\nVersion: $version\\n' \\
        > "\$site/vllm-$version.dist-info/METADATA"
WORKDIR /
ENTRYPOINT []
EOF
    build -t localhost/nts-vllm-standin:"$version" -f "$work/Containerfile.vllm-standin" "$work" \
        >"$work/build-standin.log" 2>&1 || fail "building the GPU stand-in base"
    build "${pip_build_mounts[@]}" \
        --build-arg VLLM_IMAGE=localhost/nts-vllm-standin:"$version" \
        -f Dockerfile -t "$gpu_image" . >"$work/build-gpu.log" 2>&1 \
        || { tail -40 "$work/build-gpu.log" >&2; fail "building Dockerfile on the stand-in"; }
    podman run --rm "$gpu_image" --help >"$work/gpu-help.txt" \
        || fail "the GPU image's entry point with --help"
    grep -q -- "--served-model" "$work/gpu-help.txt" || fail "the GPU image's --help: no serve flags"
}

install_tools
mkdir -p "$work"
write_containers_conf
phase "tools (podman, runc, debootstrap)"
build_python_standin
phase "stand-in base (debootstrap)"
prepare_pip_mounts
build_cpu_image
phase "CPU image build"
run_cpu_container
phase "CPU container start to /health"
exercise_cpu_container
phase "CPU container requests, health check, stop"
check_gpu_dockerfile
phase "GPU Dockerfile on the stand-in base"
echo "container-check: passed in $((SECONDS - started)) s"
