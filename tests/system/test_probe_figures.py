"""testkit's probes: what an attack row's probe figures say, down to when its misses came."""

from __future__ import annotations

from testkit.observe import MISSES_DATED, ProbeRecord, Probes


def test_a_summary_dates_each_targets_misses_so_a_stall_of_every_target_at_once_shows() -> None:
    probes = Probes("127.0.0.1:1", "http://127.0.0.1:1", health_address="127.0.0.1:2")  # never started
    probes.records += [
        ProbeRecord("livez", 0.1, 0.01, True),
        ProbeRecord("livez", 7.3, 1.21, False),  # answered, but late
        ProbeRecord("readyz", 7.3, 1.31, False),
        ProbeRecord("grpc-health", 7.2, 1.25, False),
        ProbeRecord("grpc-health", 2.0, 0.02, False),  # refused at once
        *(ProbeRecord("grpc-health-port", 10.0 - n, 0.01, False) for n in range(MISSES_DATED + 5)),
    ]
    summaries = probes.summaries()
    assert summaries["livez"].missed_at == (7.3,)
    assert (summaries["livez"].probes, summaries["livez"].in_time, summaries["livez"].worst_seconds) == (2, 1, 1.21)
    assert summaries["readyz"].missed_at == (7.3,)
    assert summaries["grpc-health"].missed_at == (2.0, 7.2), "in the order they came"
    port = summaries["grpc-health-port"]
    assert port.probes == MISSES_DATED + 5 and len(port.missed_at) == MISSES_DATED, "the first ones dated, not all"
    assert port.missed_at[0] == 10.0 - (MISSES_DATED + 4)
