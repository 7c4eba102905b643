"""Who may reach which port of the pods: the NetworkPolicy's ingress rules against the Deployment's named container
ports, the client Service's ports, and the pods' own ServiceAccount. Rendered with kustomize, as deployed."""

from __future__ import annotations

import pytest

from tests.deploy.support import INSTALL_HINT, container, container_port, kustomize_command, one, render
from tests.tools import needs_tool

requires_kustomize = needs_tool(None if kustomize_command() else f"no kustomize/kubectl: {INSTALL_HINT}")
OVERLAYS = ("deploy/base", "deploy/overlays/cpu", "deploy/overlays/gpu")
CLIENT_LABEL = {"indexer.deepseek.dev/client": "true"}
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}
# The kubelet probes these from the node (most CNIs let a node's own traffic through any policy): no pod may.
PROBE_ONLY = {"grpc-health"}


def ingress_rules(policy: dict) -> list[tuple[list[dict], set[str]]]:
    """(from, named ports) of each rule."""
    return [(rule["from"], {port["port"] for port in rule["ports"]}) for rule in policy["spec"]["ingress"]]


@requires_kustomize
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_network_policy_opens_each_named_port_to_its_callers_only(overlay: str) -> None:
    objects = render(overlay)
    deployment = one(objects, "Deployment")
    c = container(deployment)
    policy = one(objects, "NetworkPolicy")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]

    protocols = {p["name"]: p["protocol"] for p in c["ports"]}
    for rule in policy["spec"]["ingress"]:
        for port in rule["ports"]:
            assert isinstance(port["port"], str), f"{port}: name the container port, so a renumbering follows"
            assert port["protocol"] == protocols[port["port"]], port
    rules = ingress_rules(policy)
    # Every container port is opened to pods by name, except the probe-only one.
    assert set().union(*(ports for _, ports in rules)) == set(protocols) - PROBE_ONLY
    by_ports = {frozenset(ports): peers for peers, ports in rules}
    assert by_ports[frozenset({"grpc", "http-rpc"})] == [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": CLIENT_LABEL}}
    ]
    assert by_ports[frozenset({"http-metrics"})] == [{"namespaceSelector": {"matchLabels": MONITORING}}]
    # The probes ask exactly the probe-only port, and the PodMonitor scrapes a port Prometheus' namespace may reach.
    probe_ports = {c[kind]["grpc"]["port"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probe_ports == {container_port(c, name) for name in PROBE_ONLY}
    if any(o["kind"] == "PodMonitor" for o in objects):
        endpoints = one(objects, "PodMonitor")["spec"]["podMetricsEndpoints"]
        assert {e["port"] for e in endpoints} <= {"http-metrics"}


@requires_kustomize
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_clients_see_the_rpc_ports_only(overlay: str) -> None:
    objects = render(overlay)
    c = container(one(objects, "Deployment"))
    env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    assert int(env["INDEXER_HTTP_RPC_PORT"]) == container_port(c, "http-rpc")
    assert int(env["INDEXER_HTTP_PORT"]) == container_port(c, "http-metrics")
    client_service = one(objects, "Service", "indexer-headless")
    assert {p["targetPort"] for p in client_service["spec"]["ports"]} == {"grpc", "http-rpc"}


@requires_kustomize
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pods_run_as_their_own_service_account_without_a_token(overlay: str) -> None:
    objects = render(overlay)
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    account = one(objects, "ServiceAccount")
    assert pod["serviceAccountName"] == account["metadata"]["name"] != "default"
    assert account["automountServiceAccountToken"] is False and pod["automountServiceAccountToken"] is False
