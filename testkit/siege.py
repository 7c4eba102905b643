"""One attack on one server, observed: probes, a victim, fresh clients where asked, RSS sampling, and the server's
metrics before and after. The tests assert on a :class:`Siege`'s figures, held against a :func:`control_run`'s;
``python -m benchmarks.attack`` prints and saves them."""

from __future__ import annotations

import time
from collections import defaultdict

import grpc

from indexer_service.service.process.addresses import host_port
from testkit.harness import LOOPBACK, RssSampler, ServiceProcess, mib, scrape
from testkit.observe import Callers, FreshClients, Probes
from testkit.payloads import BUILD_CHUNK_PATH, SMALL_BUILD_CHUNK

SHED = "indexer_requests_shed_total"
ERRORS = "indexer_request_errors_total"
HTTP_REFUSED = "indexer_http_refused_total"
PEER_CLOSED = "indexer_peer_connections_closed_total"
DROPPED_BEFORE_ACCEPT = "indexer_connections_dropped_before_accept_total"
BYTES_HELD = "indexer_response_bytes_held"
VICTIM_DEADLINE_SECONDS = 1.0
VICTIM_CONNECT_SECONDS = 5.0

Samples = dict[tuple[str, frozenset], float]


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    """The samples called ``name`` summed per value of ``label`` (e.g. shed counts per reason)."""
    totals: dict[str, float] = defaultdict(float)
    for (sample, labels), value in samples.items():
        if sample == name:
            totals[dict(labels).get(label, "")] += value
    return dict(totals)


def counter_delta(before: Samples, after: Samples, name: str, label: str) -> dict[str, float]:
    """How much each ``label`` value of counter ``name`` grew between two scrapes (zero growth left out)."""
    old, new = by_label(before, name, label), by_label(after, name, label)
    return {key: new[key] - old.get(key, 0.0) for key in sorted(new) if new[key] - old.get(key, 0.0)}


def health_address(server: ServiceProcess) -> str | None:
    """The server's health-only gRPC listener, when it has one (issue 10; older servers do not)."""
    return host_port(LOOPBACK, server.health_port) if server.health_port else None


class Siege:
    """From ``with`` to its end: probes of every kind every ``probe_interval`` seconds, one well-behaved victim
    (a small BuildChunk with a 1 s deadline every ``victim_pause`` seconds, on its own connection) unless
    ``victim`` is False, with ``fresh_client_interval`` a fresh health-checking IndexerClient making one call
    every that many seconds (:class:`FreshClients`: what a scheduler that starts or reconnects sees), and RSS
    samples; ``grpc_credentials``: the RPC port's probe over TLS (a TLS server's). :meth:`figures` says what they saw
    and what the metrics counted."""

    def __init__(
        self,
        server: ServiceProcess,
        victim: bool = True,
        probe_interval: float = 0.1,
        victim_pause: float = 0.02,
        fresh_client_interval: float | None = None,
        max_seconds: float = 600.0,
        grpc_credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.server = server
        self.probes = Probes(
            server.address, server.http_url, health_address(server), probe_interval, max_seconds, grpc_credentials
        )
        victim_call = (BUILD_CHUNK_PATH, SMALL_BUILD_CHUNK.SerializeToString(), VICTIM_DEADLINE_SECONDS)
        self.victim = (
            Callers(server.address, *victim_call, pause=victim_pause, max_seconds=max_seconds) if victim else None
        )
        self.fresh = (
            FreshClients(server.address, interval=fresh_client_interval, max_seconds=max_seconds)
            if fresh_client_interval is not None
            else None
        )
        self.rss = RssSampler(server.pid, interval=0.1)
        self.rss_before = 0
        self.metrics_before: Samples = {}
        self.metrics_after: Samples = {}
        self.seconds = 0.0

    def __enter__(self) -> Siege:
        self.rss_before = self.server.rss_bytes()
        self.metrics_before = scrape(self.server.http_url)
        self._begin = time.perf_counter()
        self.rss.__enter__()
        self.probes.start()
        if self.victim is not None:
            # Its connection open before the attack's: what the attack does to a connected caller is measured, not
            # a race between the victim's first connect and the flood's (refused at accept when the flood wins).
            self.victim.connect(VICTIM_CONNECT_SECONDS)
            self.victim.start()
        if self.fresh is not None:
            self.fresh.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.fresh is not None:
            self.fresh.stop()
        if self.victim is not None:
            self.victim.stop()
        self.probes.stop()
        self.rss.__exit__()
        self.seconds = time.perf_counter() - self._begin
        if self.server.process is not None and self.server.process.poll() is None:
            self.metrics_after = scrape(self.server.http_url)

    # --- figures ------------------------------------------------------------------------------------------

    @property
    def rss_peak_growth(self) -> int:
        """Largest sampled RSS minus the RSS before the attack."""
        return max((rss for _, rss in self.rss.samples), default=self.rss_before) - self.rss_before

    def victim_ok_ratio(self) -> float:
        return self.victim.ok_ratio() if self.victim is not None else float("nan")

    def fresh_client_ok_ratio(self) -> float:
        return self.fresh.ok_ratio() if self.fresh is not None else float("nan")

    def shed(self) -> dict[str, float]:
        """indexer_requests_shed_total's growth during the siege, per reason."""
        return counter_delta(self.metrics_before, self.metrics_after, SHED, "reason")

    def errors(self) -> dict[str, float]:
        """indexer_request_errors_total's growth during the siege, per code."""
        return counter_delta(self.metrics_before, self.metrics_after, ERRORS, "code")

    def http_refused(self) -> dict[str, float]:
        return counter_delta(self.metrics_before, self.metrics_after, HTTP_REFUSED, "reason")

    def peer_connections_closed(self) -> dict[str, float]:
        """indexer_peer_connections_closed_total's growth during the siege, per port."""
        return counter_delta(self.metrics_before, self.metrics_after, PEER_CLOSED, "port")

    def dropped_before_accept(self) -> dict[str, float]:
        """indexer_connections_dropped_before_accept_total's growth during the siege, per port."""
        return counter_delta(self.metrics_before, self.metrics_after, DROPPED_BEFORE_ACCEPT, "port")

    def probe_report(self) -> str:
        """Each probe target's probes answered in time, and its slowest, as one line."""
        return ", ".join(
            f"{s.target} {s.in_time}/{s.probes} (worst {s.worst_seconds:.2f} s)"
            for s in self.probes.summaries().values()
        )

    def summary(self) -> str:
        """The siege's figures as one readable line for an assertion message."""
        victim = self.victim.run().codes() if self.victim is not None else {}
        fresh = f"fresh clients {self.fresh.outcomes}; " if self.fresh is not None else ""
        return (
            f"victim {victim}; {fresh}RSS +{mib(self.rss_peak_growth):.0f} MiB at peak; shed {self.shed()}; "
            f"errors {self.errors()}; HTTP refused {self.http_refused()}; probes: {self.probe_report()}"
        )

    def figures(self) -> dict[str, object]:
        """Everything measured, as plain numbers (JSON-ready)."""
        probes = {
            name: {
                "probes": s.probes,
                "in_time": s.in_time,
                "ratio": round(s.ratio, 4),
                "worst_s": round(s.worst_seconds, 3),
                "missed_at_s": [round(start, 2) for start in s.missed_at],
            }
            for name, s in self.probes.summaries().items()
        }
        overall = self.probes.overall()
        figures: dict[str, object] = {
            "seconds": round(self.seconds, 1),
            "rss_before_mib": round(mib(self.rss_before), 1),
            "rss_peak_growth_mib": round(mib(self.rss_peak_growth), 1),
            "probes_in_time_ratio": round(overall.ratio, 4),
            "probes": probes,
            "shed": self.shed(),
            "errors": self.errors(),
            "http_refused": self.http_refused(),
            "peer_connections_closed": self.peer_connections_closed(),
            "dropped_before_accept": self.dropped_before_accept(),
        }
        if self.victim is not None:
            run = self.victim.run()
            figures["victim_ok_ratio"] = round(self.victim_ok_ratio(), 4)
            figures["victim_codes"] = run.codes()
        if self.fresh is not None:
            figures["fresh_client_ok_ratio"] = round(self.fresh_client_ok_ratio(), 4)
            figures["fresh_client_outcomes"] = {o: self.fresh.outcomes.count(o) for o in set(self.fresh.outcomes)}
        return figures


def control_run(server: ServiceProcess, seconds: float, **options: object) -> Siege:
    """A :class:`Siege` (with ``options``) of ``seconds`` on the server unattacked: the baseline, taken in the same
    test on the same server just before the attack, that the attacked run's figures are held to."""
    with Siege(server, **options) as siege:
        time.sleep(seconds)
    return siege
