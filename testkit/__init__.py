"""Attack clients for issue 10 ("survive abuse and overload"): what tests/system/test_hardening_abuse.py runs in small
and ``python -m benchmarks.attack`` runs at full size. Not shipped in the wheel.

Every client here talks to loopback only, and every loop stops at a count or a deadline, whichever comes first.

- :mod:`testkit.payloads`: the requests (a ~64 MB answer in a 140-byte BuildChunk, the 22-byte PlanBatch that
  costs a second of CPU, a small well-behaved BuildChunk) and gRPC's length-prefixed framing.
- :mod:`testkit.h2raw`: a raw HTTP/2 gRPC client on the ``h2`` package: stalled streams with a flow-control
  window of 0, rapid reset (HEADERS + DATA + RST_STREAM), and call loops with one call in flight per connection
  (issue 19's floods of refused or expired calls, ``grpc-timeout`` as given).
- :mod:`testkit.http1raw`: the HTTP port on raw sockets: a huge request header, idle connections, POSTs whose
  answer is never read.
- :mod:`testkit.observe`: what the victims see: probes (gRPC health, /livez, /readyz) with a 1 s timeout, a
  well-behaved gRPC caller with a 1 s deadline, looping heavy callers.

Shared by the tests and the benchmarks (no test imports ``benchmarks``):

- :mod:`testkit.paths`: ``REPO``, the repository root.
- :mod:`testkit.harness`: the one server harness (``ServiceProcess``: ``indexer-service serve`` on loopback ports
  from its port file), channels on connections of their own, a bounded closed-loop load generator, RSS readings,
  Prometheus scrapes.
"""
