#!/usr/bin/env python3
"""`make test-deps`: the transport, health, flood and HTTP tests and a short attack run against each end of the
declared ranges of the libraries the transports are built on (pyproject.toml's grpcio, grpcio-health-checking,
grpcio-reflection, protobuf, prometheus-client, uvicorn[standard]).

    .venv/bin/python scripts/test-deps.py                  # both ends, one after the other
    .venv/bin/python scripts/test-deps.py --end lowest     # one end
    .venv/bin/python scripts/test-deps.py --print-plan     # what each end pins, as JSON; installs nothing

The ends:
- ``lowest``: every one of those libraries at its declared lower bound (read from pyproject.toml), resolved
  together with the project's other dependencies (torch and Triton aside) by pip, which fails when the lower
  bounds cannot be installed together;
- ``newest``: the newest release of each within its declared range that the index has now, resolved together
  the same way; each must also be the newest the index has for its range alone (else the range holds a
  release that cannot be installed with the rest, and this fails naming it).

Each end gets a venv of its own under ``.venv-deps/`` that holds only the pinned libraries, plus any of their
requirements (uvicorn[standard]'s extras, typing-extensions...) that the main venv has at a version the end's
pins do not accept; everything else (torch, Triton, numpy, the editable install of this project, pytest) is the
main venv's, reached through a ``.pth`` file placed after the end's own site-packages. A venv is rebuilt only
when its plan (the versions) changes. Inside each venv the script checks that the versions imported are the
pinned ones and that every installed distribution's requirements hold (``pip check``), then runs the tests and
the attack rows. Exit status 0 when both ends passed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
VENVS = ROOT / ".venv-deps"
ENDS = ("lowest", "newest")

# The libraries whose ends are tested: what the transports (gRPC with health and reflection, HTTP on uvicorn,
# the metrics) are built on, each named as pyproject.toml's [project] dependencies name it.
TRANSPORT_LIBRARIES = (
    "grpcio",
    "grpcio-health-checking",
    "grpcio-reflection",
    "protobuf",
    "prometheus-client",
    "uvicorn",
)
# Left out of the resolution: installed explicitly (a CPU build from local disk, or the GPU image's own), only
# range-checked by pyproject.toml, and nothing the transports use depends on them; resolving torch from the index
# would walk its CUDA wheels' requirements.
NOT_RESOLVED = frozenset({"torch", "triton"})
# The modules the service imports from the pinned libraries: each must come from the end's own venv.
PINNED_MODULES = (
    "grpc",
    "grpc_health.v1.health",
    "grpc_reflection.v1alpha.reflection",
    "google.protobuf",
    "prometheus_client",
    "uvicorn",
)

# What each end runs (111-126 s here at load average 5-7; both ends together must stay within 6 minutes): the
# transports over gRPC and HTTP (the RPCs, their gate and caller, the grpcio internals the adapters read, reflection
# and health Check/List/Watch, TLS, the HTTP ports and their errors, protobuf's own serialization against the fast
# path's bytes), the metrics (one process, and the multiprocess files of workers, with the prometheus_client
# internals the adapters read, and each of their public paths), the drain on SIGTERM, and the
# floods. Left to `make test`: what the libraries play no part in (warmups, CPU pinning, signals at every moment of
# a start) and the second form of a flood another test here already sends (the health port's idle connections,
# the workers' full port).
TESTS = (
    "tests/service/test_rpc.py",
    "tests/service/test_gate.py",
    "tests/service/test_grpc_caller.py",
    "tests/service/test_adapter_grpcio.py",
    "tests/service/test_health.py",
    "tests/service/test_port_watch.py",
    "tests/service/test_adapter_prometheus.py",
    "tests/service/test_adapters.py",
    "tests/service/test_streams.py",
    "tests/service/test_protocols.py",
    "tests/service/test_codec.py",
    "tests/service/test_tls.py",
    "tests/service/test_http_errors.py",
    "tests/service/test_http_ports.py",
    "tests/service/test_http_trailers.py",
    "tests/service/test_adapter_uvicorn.py",
    "tests/service/test_metrics.py",
    "tests/service/test_observability.py",
    "tests/service/test_workers.py::test_two_workers_share_the_port_both_serve_and_metrics_add_up",
    "tests/service/test_workers.py::test_a_killed_worker_is_logged_counted_unready_then_back",
    "tests/service/test_shutdown.py::test_sigterm_during_a_burst_drains_and_exits_0",
    "tests/system/test_unknown_method_flood.py",
    "tests/system/test_floods_refusals.py",
    "tests/system/test_floods_streams_connections.py::test_idle_reflection_streams_hold_no_rpc_thread",
    "tests/system/test_floods_streams_connections.py::test_blocked_watch_streams_hold_no_delivery_thread",
    "tests/system/test_floods_streams_connections.py::test_idle_connections_capped_closed_and_memory_back[grpc]",
    "tests/system/test_floods_streams_connections.py::test_one_peer_cannot_fill_a_port",
    "tests/system/test_floods_streams_connections.py::test_each_worker_caps_its_share_and_the_supervisor_the_health_port",
    "tests/system/test_floods_streams_connections.py::test_half_open_tls_handshakes_capped_timed_out_and_memory_back",
    # grpcio's own path leaks an undecodable Watch; uvicorn's parser reads trailers: each end must hold both.
    "tests/system/test_floods_gate.py::test_undecodable_health_calls_are_refused_counted_logged_per_port_and_keep_nothing",
    "tests/system/test_floods_gate.py::test_trailer_floods_are_refused_early_counted_and_hold_no_memory",
)
# The attack rows each end runs with --check (benchmarks/attack.py holds them to their targets): raw HTTP/2
# resets against gRPC core, a 64 MiB header against uvicorn's httptools protocol, SIGTERM with health Watch
# streams open, and refusals that the metrics must count. 11-33 s together here.
ATTACK_ROWS = ("rapid-reset", "http-big-header", "drain-watchers", "shedding")


@dataclass(frozen=True)
class EndPlan:
    """One end: ``pins`` the transport libraries' versions, ``installs`` what its venv holds (the pins and any
    requirement of theirs the main venv cannot serve), ``borrowed`` the main venv's versions it relies on for
    the rest of the pins' requirements."""

    end: str
    pins: dict[str, str]
    installs: dict[str, str]
    borrowed: dict[str, str]


def declared_dependencies(pyproject: Path = PYPROJECT) -> dict[str, Requirement]:
    """pyproject.toml's [project] dependencies by canonical name."""
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return {canonicalize_name(r.name): r for r in map(Requirement, dependencies)}


def lower_bound(requirement: Requirement) -> str:
    """The version a requirement's ``>=`` (or ``==``) clause names: the lowest release it declares tested."""
    bounds = [s.version for s in requirement.specifier if s.operator in (">=", "==")]
    if len(bounds) != 1:
        raise SystemExit(f"pyproject.toml: {requirement} needs exactly one lower bound (>=) for test-deps")
    return bounds[0]


def _pinned(requirement: Requirement, version: str) -> str:
    extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
    return f"{requirement.name}{extras}=={version}"


def pip(*args: str, python: Path | None = None, quiet: bool = True) -> subprocess.CompletedProcess:
    """The main venv's pip (``--python``: acting on another interpreter's environment); fails loudly."""
    command = [sys.executable, "-m", "pip", *(("--python", str(python)) if python else ()), *args]
    done = subprocess.run(command, capture_output=quiet, text=True)
    if done.returncode != 0:
        # pip names each find-links or index location it skips; only the error itself matters here.
        output = f"{done.stdout or ''}{done.stderr or ''}".splitlines()
        lines = [line for line in output if "is ignored: it is neither" not in line]
        raise SystemExit(f"{' '.join(command[3:])} failed ({done.returncode}):\n" + "\n".join(lines[-40:]))
    return done


def resolve(requirements: list[str], no_deps: bool = False) -> list[dict]:
    """What pip would install for ``requirements`` into an empty environment (its --report's items), from the
    index, installing nothing."""
    with tempfile.TemporaryDirectory(prefix="test-deps-") as folder:
        report = Path(folder) / "report.json"
        flags = ("--no-deps",) if no_deps else ()
        pip("install", "--dry-run", "--ignore-installed", *flags, "--report", str(report), *requirements)
        return json.loads(report.read_text())["install"]


def _versions(items: list[dict]) -> dict[str, str]:
    return {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in items}


def requirements_within(items: list[dict]) -> dict[str, dict[str, SpecifierSet]]:
    """For each distribution, what each other resolved distribution (with the extras asked of it) requires of its
    version: name -> {requiring distribution: specifier}."""
    required: dict[str, dict[str, SpecifierSet]] = {}
    for item in items:
        extras = item.get("requested_extras") or [""]
        by = canonicalize_name(item["metadata"]["name"])
        for line in item["metadata"].get("requires_dist") or ():
            requirement = Requirement(line)
            marker = requirement.marker
            if marker is None or any(marker.evaluate(default_environment() | {"extra": e}) for e in extras):
                required.setdefault(canonicalize_name(requirement.name), {})[by] = requirement.specifier
    return required


def main_venv_versions() -> dict[str, str]:
    """The distributions of the main venv (the one running this script), by canonical name."""
    return {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}


def plan(end: str, declared: dict[str, Requirement] | None = None) -> EndPlan:
    """Resolves ``end`` against the index (pip's resolver, nothing installed): its pins, and what its venv must
    install beyond them."""
    declared = declared or declared_dependencies()
    missing = [name for name in TRANSPORT_LIBRARIES if canonicalize_name(name) not in declared]
    if missing:
        raise SystemExit(f"pyproject.toml declares no {', '.join(missing)}: update TRANSPORT_LIBRARIES")
    transport = {canonicalize_name(n): declared[canonicalize_name(n)] for n in TRANSPORT_LIBRARIES}
    rest = [str(r) for name, r in declared.items() if name not in transport and name not in NOT_RESOLVED]
    if end == "lowest":
        asked = [_pinned(r, lower_bound(r)) for r in transport.values()]
    else:
        asked = [str(r) for r in transport.values()]
    items = resolve(asked + rest)
    resolved = _versions(items)
    pins = {name: resolved[name] for name in transport}
    if end == "newest":
        # The resolver backtracks silently: a newer release within a range that cannot be installed with the
        # others would leave that range's top untested.
        alone = _versions(resolve([str(r) for r in transport.values()], no_deps=True))
        held_back = {name: (pins[name], alone[name]) for name in pins if pins[name] != alone[name]}
        if held_back:
            raise SystemExit(f"newest: held back by the other requirements (resolved, newest alone): {held_back}")
    here = main_venv_versions()
    required = requirements_within(items)
    installs, borrowed = dict(pins), {}
    for name, version in resolved.items():
        if name in pins:
            continue
        mine, specifiers = here.get(name), required.get(name, {})
        if mine is None or not all(s.contains(mine, prereleases=True) for s in specifiers.values()):
            installs[name] = version
        elif pins.keys() & specifiers.keys():
            borrowed[name] = mine
    return EndPlan(end, pins, installs, borrowed)


# --- the venvs --------------------------------------------------------------------------------------------------


def venv_site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def console_scripts(pyproject: Path = PYPROJECT) -> dict[str, str]:
    """[project.scripts]: name -> ``module:function``."""
    return tomllib.loads(pyproject.read_text())["project"].get("scripts", {})


def build_venv(end_plan: EndPlan) -> Path:
    """The end's venv, made anew only when its plan differs from the one it was made for."""
    venv = VENVS / end_plan.end
    stamp = venv / "plan.json"
    wanted = asdict(end_plan) | {"main_venv": sys.prefix}
    if stamp.exists() and json.loads(stamp.read_text()) == wanted:
        print(f"{end_plan.end}: reusing {venv.relative_to(ROOT)}", flush=True)
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    specs = [f"{name}=={version}" for name, version in end_plan.installs.items()]
    print(f"{end_plan.end}: installing {' '.join(specs)}", flush=True)
    # Into the bare venv, before the .pth below exists: pip sees no other copy to uninstall or to count as there.
    pip("install", "--no-deps", "--quiet", "--no-warn-script-location", *specs, python=python)
    main_sites = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    # addsitedir, not a bare path: the main venv's own .pth files (the editable install's finder) must run too.
    # The end's site-packages were put on sys.path before this file ran, so its pins come first.
    lines = [f"import site; site.addsitedir({site!r})" for site in main_sites]
    (venv_site_packages(venv) / "_main_venv.pth").write_text("\n".join(lines) + "\n")
    for name, target in console_scripts().items():
        module, function = target.split(":")
        script = venv / "bin" / name
        script.write_text(f"#!{python}\nimport sys\n\nfrom {module} import {function}\n\nsys.exit({function}())\n")
        script.chmod(0o755)
    stamp.write_text(json.dumps(wanted, indent=1) + "\n")  # last: a venv left half made is made again
    return venv


# Run inside an end's venv: every installed distribution is the planned version and is the venv's own copy, and
# so is every module the service imports from the pinned libraries. Prints the versions.
_VERIFY = """
import importlib, importlib.metadata as md, json, sys
from pathlib import Path
site, expected, modules = Path(sys.argv[1]).resolve(), json.loads(sys.argv[2]), sys.argv[3:]
wrong = []
for name, version in expected.items():
    dist = md.distribution(name)
    where = Path(dist.locate_file("")).resolve()
    if dist.version != version or where != site:
        wrong.append(f"{name} {dist.version} from {where} (planned {version} from {site})")
for module in modules:
    where = Path(importlib.import_module(module).__file__).resolve()
    if site not in where.parents:
        wrong.append(f"module {module} from {where}")
print(", ".join(f"{name} {md.version(name)}" for name in expected))
sys.exit("not as planned:\\n  " + "\\n  ".join(wrong) if wrong else 0)
"""


def verify(venv: Path, end_plan: EndPlan) -> None:
    """Fails unless the venv imports exactly the planned versions from itself and its requirements hold."""
    python = venv / "bin" / "python"
    site = venv_site_packages(venv)
    done = subprocess.run(
        [python, "-c", _VERIFY, str(site), json.dumps(end_plan.installs), *PINNED_MODULES],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"{end_plan.end}: {done.stdout}{done.stderr}")
    print(f"{end_plan.end}: imports {done.stdout.strip()}", flush=True)
    pip("check", python=python)


# --- the runs ---------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one end gave: its pins, each step's exit status and seconds."""

    end: str
    pins: dict[str, str]
    steps: dict[str, tuple[int, float]]

    @property
    def passed(self) -> bool:
        return all(code == 0 for code, _ in self.steps.values())


def _step(outcome: Outcome, name: str, command: list[str]) -> None:
    print(f"{outcome.end}: {name}: {' '.join(command)}", flush=True)
    start = time.monotonic()
    code = subprocess.run(command, cwd=ROOT).returncode
    outcome.steps[name] = (code, time.monotonic() - start)


def _verdict(code: int) -> str:
    return "ok" if code == 0 else f"FAILED ({code})"


def run_end(end: str, workers: int) -> Outcome:
    """Plans, makes and checks the end's venv, then runs the tests and the attack rows in it."""
    start = time.monotonic()
    try:
        end_plan = plan(end)
        venv = build_venv(end_plan)
        verify(venv, end_plan)
    except SystemExit as exc:  # the other end still runs: its result is news of its own
        print(f"{end}: {exc}", file=sys.stderr, flush=True)
        return Outcome(end, {}, {"venv": (1, time.monotonic() - start)})
    outcome = Outcome(end, end_plan.pins, {"venv": (0, time.monotonic() - start)})
    python = str(venv / "bin" / "python")
    xdist = ["-n", str(workers), "--dist", "loadgroup"] if workers else []
    # The slowest tests, for whoever keeps the target within its time.
    pytest = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=8", *xdist, *TESTS]
    _step(outcome, "tests", pytest)
    rows = [arg for row in ATTACK_ROWS for arg in ("--only", row)]
    _step(outcome, "attack", [python, "-m", "benchmarks.attack", *rows, "--check", "--out", str(venv / "attack.json")])
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--end", action="append", choices=ENDS, help="test only this end (repeatable)")
    parser.add_argument("--print-plan", action="store_true", help="print what each end pins, as JSON; install nothing")
    # No workers by default: 2 measured no faster than none here (most of these tests start servers, and the
    # floods run alone under the `exclusive` lock anyway).
    parser.add_argument("--workers", type=int, default=0, help="pytest-xdist workers (0: none)")
    args = parser.parse_args(argv)
    if sys.prefix == sys.base_prefix:
        parser.error("run it with the main venv's Python (.venv/bin/python): the ends' venvs borrow from it")
    ends = args.end or list(ENDS)
    if args.print_plan:
        declared = declared_dependencies()
        ranges = {canonicalize_name(n): str(declared[canonicalize_name(n)].specifier) for n in TRANSPORT_LIBRARIES}
        plans = {end: asdict(plan(end, declared)) for end in ends}
        print(json.dumps({"ranges": ranges, "ends": plans}, indent=1))
        return 0
    start = time.monotonic()
    outcomes = [run_end(end, args.workers) for end in ends]
    print(f"\ntest-deps: {time.monotonic() - start:.0f} s")
    for outcome in outcomes:
        steps = ", ".join(f"{name} {_verdict(code)} {s:.0f} s" for name, (code, s) in outcome.steps.items())
        pins = ", ".join(f"{name} {version}" for name, version in outcome.pins.items())
        total = sum(s for _, s in outcome.steps.values())
        print(f"  {outcome.end}: {'passed' if outcome.passed else 'FAILED'} in {total:.0f} s ({steps}): {pins}")
    return 0 if all(o.passed for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
