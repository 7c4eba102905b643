"""Issue 18's alerting, checked on the rules, the dashboard and the docs themselves (promtool runs the cases in
deploy/prometheus/tests/deployments.test.yml; tests/deploy/test_static.py runs promtool): alerts judge each
deployment (cluster, namespace, job) apart, every alert has a runbook section that exists, the shed reasons
split into the service's overload and callers' behaviour the same way in the rules and the dashboard, and calls
to unknown methods stay out of the paging error ratio."""

from __future__ import annotations

import re

import yaml

from indexer_service.service.reasons import OVERLOAD_REASONS, ShedReason
from tests.deploy.support import (
    DEPLOY,
    PROMETHEUS_CONFIG,
    alert_rules,
    dashboard,
    dashboard_targets,
    markdown_anchors,
)

# Where every runbook_url points: deploy/README.md in the project's repository (deploy/README.md, Monitoring).
RUNBOOK_BASE = "https://github.com/indexer-service/indexer-service/blob/main/deploy/README.md#"
DEPLOYMENT_LABELS = {"cluster", "namespace", "job"}
# Callers' reasons the rules must never count as overload (a sample: the rest is held to OVERLOAD_REASONS).
CALLER_REASONS = {ShedReason.WORK_LIMIT, ShedReason.UNREAD_RESPONSE, ShedReason.CONNECTION_SHARE}


def rules_by_name() -> dict[str, dict]:
    return {rule["alert"]: rule for rule in alert_rules()}


def label_matcher(expr: str, label: str, op: str) -> set[str]:
    """The alternatives of every ``label op "a|b|c"`` matcher in a PromQL expression, which must all agree."""
    found = {m for m in re.findall(rf'\b{label}{re.escape(op)}"([^"]*)"', expr)}
    assert len(found) == 1, f"{label}{op}: expected one matcher, found {found} in {expr}"
    return set(found.pop().split("|"))


def test_every_alert_links_its_own_runbook_section() -> None:
    anchors = markdown_anchors((DEPLOY / "README.md").read_text())
    for name, rule in rules_by_name().items():
        url = rule["annotations"]["runbook_url"]
        assert url.startswith(RUNBOOK_BASE), (name, url)
        anchor = url.removeprefix(RUNBOOK_BASE)
        assert anchor == name.lower(), f"{name} links another alert's runbook: {url}"
        assert anchor in anchors, f"{name}: deploy/README.md has no section #{anchor}"


def test_deploy_readme_links_to_its_own_sections_resolve() -> None:
    text = (DEPLOY / "README.md").read_text()
    anchors = markdown_anchors(text)
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert links and not [link for link in links if link not in anchors]


def test_anchor_check_catches_a_missing_section() -> None:
    """The check above is worth something only if an anchor that is not a heading fails it."""
    anchors = markdown_anchors("# Top\n\n### IndexerNoReadyReplica\n\ntext `### IndexerTargetDown`\n")
    assert "indexernoreadyreplica" in anchors and "top" in anchors
    assert "indexertargetdown" not in anchors


def test_every_aggregation_keeps_the_deployment() -> None:
    """prod with no ready replica must page while staging, same job, is fine (issue 18): every `by (...)` and
    `on (...)` of every alert keeps cluster, namespace and job. The one exception is `or on () absent(...)`, the
    catch-all for when nothing at all is scraped."""
    for name, rule in rules_by_name().items():
        expr = rule["expr"]
        for keyword, labels in re.findall(r"\b(by|on)\s*\(([^)]*)\)", expr):
            kept = {label.strip() for label in labels.split(",") if label.strip()}
            if keyword == "on" and not kept:
                assert re.search(r"or on \(\)\s*absent\(", expr), f"{name}: `on ()` outside the absent() catch-all"
                continue
            assert kept >= DEPLOYMENT_LABELS, f"{name}: `{keyword} ({labels})` merges deployments"


def test_shed_reasons_split_into_overload_and_callers_alike_in_rules_and_dashboard() -> None:
    rules = rules_by_name()
    overload = label_matcher(rules["IndexerShedding"]["expr"], "reason", "=~")
    assert label_matcher(rules["IndexerSheddingSustained"]["expr"], "reason", "=~") == overload
    # Callers': every reason but overload and shutdown, so a reason added later (a flood's) lands there.
    assert label_matcher(rules["IndexerCallersRefused"]["expr"], "reason", "!~") == overload | {ShedReason.SHUTDOWN}
    # The matchers name reasons the server has (a StrEnum member equals its label): a renamed reason must not
    # silently leave a class.
    assert overload == OVERLOAD_REASONS
    assert set(ShedReason) - overload - {ShedReason.SHUTDOWN} >= CALLER_REASONS
    assert rules["IndexerCallersRefused"]["labels"]["severity"] == "info"
    # The dashboard's two shed panels use the very same matchers.
    shed = [expr for _, expr in dashboard_targets() if "indexer_requests_shed_total" in expr]
    assert {frozenset(label_matcher(e, "reason", "=~")) for e in shed if 'reason=~"' in e} == {frozenset(overload)}
    assert {frozenset(label_matcher(e, "reason", "!~")) for e in shed if 'reason!~"' in e} == {
        frozenset(overload | {ShedReason.SHUTDOWN})
    }
    # No alert but the callers' one counts a caller's reason.
    for name, rule in rules.items():
        if "indexer_requests_shed_total" in rule["expr"] and name != "IndexerCallersRefused":
            assert label_matcher(rule["expr"], "reason", "=~") == overload, name


def test_unknown_methods_have_their_own_info_alert_and_never_the_error_ratio() -> None:
    rules = rules_by_name()
    ratio = rules["IndexerHighErrorRatio"]["expr"]
    selectors = re.findall(r"indexer_request(?:_errors_total|_duration_seconds_count)\{([^}]*)\}", ratio)
    assert len(selectors) == 4 and all('method!="unknown"' in s for s in selectors), selectors
    unknown = rules["IndexerUnknownMethodCalls"]
    assert 'indexer_request_errors_total{method="unknown", code="UNIMPLEMENTED"}' in unknown["expr"]
    assert unknown["labels"]["severity"] == "info"


def test_worker_restart_alert_works_with_or_without_the_reason_label() -> None:
    expr = rules_by_name()["IndexerWorkerRestarts"]["expr"]
    assert "indexer_worker_restarts_total" in expr
    (kept,) = re.findall(r"sum by \(([^)]*)\)", expr)
    assert {label.strip() for label in kept.split(",")} == DEPLOYMENT_LABELS | {"instance"}, (
        "summed over worker, reason"
    )


def test_dashboard_filters_by_deployment_and_shows_issue_18s_panels() -> None:
    board = dashboard()
    variables = [v["name"] for v in board["templating"]["list"]]
    assert variables[:5] == ["datasource", "cluster", "namespace", "job", "instance"]
    for title, expr in dashboard_targets():
        selectors = re.findall(r"\b(?:indexer|process)_\w+\{([^}]*)\}", expr)
        assert selectors, (title, expr)
        for selector in selectors:
            for label in ("cluster", "namespace", "job", "instance"):
                assert f'{label}=~"${label}"' in selector, f"{title}: {label} not filtered in {expr}"
    exprs = [expr for _, expr in dashboard_targets()]
    assert any("indexer_worker_restarts_total" in e and re.search(r"by \([^)]*\breason\b", e) for e in exprs), (
        "worker restarts by reason"
    )
    assert any('indexer_request_errors_total{method="unknown"' in e for e in exprs), "unknown-method calls"
    (versions,) = [p for p in board["panels"] if any("indexer_build_info" in t["expr"] for t in p["targets"])]
    assert versions["type"] == "table" and versions["targets"][0]["format"] == "table"


def test_plain_prometheus_dns_job_labels_the_namespace() -> None:
    """The Operator's PodMonitor targets carry `namespace`; the DNS job derives it from the Service's name, so the
    alerts judge namespaces apart without the Operator too."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    (dns_job,) = [job for job in config["scrape_configs"] if "dns_sd_configs" in job]
    (relabel,) = [r for r in dns_job["relabel_configs"] if r["target_label"] == "namespace"]
    assert relabel["source_labels"] == ["__meta_dns_name"]
    for sd in dns_job["dns_sd_configs"]:
        for name in sd["names"]:
            # Prometheus anchors relabel regexes at both ends; the default replacement is $1.
            match = re.fullmatch(relabel["regex"], name)
            assert match and match.group(1) == name.split(".")[1], name


# The guard of every count of calls that expired in the server: p99 from the request being in to the end, per replica.
SLOW_CALLS = (
    "histogram_quantile(0.99, sum by (cluster, namespace, job, instance, le) (rate(indexer_call_seconds_bucket[5m])))"
)


def one_line(expr: str) -> str:
    return re.sub(r"\s+", " ", expr).replace("( ", "(").replace(" )", ")")


def test_expired_calls_count_against_the_service_only_where_its_calls_take_long() -> None:
    """The server sees deadlines only to about a millisecond: a caller's 1 us deadlines are shed queue_deadline or
    expire while served now and then. The error ratio counts DEADLINE_EXCEEDED, and the shedding alerts
    queue_deadline, only from a replica whose calls take 50 ms or more at p99; deadline_on_arrival and
    caller_cancelled are never overload."""
    rules = rules_by_name()
    ratio = one_line(rules["IndexerHighErrorRatio"]["expr"])
    assert (
        'rate(indexer_request_errors_total{method!="unknown", code="DEADLINE_EXCEEDED"}[5m]) '
        f"unless on (cluster, namespace, job, instance) ({SLOW_CALLS} < 0.05)"
    ) in ratio
    for name in ("IndexerShedding", "IndexerSheddingSustained"):
        expr = one_line(rules[name]["expr"])
        assert (
            "unless on (cluster, namespace, job, instance, reason) "
            f'label_replace({SLOW_CALLS} < 0.05, "reason", "{ShedReason.QUEUE_DEADLINE}", "", "")'
        ) in expr, name
    assert {ShedReason.DEADLINE_ON_ARRIVAL, ShedReason.CALLER_CANCELLED}.isdisjoint(OVERLOAD_REASONS)
    assert ShedReason.QUEUE_DEADLINE in OVERLOAD_REASONS


def test_restart_alerts_are_one_series_per_replica_and_alert_at_once() -> None:
    rules = rules_by_name()
    workers, processes = rules["IndexerWorkerRestarts"], rules["IndexerProcessRestarts"]
    for rule in (workers, processes):
        assert "for" not in rule, rule["alert"]
        (kept,) = re.findall(r"sum by \(([^)]*)\)", rule["expr"])
        assert {label.strip() for label in kept.split(",")} == DEPLOYMENT_LABELS | {"instance"}, rule["alert"]
        assert rule["labels"]["severity"] == "warning"
    # A worker's restart is the worker alert's alone: the process alert reads the supervisor's (or the one process's)
    # start time, never a worker's.
    assert 'process!="worker"' in processes["expr"] and "indexer_worker_restarts_total" not in processes["expr"]
    assert "process_start_time_seconds" not in workers["expr"]
    assert re.search(r"increase\(indexer_worker_restarts_total\[15m\]\)\)\)\s*> 0$", workers["expr"])


def test_warmup_misses_alert_sees_a_series_that_appears_at_one() -> None:
    rule = rules_by_name()["IndexerWarmupMisses"]
    expr = one_line(rule["expr"])
    assert "(indexer_warmup_misses_total unless indexer_warmup_misses_total offset 1h)" in expr
    assert "increase(indexer_warmup_misses_total[1h]) > 0" in expr
    assert "for" not in rule and rule["labels"]["severity"] == "warning"
    # The compile it causes on a GPU replica is not told twice.
    assert "unless on (cluster, namespace, job) ((indexer_warmup_misses_total unless" in one_line(
        rules_by_name()["IndexerCompilesAfterReady"]["expr"]
    )
