"""The baselines benchmarks build in a process of their own name modules that exist: a module moved in the code
(service/ restructured) breaks such a benchmark only when it is run, so these are checked here."""

from __future__ import annotations

import importlib.util

from testkit.harness import CPU_SERVER_IMPORTS


def test_the_cpu_servers_import_baseline_names_modules_that_exist() -> None:
    assert "torch" not in CPU_SERVER_IMPORTS  # the server without a GPU never imports it
    missing = [name for name in CPU_SERVER_IMPORTS if importlib.util.find_spec(name) is None]
    assert not missing, f"bench_service_warmup's import baseline names modules that do not exist: {missing}"
