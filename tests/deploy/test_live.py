"""The deploy artefacts against the real service: the image's precompile step and cache, the pod's init
container seeding a writable copy of it under a read-only root, the pod's command, environment and model
ConfigMap, its probes and health check (TLS on too), and a real Prometheus evaluating the alerts and answering
every dashboard query from a live server."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest
import trustme

from indexer_service.client import IndexerClient
from indexer_service.service.config import load_config
from indexer_service.service.reasons import RestartReason
from tests.deploy.support import (
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
    send_expired_call,
    send_expiring_call,
    send_traffic,
    send_warmup_miss,
    server_shutdown_seconds,
    substitute,
    wait_for,
)
from tests.tools import needs_tool

pytestmark = needs_tool(None if kustomize_command() else f"no kustomize/kubectl: {INSTALL_HINT}")

OVERLAY = "deploy/overlays/cpu"  # the overlay whose pod this machine can run


def final_stage():
    instructions = dockerfile_instructions()
    return instructions, [i for i in instructions if i.stage == max(j.stage for j in instructions)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("deploy-live")


@pytest.fixture(scope="module")
def image_cache(workdir: Path):
    """Runs the Dockerfile's precompile step, word for word, with the image's environment: the Triton cache
    the image ships, built here in a temporary directory."""
    instructions, final = final_stage()
    # The image's PATH leads to its virtual environment; here the tests' own venv plays that part (base_env).
    env = {name: value for name, value in dockerfile_env(final).items() if name != "PATH"}
    cache = workdir / "image-triton-cache"
    cache.mkdir()
    env["TRITON_CACHE_DIR"] = str(cache)
    step = next(i.args for i in final if i.keyword == "RUN" and "indexer-service precompile" in i.args)
    command = substitute(step, {**dockerfile_arg_defaults(instructions), **env})
    out = subprocess.run(["bash", "-c", command], env=base_env(**env), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert any(cache.rglob("*.cubin")), "precompile left no cubin in the cache"
    # In the pod the image's files are on a read-only root filesystem: nothing may need to write here.
    set_writable(cache, False)
    try:
        yield cache
    finally:
        set_writable(cache, True)


def set_writable(root: Path, writable: bool) -> None:
    """chmod u+w / a-w on ``root`` and everything below it (the closest this machine gets to a read-only mount
    without Docker: the tests run as an ordinary user, so a read-only mode is enforced)."""
    for path in [root, *root.rglob("*")]:
        mode = path.stat().st_mode
        path.chmod(mode | stat.S_IWUSR if writable else mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def seed_cache(image_cache: Path, volume: Path) -> Path:
    """Runs the Deployment's init container command, word for word, with the image's TRITON_CACHE_DIR pointing
    at ``image_cache`` and its emptyDir at ``volume``."""
    init = one(render(OVERLAY), "Deployment")["spec"]["template"]["spec"]["initContainers"][0]
    env = {e["name"]: e["value"] for e in init.get("env", [])}
    (mount,) = init["volumeMounts"]
    env[next(k for k, v in env.items() if v == mount["mountPath"])] = str(volume)
    volume.mkdir()
    out = subprocess.run(
        init["command"], env=base_env(TRITON_CACHE_DIR=str(image_cache), **env), capture_output=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return volume


def read_only_root(writable: list[Path]) -> list[str] | None:
    """An argv prefix that runs a command the way the pod does: in its own mount namespace, with the root file
    system (and the mounts holding the repo and the venv, the "image") read-only, except ``writable`` (the
    pod's emptyDirs). None where this machine cannot make mount namespaces (not root, no user namespaces)."""
    if shutil.which("unshare") is None or shutil.which("findmnt") is None:
        return None
    if subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=10).returncode != 0:
        return None

    def mount_of(path: Path) -> str:
        out = subprocess.run(["findmnt", "-n", "-o", "TARGET", "--target", str(path)], capture_output=True, text=True)
        return out.stdout.strip()

    read_only = sorted({"/", mount_of(Path(__file__)), mount_of(Path(sys.prefix))} - {""})
    script = " && ".join(
        [
            "mount --make-rprivate /",
            *(f"mount --bind {shlex.quote(str(p))} {shlex.quote(str(p))}" for p in writable),
            *(f"mount -o remount,bind,ro {shlex.quote(m)}" for m in read_only),
            'exec "$@"',
        ]
    )
    return ["unshare", "-m", "sh", "-c", script, "sh"]


def tree(root: Path) -> list[Path]:
    return sorted(p.relative_to(root) for p in root.rglob("*"))


def pod_environment(model_config_dir: Path, cache_volume: Path | None = None) -> tuple[list[str], dict[str, str]]:
    """The container's argv (image ENTRYPOINT + the Deployment's args) and its environment, with the model
    ConfigMap 'mounted' into ``model_config_dir`` and the Triton cache volume at ``cache_volume``."""
    objects = render(OVERLAY)
    deployment = one(objects, "Deployment")
    c = container(deployment)
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    for e in c["env"]:  # the downward API's requests.cpu, as the kubelet resolves it: rounded up to the divisor
        if "resourceFieldRef" in e.get("valueFrom", {}):
            field = e["valueFrom"]["resourceFieldRef"]
            cpu = str(c["resources"]["requests"][field["resource"].split(".")[1]])
            cores = int(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
            env[e["name"]] = str(math.ceil(cores / float(field["divisor"])))
    mount = next(m for m in c["volumeMounts"] if m["name"] == "model-config")
    volume = next(v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "model-config")
    configmap = one(objects, "ConfigMap", volume["configMap"]["name"])
    for key, text in configmap["data"].items():
        (model_config_dir / key).write_text(text)
    env["INDEXER_MODEL_CONFIG"] = env["INDEXER_MODEL_CONFIG"].replace(mount["mountPath"], str(model_config_dir))
    if cache_volume is not None:
        env["TRITON_CACHE_DIR"] = str(cache_volume)
    _, final = final_stage()
    entrypoint = exec_form(next(i.args for i in final if i.keyword == "ENTRYPOINT"))
    return [*entrypoint, *c["args"]], env


@pytest.fixture(scope="module")
def pod(workdir: Path, image_cache: Path):
    """A server started the way the CPU pod starts it under a read-only root: the init container seeds the
    cache volume from the (read-only) image cache, then the server runs on that volume with a read-only home and
    a writable /tmp. Only the listen addresses differ: 127.0.0.1 and kernel-chosen ports."""
    (workdir / "model").mkdir()
    volume = seed_cache(image_cache, workdir / "pod-triton-cache")
    argv, env = pod_environment(workdir / "model", volume)
    home, tmp, run = workdir / "pod-home", workdir / "pod-tmp", workdir / "pod-run"
    for path in (home, tmp, run):
        path.mkdir()
    home.chmod(0o555)
    before = tree(volume)
    image_before = tree(image_cache)
    # Writable: the cache volume, /tmp, and the directory of the port file the tests read the ports from.
    prefix = read_only_root([volume, tmp, run])
    server = Server(run, "pod", [*(prefix or []), *argv], HOME=str(home), TMPDIR=str(tmp), **env)
    server.read_only_root = prefix
    try:
        server.wait_ready()
        server.cache_before, server.image_cache_before, server.cache_volume = before, image_before, volume
        yield server
    finally:
        server.stop()
        home.chmod(0o755)


def test_served_warmup_loads_the_seeded_image_cache(pod: Server, image_cache: Path) -> None:
    # The seed is a full copy of what the image build compiled.
    assert pod.cache_before == pod.image_cache_before
    samples = pod.samples()
    states = {labels["state"]: value for labels, value in samples["indexer_warmup_keys"]}
    assert states["planned"] == states["cached"] == 3 and states["compiled"] == states["failed"] == 0
    # Each key as the warmup logged it: loaded from the cache, by Triton's own word (its compilation listener's
    # cache hit), not compiled; no timing, so no other test of the run can skew it.
    sources = re.findall(r"warmup \d/3 key=\S+ seconds=[\d.]+ source=(\w+)", pod.log())
    assert sources == ["cache"] * 3, f"warmup compiled instead of loading the seeded cache: {sources}"
    # Nothing was compiled: the volume holds exactly what the image build put there, and the image's own cache
    # (read-only, as on the pod's root filesystem) was never needed for writing.
    assert tree(pod.cache_volume) == pod.cache_before
    assert tree(image_cache) == pod.image_cache_before
    assert pod.process.poll() is None and "PermissionError" not in pod.log()


def test_seeded_cache_is_writable_where_the_image_cache_is_not(pod: Server, image_cache: Path) -> None:
    """A changed model config compiles new keys into the cache: that must work on the copy (it failed closed
    with a PermissionError on the image's path under a read-only root, issue 11)."""
    for path in (pod.cache_volume, *pod.cache_volume.rglob("*")):
        if path.is_dir():
            probe = path / ".write-probe"
            probe.write_bytes(b"")
            probe.unlink()
    # ...and the pod really ran with the image read-only: the same namespace refuses a write to the image cache.
    if pod.read_only_root is None:
        pytest.skip("no mount namespace on this machine: the server ran with the image cache only chmod a-w")
    argv = [*pod.read_only_root, "touch", str(image_cache / ".write-probe")]
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert refused.returncode != 0 and "Read-only file system" in refused.stderr, refused


def test_pod_config_matches_its_ports_and_shutdown(workdir: Path) -> None:
    """What the server makes of the pod's environment is what the Deployment and the image assume."""
    (workdir / "model-config-check").mkdir()
    _, env = pod_environment(workdir / "model-config-check")
    config = load_config(env={k: v for k, v in env.items() if k.startswith("INDEXER_")})
    c = container(one(render(OVERLAY), "Deployment"))
    assert config.grpc_port == container_port(c, "grpc")
    assert config.http_port == container_port(c, "http-metrics")
    assert config.http_rpc_port == container_port(c, "http-rpc") and config.http_rpcs
    assert config.health_port == container_port(c, "grpc-health")
    _, final = final_stage()
    assert {config.grpc_port, config.http_port, config.http_rpc_port, config.health_port} == {
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
    pod_monitor = one(render(OVERLAY), "PodMonitor")
    for endpoint in pod_monitor["spec"]["podMetricsEndpoints"]:
        assert pod.http(endpoint["path"])[0] == 200
    assert pod.http("/readyz")[0] == 200 and pod.http("/livez")[0] == 200
    # The probes' services on the RPC port (which serves health too), then on the health port they use.
    for address in (pod.address, f"127.0.0.1:{pod.health_port}"):
        with IndexerClient(address, max_attempts=1, health_check=False) as client:
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert client.health(c[kind]["grpc"]["service"]) == "SERVING", (address, kind)
            # An unknown name must fail, or the check above would prove nothing.
            with pytest.raises(grpc.RpcError) as unknown:
                client.health("no.such.Service")
            assert unknown.value.code() is grpc.StatusCode.NOT_FOUND


def healthcheck_argv() -> list[str]:
    _, final = final_stage()
    healthcheck = next(i.args for i in final if i.keyword == "HEALTHCHECK")
    return json.loads(healthcheck[healthcheck.index("CMD") + 3 :])


def run_healthcheck(http_port: int) -> int:
    out = subprocess.run(
        healthcheck_argv(), env=base_env(INDEXER_HTTP_PORT=str(http_port)), capture_output=True, timeout=60
    )
    return out.returncode


def test_image_healthcheck_command(pod: Server) -> None:
    # Docker's contract: 0 healthy, 1 unhealthy; 2 is reserved and must never come back.
    assert run_healthcheck(pod.http_port) == 0
    assert run_healthcheck(1) == 1, "a port with no server must be unhealthy (exit 1)"


def test_image_healthcheck_with_tls_on(workdir: Path, image_cache: Path, tmp_path: Path) -> None:
    """Issue 11: with TLS on the gRPC port the old check exited 2 every time while /readyz said 200."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert_file, key_file = tmp_path / "server.pem", tmp_path / "server.key"
    cert_file.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    cert.private_key_pem.write_to_path(str(key_file))
    volume = seed_cache(image_cache, tmp_path / "triton-cache")
    server = Server(
        tmp_path,
        "tls",
        TRITON_CACHE_DIR=str(volume),
        INDEXER_TLS_CERT_FILE=str(cert_file),
        INDEXER_TLS_KEY_FILE=str(key_file),
    )
    try:
        server.wait_ready()
        assert run_healthcheck(server.http_port) == 0
        # Draining: /readyz turns 503, and the check unhealthy (1), until the process is gone.
        server.process.send_signal(signal.SIGTERM)
        codes, deadline = set(), time.monotonic() + 60
        while server.process.poll() is None and time.monotonic() < deadline:
            codes.add(run_healthcheck(server.http_port))
        assert codes <= {0, 1}, codes
    finally:
        assert server.stop() == 0, server.log()


# Written by a supervisor of several workers only. The deployed pod runs one process (deploy/base/deployment.yaml),
# so it has none; tests/service/test_worker_faults.py and test_workers.py hold a replica of workers to them.
WORKER_MODE_ONLY = {"indexer_worker_restarts_total", "indexer_worker_up", "indexer_worker_ready"}


def not_served_by(server: Server) -> set[str]:
    """Families named by the alerts and the dashboard that ``server``'s shape cannot export."""
    return WORKER_MODE_ONLY if server.workers == 1 else set()


def test_every_metric_of_the_alerts_and_the_dashboard_is_exported(pod: Server) -> None:
    with IndexerClient(pod.address, max_attempts=1) as client:
        send_traffic(client, 2)
        # The series that appear at their first event: a warmup miss, a call that expired while served.
        send_warmup_miss(client)
        send_expiring_call(client)
        send_expired_call(client)
    exported = set(pod.samples())
    wanted = {name for rule in alert_rules() for name in metric_names(rule["expr"])}
    wanted |= {name for _, expr in dashboard_targets() for name in metric_names(expr)}
    assert wanted, "no metric found in the alerts and the dashboard"
    # Every series of a reason or a port is created at 0 at start: named means exported, events or not.
    missing = wanted - exported - not_served_by(pod)
    assert not missing, f"named but not exported: {sorted(missing)}"


requires_prometheus = needs_tool(None if find_tool("prometheus") else f"no prometheus: {INSTALL_HINT}")


class Traffic:
    """Calls on a thread until stopped (at most ``seconds``): rounds of send_traffic, each with a call whose caller
    gave it a 1 us deadline (``expired``), 0.05 s apart. ``tolerant``: failed calls are counted, not raised (a
    worker being killed under it)."""

    def __init__(self, address: str, seconds: float, expired: bool = True, tolerant: bool = False) -> None:
        self.address, self.seconds, self.expired, self.tolerant = address, seconds, expired, tolerant
        self.errors: list[BaseException] = []
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        deadline = time.monotonic() + self.seconds
        try:
            with IndexerClient(self.address, max_attempts=1) as client:
                while not self._stop.is_set() and time.monotonic() < deadline:
                    try:
                        send_traffic(client, 1)
                        if self.expired:
                            send_expired_call(client)
                    except (grpc.RpcError, AssertionError):
                        if not self.tolerant:
                            raise
                        self.failed += 1
                    time.sleep(0.05)
        except BaseException as exc:
            self.errors.append(exc)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(15)


def wait_for_data(prometheus: Prometheus, queries: list[tuple[str, str]], timeout: float) -> None:
    """Every (title, PromQL) returns a finite value within ``timeout`` seconds."""
    pending = dict(enumerate(queries))
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        for n, (_, expr) in list(pending.items()):
            if any(math.isfinite(float(series["value"][1])) for series in prometheus.query(expr)):
                del pending[n]
        time.sleep(0.5)
    assert not pending, f"dashboard queries without data: {[queries[n] for n in pending]}\n{prometheus.proc.log()}"


def alerts_by_state(prometheus: Prometheus) -> dict[str, list[dict]]:
    """The alerts Prometheus holds now, by state (pending, firing), each with its labels and value."""
    found: dict[str, list[dict]] = {}
    for alert in prometheus.api("alerts")["alerts"]:
        found.setdefault(alert["state"], []).append(alert)
    return found


def wait_for_alert(prometheus: Prometheus, name: str, timeout: float) -> list[dict]:
    """The firing alerts named ``name`` once there is one, within ``timeout`` seconds."""
    return wait_for(
        lambda: [a for a in alerts_by_state(prometheus).get("firing", []) if a["labels"]["alertname"] == name],
        timeout,
        f"{name} firing",
        interval=0.5,
    )


def scraped(prometheus: Prometheus) -> bool:
    return any(series["value"][1] == "1" for series in prometheus.query("up"))


def dashboard_queries(server: Server) -> list[tuple[str, str]]:
    """Every dashboard query, expanded, but those of series ``server``'s shape cannot export."""
    return [
        (title, expand_grafana(expr))
        for title, expr in dashboard_targets()
        if not metric_names(expr) <= not_served_by(server)
    ]


# The alerts that may be pending on a healthy replica under this traffic: callers' refusals (the 1 us deadlines'
# deadline_on_arrival) are info, and pending for 15 minutes before they fire.
CALLERS_ALERT = "IndexerCallersRefused"
GUARD = (
    "histogram_quantile(0.99, sum by (cluster, namespace, job, instance, le) (rate(indexer_call_seconds_bucket[5m])))"
)


@requires_prometheus
@pytest.mark.exclusive  # the replica must stay idle (calls under 50 ms at p99): no other process test beside it
def test_prometheus_scrapes_the_server_and_answers_every_dashboard_query(pod: Server, workdir: Path) -> None:
    """The pod's one process under traffic that carries a caller's 1 us deadlines, a real Prometheus evaluating the
    rules: every dashboard query answers; a warmup miss that appears while Prometheus scrapes fires
    IndexerWarmupMisses at once; the caller's expired calls raise no overload or error alert, not even pending."""
    (workdir / "prometheus").mkdir()
    with IndexerClient(pod.address, max_attempts=1) as client:
        send_expiring_call(client)  # the DEADLINE_EXCEEDED series, before Prometheus: no rate of it to alert on
    prometheus = Prometheus(workdir / "prometheus", [f"127.0.0.1:{pod.http_port}"])
    try:
        with Traffic(pod.address, 90) as traffic:
            wait_for(lambda: scraped(prometheus), 30, "first scrape", interval=0.5)
            # A variant no call has asked for before: its series appears, at 1, while Prometheus scrapes.
            with IndexerClient(pod.address, max_attempts=1) as client:
                send_warmup_miss(client, ratio=16)
            (misses,) = wait_for_alert(prometheus, "IndexerWarmupMisses", 30)
            assert misses["labels"]["job"] == prometheus.job and misses["labels"]["severity"] == "warning"
            wait_for_data(prometheus, dashboard_queries(pod), 45)

            # The rules load in plain Prometheus and evaluate cleanly on live data.
            rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
            assert {r["name"] for r in rules} == {r["alert"] for r in alert_rules()}
            assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
            # The caller's 1 us deadlines were shed, some as queue_deadline (the server sees deadlines to about a
            # millisecond): on this idle replica, that is no overload and no error, not even pending.
            shed = {s["metric"]["reason"] for s in prometheus.query("indexer_requests_shed_total > 0")}
            assert "deadline_on_arrival" in shed, shed
            (p99,) = prometheus.query(GUARD)
            alerts = alerts_by_state(prometheus)
        assert not traffic.errors, traffic.errors
        firing = {a["labels"]["alertname"] for a in alerts.get("firing", [])}
        pending = {a["labels"]["alertname"]: a["labels"].get("reason") for a in alerts.get("pending", [])}
        assert firing == {"IndexerWarmupMisses"}, alerts
        assert set(pending) <= {CALLERS_ALERT}, (alerts, p99)
        assert pending.get(CALLERS_ALERT, "deadline_on_arrival") in {"deadline_on_arrival", "caller_cancelled"}
        assert float(p99["value"][1]) < 0.05, f"this replica's calls took {p99} s at p99: not an idle replica"
    finally:
        prometheus.stop()


def worker_pid(server: Server, slot: int) -> int:
    """The pid of the worker now in ``slot``, from the supervisor's log (JSON or text: ``msg`` holds the line)."""
    found = re.findall(rf"worker (?:started|restarted) worker={slot} pid=(\d+)", server.log())
    assert found, server.log()
    return int(found[-1])


def json_events(server: Server, pattern: str) -> list[dict]:
    """The JSON log lines whose event matches ``pattern`` (the runbooks' `jq 'select(.event | test(...))'`)."""
    lines = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
    return [line for line in lines if re.fullmatch(pattern, str(line.get("event")))]


@requires_prometheus
def test_workers_restarts_alert_once_per_kind_on_a_live_prometheus(image_cache: Path, tmp_path: Path) -> None:
    """The pod's server with two workers and JSON logs (on a seeded cache), scraped by a real Prometheus with the
    project's rules. Every worker x reason restart series is there at 0 before any restart. A worker stopped
    (SIGSTOP) is killed as hung and restarted: IndexerWorkerRestarts fires at once, one alert for the replica,
    IndexerProcessRestarts does not; the supervisor's worker hung / exited / restarted lines carry what the runbook
    reads. Every dashboard query answers, the worker panels included. Then the container restarts (the supervisor
    and both workers): one IndexerProcessRestarts alert, not one per process."""
    run = Path(tempfile.mkdtemp(prefix="wk-", dir="/tmp"))  # short: the supervisor's unix sockets live under it
    (tmp_path / "model").mkdir()
    argv, env = pod_environment(tmp_path / "model", seed_cache(image_cache, tmp_path / "triton-cache"))
    env |= {"INDEXER_WORKERS": "2", "INDEXER_LOG_FORMAT": "json", "INDEXER_WORKER_HANG_SECONDS": "2"}
    env["TMPDIR"] = str(run)
    server = Server(tmp_path, "workers", argv, **env).wait_ready()
    victim = 0
    prometheus = None
    try:
        assert server.workers == 2
        restarts = {
            (labels["worker"], labels["reason"]): value
            for labels, value in server.samples()["indexer_worker_restarts_total"]
        }
        assert restarts == {(w, r): 0.0 for w in ("0", "1") for r in RestartReason}, restarts
        (tmp_path / "prometheus").mkdir()
        prometheus = Prometheus(tmp_path / "prometheus", [f"127.0.0.1:{server.http_port}"])
        with Traffic(server.address, 150, tolerant=True) as traffic:
            wait_for(lambda: scraped(prometheus), 30, "first scrape", interval=0.5)
            with IndexerClient(server.address, max_attempts=1) as client:
                send_warmup_miss(client)
            time.sleep(3)  # a few scrapes of the restart series at 0
            assert "IndexerWorkerRestarts" not in {a["labels"]["alertname"] for a in prometheus.api("alerts")["alerts"]}
            victim = worker_pid(server, 1)
            os.kill(victim, signal.SIGSTOP)
            wait_for(lambda: f"worker hung worker=1 pid={victim}" in server.log(), 30, "the stopped worker killed")
            wait_for(lambda: "worker restarted worker=1" in server.log(), 30, "the worker restarted")
            (worker_alert,) = wait_for_alert(prometheus, "IndexerWorkerRestarts", 30)
            assert worker_alert["labels"]["instance"] == f"127.0.0.1:{server.http_port}"
            assert float(worker_alert["value"]) == 1
            wait_for_data(prometheus, dashboard_queries(server), 45)
            firing = {a["labels"]["alertname"] for a in alerts_by_state(prometheus).get("firing", [])}
            assert "IndexerProcessRestarts" not in firing, firing
        assert not traffic.errors, traffic.errors
        hung = prometheus.query('increase(indexer_worker_restarts_total{reason="hung"}[5m]) > 0')
        assert [s["metric"]["worker"] for s in hung] == ["1"], hung

        # What the runbook reads: the supervisor's lines about the worker, with their fields as JSON keys.
        (hung_line,) = json_events(server, "worker_hung")
        assert hung_line["worker"] == 1 and hung_line["pid"] == victim and hung_line["silent_seconds"] >= 1
        (exited,) = json_events(server, "worker_exited")
        assert exited["reason"] == "hung" and exited["code"] == -9 and exited["pid"] == victim, exited
        (restarted,) = json_events(server, "worker_restarted")
        assert restarted["reason"] == "hung" and restarted["worker"] == 1 and restarted["restarts"] == 1, restarted

        # The container restarts: a new supervisor and two new workers on the same HTTP port (the same target).
        assert server.stop() == 0, server.log()[-3000:]
        server = Server(tmp_path, "workers", argv, http_port=server.http_port, **env).wait_ready()
        (process_alert,) = wait_for_alert(prometheus, "IndexerProcessRestarts", 45)
        assert process_alert["labels"]["instance"] == f"127.0.0.1:{server.http_port}"
        assert float(process_alert["value"]) == 1
        # The worker alert is still the one of the hung worker, not a second one for the restarted container.
        alerts = prometheus.api("alerts")["alerts"]
        (worker_alert,) = [a for a in alerts if a["labels"]["alertname"] == "IndexerWorkerRestarts"]
        assert float(worker_alert["value"]) == 1, alerts
    finally:
        if victim:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)  # never left stopped, whatever failed above
        server.stop()
        if prometheus is not None:
            prometheus.stop()
        shutil.rmtree(run, ignore_errors=True)
