"""docker compose stack, Grafana provisioning and Kubernetes manifests: they parse, reference
files that exist, agree with each other (ports, labels, paths, rules) and with the server's
settings.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from noisy_temp_server.settings import Settings

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy"
K8S = DEPLOY / "k8s"
SERVER_PORT = 8000


class ComposeLoader(yaml.SafeLoader):
    """Safe YAML loader that also accepts docker compose's merge tags (`!reset`, `!override`)."""


def _construct_tagged(loader: yaml.SafeLoader, _suffix: str, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node)
    return loader.construct_scalar(node)


ComposeLoader.add_multi_constructor("!", _construct_tagged)


def load_compose(name: str) -> dict[str, Any]:
    return yaml.load((DEPLOY / name).read_text(), Loader=ComposeLoader)


def dockerfile_env(dockerfile: str) -> dict[str, str]:
    """ENV of a Dockerfile (NAME=value words, continuation lines joined)."""
    text = (REPO_ROOT / dockerfile).read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            for word in shlex.split(line[4:]):
                name, _, value = word.partition("=")
                env[name] = value
    return env


def assert_settings_names(names: list[str], where: str) -> None:
    for name in names:
        field = name.removeprefix("NTS_").lower()
        assert field in Settings.model_fields, f"{where}: {name} is not a Settings field"


def bind_mounts(service: dict[str, Any]) -> list[tuple[Path, str]]:
    """(host path, container path) of the service's bind mounts (named volumes left out)."""
    mounts = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            mounts.append(((DEPLOY / source).resolve(), target))
    return mounts


# --- docker compose -------------------------------------------------------------------------


def test_compose_starts_server_prometheus_and_grafana() -> None:
    services = load_compose("docker-compose.yml")["services"]
    assert set(services) == {"server", "prometheus", "grafana"}
    server = services["server"]
    assert (DEPLOY / server["build"]["context"] / server["build"]["dockerfile"]).is_file()
    assert server["ports"] == [f"{SERVER_PORT}:{SERVER_PORT}"]
    gpu = server["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia"
    assert gpu["capabilities"] == ["gpu"]
    for env_file in server["env_file"]:
        assert env_file["required"] is False
        assert env_file["path"] == "server.env"


def test_compose_cpu_override_builds_the_cpu_image_without_the_gpu() -> None:
    base = load_compose("docker-compose.yml")["services"]["server"]
    override = load_compose("docker-compose.cpu.yml")["services"]["server"]
    assert (DEPLOY / base["build"]["context"] / override["build"]["dockerfile"]).is_file()
    assert override["build"]["dockerfile"] == "Dockerfile.cpu"
    assert "!reset" in (DEPLOY / "docker-compose.cpu.yml").read_text().split("deploy:")[1]


def test_compose_bind_mounts_exist() -> None:
    services = load_compose("docker-compose.yml")["services"]
    mounts = [m for service in services.values() for m in bind_mounts(service)]
    assert len(mounts) >= 5
    for host_path, target in mounts:
        assert host_path.exists(), f"compose mounts {host_path} at {target}; it does not exist"


def test_compose_wires_prometheus_to_the_server_and_its_rules() -> None:
    compose = load_compose("docker-compose.yml")["services"]
    mounts = {target: host for host, target in bind_mounts(compose["prometheus"])}
    config_path = next(a for a in compose["prometheus"]["command"] if "config.file" in a)
    config_in_container = config_path.split("=", 1)[1]
    config = yaml.safe_load(mounts[config_in_container].read_text())

    for rule_file in config["rule_files"]:
        in_container = str(Path(config_in_container).parent / rule_file)
        assert in_container in mounts, f"rule file {rule_file} is not mounted next to the config"
        assert mounts[in_container] == DEPLOY / "prometheus" / rule_file

    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "noisy-temp-server"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    (target,) = job["static_configs"][0]["targets"]
    assert target == f"server:{SERVER_PORT}"


def test_compose_provisions_grafana_from_files() -> None:
    grafana = load_compose("docker-compose.yml")["services"]["grafana"]
    mounts = {target: host for host, target in bind_mounts(grafana)}
    provisioning = mounts["/etc/grafana/provisioning"]

    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"

    (provider,) = yaml.safe_load(
        (provisioning / "dashboards" / "noisy-temp-server.yml").read_text()
    )["providers"]
    dashboards_dir = mounts[provider["options"]["path"]]
    assert (dashboards_dir / "noisy-temp-server.json").is_file()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/noisy-temp-server.json"


def test_compose_env_example_names_only_settings() -> None:
    text = (DEPLOY / "server.env.example").read_text()
    names = re.findall(r"^#?\s*(NTS_\w+)=", text, flags=re.MULTILINE)
    assert len(names) >= 5
    assert_settings_names(names, "deploy/server.env.example")


# --- Kubernetes -----------------------------------------------------------------------------


def k8s_documents() -> dict[str, dict[str, Any]]:
    """kind -> document, over every manifest of deploy/k8s listed in its kustomization."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present, "kustomization.yaml must list exactly the manifests in deploy/k8s"
    documents: dict[str, dict[str, Any]] = {}
    for name in sorted(listed):
        for document in yaml.safe_load_all((K8S / name).read_text()):
            assert document["kind"] not in documents, f"two {document['kind']} manifests"
            documents[document["kind"]] = document
    return documents


@pytest.fixture(scope="module")
def k8s() -> dict[str, dict[str, Any]]:
    return k8s_documents()


@pytest.fixture(scope="module")
def server_container(k8s: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (container,) = k8s["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def test_deployment_runs_several_gpu_replicas(
    k8s: dict[str, dict[str, Any]], server_container: dict[str, Any]
) -> None:
    spec = k8s["Deployment"]["spec"]
    assert spec["replicas"] >= 2
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    resources = server_container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
    security = spec["template"]["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True
    uid = re.search(r"^USER (\d+)", (REPO_ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert uid
    assert security["runAsUser"] == int(uid[1])


def test_deployment_probes_health_and_exposes_the_api_port(
    server_container: dict[str, Any],
) -> None:
    (port,) = server_container["ports"]
    assert port == {"name": "http", "containerPort": SERVER_PORT}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server_container[probe]["httpGet"] == {"path": "/health", "port": "http"}


def test_deployment_volumes_match_the_image(
    k8s: dict[str, dict[str, Any]], server_container: dict[str, Any]
) -> None:
    volumes = {v["name"]: v for v in k8s["Deployment"]["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["name"]: m for m in server_container["volumeMounts"]}
    assert set(mounts) == set(volumes)
    image_env = dockerfile_env("Dockerfile")
    by_path = {m["mountPath"]: name for name, m in mounts.items()}

    multiproc = by_path[image_env["PROMETHEUS_MULTIPROC_DIR"]]
    assert volumes[multiproc]["emptyDir"]["medium"] == "Memory"
    assert volumes[by_path[image_env["NTS_CACHE_DIR"]]].get("emptyDir") is not None

    env = {e["name"]: e for e in server_container["env"]}
    profile = Path(env["NTS_PROFILE"]["value"])
    profile_volume = by_path[str(profile.parent)]
    assert mounts[profile_volume]["readOnly"] is True
    assert volumes[profile_volume]["configMap"]["name"] == "noisy-temp-server-profile"
    assert "--from-file=profile.json=" in (K8S / "deployment.yaml").read_text()
    assert profile.name == "profile.json"


def test_deployment_env_names_only_settings(server_container: dict[str, Any]) -> None:
    names = [e["name"] for e in server_container["env"]]
    assert_settings_names([n for n in names if n.startswith("NTS_")], "deploy/k8s/deployment.yaml")
    assert all(n.startswith("NTS_") for n in names)
    secret = next(e for e in server_container["env"] if e["name"] == "NTS_API_KEY")
    assert secret["valueFrom"]["secretKeyRef"]["optional"] is False  # opting out is explicit


def test_service_and_service_monitor_reach_the_pods(
    k8s: dict[str, dict[str, Any]], server_container: dict[str, Any]
) -> None:
    pod_labels = k8s["Deployment"]["spec"]["template"]["metadata"]["labels"]
    service = k8s["Service"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (service_port,) = service["spec"]["ports"]
    assert service_port["targetPort"] == server_container["ports"][0]["name"]

    monitor = k8s["ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service_port["name"]
    assert endpoint["path"] == "/metrics"
    # The operator names the job after the Service; the alerts select job="noisy-temp-server".
    assert service["metadata"]["name"] == "noisy-temp-server"
    assert "jobLabel" not in monitor["spec"]


def test_prometheus_rule_carries_the_alerts_file(
    k8s: dict[str, dict[str, Any]], alert_groups: list[dict[str, Any]]
) -> None:
    rule = k8s["PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"]["groups"] == alert_groups, (
        "deploy/k8s/prometheusrule.yaml spec.groups differs from deploy/prometheus/alerts.yml; "
        "copy the groups over"
    )


def test_the_shared_clean_overlay_points_every_replica_at_one_clean_server() -> None:
    overlay = DEPLOY / "k8s-shared-clean"
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["../k8s", "clean-scorer.yaml"]
    (patch,) = kustomization["patches"]
    assert patch["target"] == {"kind": "Deployment", "name": "noisy-temp-server"}
    (container,) = yaml.safe_load(patch["patch"])["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert_settings_names(list(env), "k8s-shared-clean patch")
    assert env["NTS_CLEAN_BACKEND"] == "remote"
    documents = {
        d["kind"]: d for d in yaml.safe_load_all((overlay / "clean-scorer.yaml").read_text())
    }
    service = documents["Service"]
    (port,) = service["spec"]["ports"]
    assert env["NTS_CLEAN_URL"] == f"http://{service['metadata']['name']}:{port['port']}"
    pod = documents["Deployment"]["spec"]["template"]
    assert service["spec"]["selector"] == pod["metadata"]["labels"]
    (vllm,) = pod["spec"]["containers"]
    assert "--max-logprobs=-1" in vllm["args"]
    assert f"--served-model-name={env['NTS_CLEAN_REMOTE_MODEL']}" in vllm["args"]
    assert vllm["image"].startswith("vllm/vllm-openai:")
    # the clean scorer's pods are not behind the served model's Service
    served_selector = k8s_documents()["Service"]["spec"]["selector"]
    assert not served_selector.items() <= pod["metadata"]["labels"].items()
