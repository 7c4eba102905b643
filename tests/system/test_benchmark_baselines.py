"""The baselines benchmarks build in a process of their own name modules that exist: a module moved in the code
(service/ restructured) breaks such a benchmark only when it is run, so these are checked here."""

from __future__ import annotations

import importlib.util

from benchmarks.bench_service_warmup import SERVER_IMPORTS


def test_bench_service_warmups_import_baseline_names_the_servers_modules() -> None:
    names = [name.strip() for name in SERVER_IMPORTS.split(",")]
    assert "torch" not in names  # the server without a GPU never imports it
    missing = [name for name in names if importlib.util.find_spec(name) is None]
    assert not missing, f"bench_service_warmup's import baseline names modules that do not exist: {missing}"
