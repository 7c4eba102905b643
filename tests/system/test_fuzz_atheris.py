"""A bounded coverage-guided run of benchmarks/fuzz_atheris.py (libFuzzer) over the shared request path. Longer
runs: ``python -m benchmarks.fuzz_atheris -max_total_time=600``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from testkit.harness import REPO, clean_env
from tests.tools import needs_tool

pytestmark = needs_tool(None if importlib.util.find_spec("atheris") else "atheris (the dev extra) is not installed")

RUNS = 8000


def test_coverage_guided_fuzz_finds_no_wrong_answer(tmp_path: Path) -> None:
    # Crash inputs land in the working directory: keep them with the test's files.
    command = [
        sys.executable,
        "-m",
        "benchmarks.fuzz_atheris",
        f"-runs={RUNS}",
        "-max_total_time=90",
        "-timeout=20",
        "-rss_limit_mb=1024",
        "-seed=1",
        "-print_final_stats=1",
    ]
    env = clean_env(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    output = done.stdout + done.stderr
    crashes = sorted(p.name for p in tmp_path.iterdir())
    assert done.returncode == 0, f"libFuzzer exit {done.returncode}, inputs kept: {crashes}\n{output[-4000:]}"
    assert f"Done {RUNS} runs" in output, output[-2000:]
