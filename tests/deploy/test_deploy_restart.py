"""Whatever runs the server restarts it when it exits (it exits 1 when its engine dies)."""

from __future__ import annotations

from test_deploy_manifests import REPO_ROOT, k8s_documents, load_compose

RESTARTING = {"always", "unless-stopped", "on-failure"}


def test_compose_restarts_the_server_on_both_machines() -> None:
    assert load_compose("docker-compose.yml")["services"]["server"]["restart"] in RESTARTING
    assert "restart" not in load_compose("docker-compose.cpu.yml")["services"]["server"]


def test_kubernetes_restarts_the_pod_and_probes_it() -> None:
    pod = k8s_documents()["Deployment"]["spec"]["template"]["spec"]
    assert pod.get("restartPolicy", "Always") == "Always"
    (server,) = pod["containers"]
    assert {"livenessProbe", "readinessProbe"} <= server.keys()


def test_the_docker_instructions_give_a_restart_policy() -> None:
    readme = (REPO_ROOT / "deploy" / "README.md").read_text()
    runs = [line for line in readme.splitlines() if line.startswith("docker run")]
    assert runs
    assert all("--restart unless-stopped" in line for line in runs)
    for dockerfile in ("Dockerfile", "Dockerfile.cpu"):
        assert "--restart unless-stopped" in (REPO_ROOT / dockerfile).read_text()
