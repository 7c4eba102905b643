"""The deploy artefacts against the real service: the image's precompile step and cache, the pod's command,
environment and model ConfigMap, its probes and health check, and a real Prometheus evaluating the alerts and
answering every dashboard query from a live server."""

from __future__ import annotations

import json
import math
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest

from service.client import IndexerClient
from service.config import load_config
from tests.deploy_support import (
    INSTALL_HINT,
    Prometheus,
    Server,
    alert_rules,
    base_env,
    container,
    container_port,
    dashboard_targets,
    dockerfile_arg_defaults,
    dockerfile_env,
    dockerfile_instructions,
    exec_form,
    expand_grafana,
    find_tool,
    kustomize_command,
    metric_names,
    one,
    render,
    send_traffic,
    server_shutdown_seconds,
    substitute,
)

pytestmark = pytest.mark.skipif(kustomize_command() is None, reason=f"no kustomize/kubectl: {INSTALL_HINT}")

OVERLAY = "deploy/overlays/cpu"  # the overlay whose pod this machine can run


def final_stage():
    instructions = dockerfile_instructions()
    return instructions, [i for i in instructions if i.stage == max(j.stage for j in instructions)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("deploy-live")


@pytest.fixture(scope="module")
def image_cache(workdir: Path) -> Path:
    """Runs the Dockerfile's precompile step, word for word, with the image's environment: the Triton cache
    the image ships, built here in a temporary directory."""
    instructions, final = final_stage()
    env = dockerfile_env(final)
    cache = workdir / "image-triton-cache"
    cache.mkdir()
    env["TRITON_CACHE_DIR"] = str(cache)
    step = next(i.args for i in final if i.keyword == "RUN" and "indexer-service precompile" in i.args)
    command = substitute(step, {**dockerfile_arg_defaults(instructions), **env})
    out = subprocess.run(["bash", "-c", command], env=base_env(**env), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert any(cache.rglob("*.cubin")), "precompile left no cubin in the cache"
    return cache


def pod_environment(model_config_dir: Path) -> tuple[list[str], dict[str, str]]:
    """The container's argv (image ENTRYPOINT + the Deployment's args) and its INDEXER_* environment, with the
    model ConfigMap 'mounted' into ``model_config_dir``."""
    objects = render(OVERLAY)
    deployment = one(objects, "Deployment")
    c = container(deployment)
    env = {e["name"]: e["value"] for e in c["env"]}
    mount = next(m for m in c["volumeMounts"] if m["name"] == "model-config")
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "model-config")
    configmap = one(objects, "ConfigMap", volume["configMap"]["name"])
    for key, text in configmap["data"].items():
        (model_config_dir / key).write_text(text)
    env["INDEXER_MODEL_CONFIG"] = env["INDEXER_MODEL_CONFIG"].replace(mount["mountPath"], str(model_config_dir))
    _, final = final_stage()
    entrypoint = exec_form(next(i.args for i in final if i.keyword == "ENTRYPOINT"))
    return [*entrypoint, *c["args"]], env


@pytest.fixture(scope="module")
def pod(workdir: Path, image_cache: Path):
    """A server started the way the CPU pod starts it, from the image's cache (only the listen addresses differ:
    127.0.0.1 and kernel-chosen ports)."""
    (workdir / "model").mkdir()
    argv, env = pod_environment(workdir / "model")
    before = sorted(p.relative_to(image_cache) for p in image_cache.rglob("*"))
    server = Server(workdir, "pod", argv, TRITON_CACHE_DIR=str(image_cache), **env)
    try:
        server.wait_ready()
        server.cache_before = before
        yield server
    finally:
        server.stop()


def test_served_warmup_loads_the_image_cache(pod: Server, image_cache: Path) -> None:
    samples = pod.samples()
    states = {labels["state"]: value for labels, value in samples["indexer_warmup_keys"]}
    assert states["planned"] == states["compiled"] == 3 and states["failed"] == 0
    seconds = sorted(value for _, value in samples["indexer_warmup_key_compile_seconds"])
    # A compile costs 0.2 s and more a key here, a cache load a few milliseconds; the first key also pays for
    # Triton's start-up, so only the others can tell the two apart.
    assert seconds[-2] < 0.05, f"warmup compiled instead of loading the image's cache: {seconds}"
    # Nothing was compiled: the cache holds exactly what the image build put there.
    assert sorted(p.relative_to(image_cache) for p in image_cache.rglob("*")) == pod.cache_before


def test_pod_config_matches_its_ports_and_shutdown(workdir: Path) -> None:
    """What the server makes of the pod's environment is what the Deployment and the image assume."""
    (workdir / "model-config-check").mkdir()
    _, env = pod_environment(workdir / "model-config-check")
    config = load_config(env=env)
    c = container(one(render(OVERLAY), "Deployment"))
    assert config.grpc_port == container_port(c, "grpc")
    assert config.http_port == container_port(c, "http-metrics")
    _, final = final_stage()
    assert {config.grpc_port, config.http_port} == {
        int(p) for i in final if i.keyword == "EXPOSE" for p in i.args.split()
    }
    # The static timing test (preStop + drain < terminationGracePeriodSeconds) reads the drain from the TOML
    # defaults and the pod's env; this is the server's own loader agreeing with it.
    drain = config.shutdown_delay_seconds + config.shutdown_grace_seconds
    assert drain == server_shutdown_seconds(env) > 0


def test_model_configmap_yields_the_warmup_set_the_image_precompiled(workdir: Path) -> None:
    (workdir / "model-keys").mkdir()
    _, env = pod_environment(workdir / "model-keys")

    def keys(**extra: str) -> list[dict]:
        out = subprocess.run(
            ["indexer-service", "keys"], env=base_env(**extra), capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        return [json.loads(line) for line in out.stdout.splitlines()]

    from_configmap = keys(INDEXER_MODEL_CONFIG=env["INDEXER_MODEL_CONFIG"])
    # precompile in the image runs with the embedded default, so the pod only hits the cache if these agree.
    assert from_configmap == keys()
    assert sorted(k["compress_ratio"] for k in from_configmap) == [1, 4, 128]


def test_probes_ask_what_the_server_serves(pod: Server) -> None:
    c = container(one(render(OVERLAY), "Deployment"))
    with IndexerClient(pod.address, max_attempts=1, health_check=False) as client:
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert client.health(c[kind]["grpc"]["service"]) == "SERVING", kind
        # An unknown name must fail, or the check above would prove nothing.
        with pytest.raises(grpc.RpcError) as unknown:
            client.health("no.such.Service")
        assert unknown.value.code() is grpc.StatusCode.NOT_FOUND
    pod_monitor = one(render(OVERLAY), "PodMonitor")
    for endpoint in pod_monitor["spec"]["podMetricsEndpoints"]:
        assert pod.http(endpoint["path"])[0] == 200
    assert pod.http("/readyz")[0] == 200 and pod.http("/livez")[0] == 200


def test_image_healthcheck_command(pod: Server) -> None:
    _, final = final_stage()
    healthcheck = next(i.args for i in final if i.keyword == "HEALTHCHECK")
    argv = json.loads(healthcheck[healthcheck.index("CMD") + 3 :])
    ok = subprocess.run(argv, env=base_env(INDEXER_GRPC_PORT=str(pod.grpc_port)), capture_output=True, timeout=60)
    assert ok.returncode == 0, ok.stdout
    assert b"SERVING" in ok.stdout
    # The same command against a port with no server must report unhealthy.
    dead = subprocess.run(argv, env=base_env(INDEXER_GRPC_PORT="1"), capture_output=True, timeout=60)
    assert dead.returncode != 0


def test_every_metric_of_the_alerts_and_the_dashboard_is_exported(pod: Server) -> None:
    with IndexerClient(pod.address) as client:
        send_traffic(client, 2)
    exported = set(pod.samples())
    wanted = {name for rule in alert_rules() for name in metric_names(rule["expr"])}
    wanted |= {name for _, expr in dashboard_targets() for name in metric_names(expr)}
    assert wanted, "no metric found in the alerts and the dashboard"
    assert wanted <= exported, f"named but not exported: {sorted(wanted - exported)}"


@pytest.mark.skipif(find_tool("prometheus") is None, reason=f"no prometheus: {INSTALL_HINT}")
def test_prometheus_scrapes_the_server_and_answers_every_dashboard_query(pod: Server, workdir: Path) -> None:
    (workdir / "prometheus").mkdir()
    prometheus = Prometheus(workdir / "prometheus", [f"127.0.0.1:{pod.http_port}"])
    stop = threading.Event()
    errors: list[BaseException] = []

    def traffic() -> None:
        # Rates need increases inside the query window: keep calls coming (bounded by the deadline below).
        deadline = time.monotonic() + 60
        try:
            with IndexerClient(pod.address) as client:
                while not stop.is_set() and time.monotonic() < deadline:
                    send_traffic(client, 1)
                    time.sleep(0.05)
        except BaseException as exc:
            errors.append(exc)

    sender = threading.Thread(target=traffic, daemon=True)
    sender.start()
    try:
        queries = [(title, expand_grafana(expr)) for title, expr in dashboard_targets()]
        pending = dict(enumerate(queries))
        deadline = time.monotonic() + 45
        while pending and time.monotonic() < deadline:
            for n, (_, expr) in list(pending.items()):
                result = prometheus.query(expr)
                if any(math.isfinite(float(series["value"][1])) for series in result):
                    del pending[n]
            time.sleep(0.5)
        assert not pending, f"dashboard queries without data: {[queries[n] for n in pending]}\n{prometheus.proc.log()}"

        # The rules load in plain Prometheus and evaluate cleanly on live data; a healthy server fires nothing,
        # not even with the caller's INVALID_ARGUMENT errors in the mix.
        rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
        assert {r["name"] for r in rules} == {r["alert"] for r in alert_rules()}
        assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
        assert prometheus.api("alerts")["alerts"] == []
    finally:
        stop.set()
        sender.join(10)
        prometheus.stop()
    assert not errors, errors
