"""Where a server's CPU goes per call under load: the service against bench_rpc's Python echo, each on one CPU.

    python -m benchmarks.profile_rpc [--batch medium-64] [--in-flight 32] [--rounds 2] [--seconds 6]
        [--profile-seconds 8] [--rate 500] [--py-spy PATH] [--out-dir DIR]

The servers are started as bench_rpc starts them (the service with ``service_flags("numpy")``, the echo with
``start_echo``, each pinned to the lowest CPU this process may use, this process and the Go load generator on the
others) and driven by the Go load generator (``--in-flight`` calls over 4 connections, one batch's request bytes).
Two parts, the servers alternating:

* ``--rounds`` rounds of ``--seconds`` without a profiler: per call, the server's on-CPU time (each thread's
  ``/proc/PID/task/TID/schedstat``, nanoseconds), its user and system time, voluntary and involuntary context
  switches, times scheduled in, minor page faults; and the same per thread name (gRPC's own threads are named,
  Python's are not). Medians of the rounds.
* one ``py-spy record --native --rate R -d S -f raw`` (collapsed stacks) of each server under the same load;
  without ``--native`` if py-spy cannot unwind natively there. The top frames by self time are printed.

Writes ``DIR/profile-rpc.json`` (with the run record) and ``DIR/{service,echo}.collapsed``. No target: a diagnostic
for issue 36 item 6 (medium's calls/s per core on the GPU machine's Xeon), run there by benchmarks/device_profile.sh.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from benchmarks import loadgen
from benchmarks.bench_rpc import (
    BATCHES,
    LOADGEN_CONNECTIONS,
    METHOD,
    pin_servers,
    record_responses,
    service_flags,
    start_echo,
)
from testkit.harness import ServiceProcess
from testkit.record import write_json

TICK = os.sysconf("SC_CLK_TCK")


def thread_stats(pid: int) -> dict[int, dict[str, float | str]]:
    """Each thread of ``pid``: name, on-CPU ns, times run, user and system ticks, context switches, minor faults."""
    found: dict[int, dict[str, float | str]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            run_ns, _, slices = (int(v) for v in (task / "schedstat").read_text().split()[:3])
            stat = (task / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()  # fields from the 3rd (state) on
            status = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines() if ":" in line)
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
        found[int(task.name)] = {
            "name": name,
            "run_ns": run_ns,
            "slices": slices,
            "minflt": int(fields[7]),
            "utime": int(fields[11]),
            "stime": int(fields[12]),
            "vcsw": int(status["voluntary_ctxt_switches"]),
            "ivcsw": int(status["nonvoluntary_ctxt_switches"]),
        }
    return found


NUMERIC = ("run_ns", "slices", "minflt", "utime", "stime", "vcsw", "ivcsw")


def per_call(before: dict, after: dict, calls: int) -> dict:
    """The deltas between two :func:`thread_stats`, per call, in all and by thread name."""
    by_name: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for tid, now in after.items():
        was = before.get(tid, {})
        for key in NUMERIC:
            by_name[now["name"]][key] += now[key] - was.get(key, 0)
        by_name[now["name"]]["threads"] += 1

    def scaled(counts: collections.Counter) -> dict[str, float]:
        return {
            "cpu_us": counts["run_ns"] / 1e3 / calls,
            "user_us": counts["utime"] / TICK * 1e6 / calls,
            "system_us": counts["stime"] / TICK * 1e6 / calls,
            "voluntary_switches": counts["vcsw"] / calls,
            "involuntary_switches": counts["ivcsw"] / calls,
            "times_run": counts["slices"] / calls,
            "minor_faults": counts["minflt"] / calls,
        }

    total = sum(by_name.values(), collections.Counter())
    return {
        "all": scaled(total),
        "by_thread_name": {
            name: {"threads": counts["threads"], **scaled(counts)}
            for name, counts in sorted(by_name.items(), key=lambda item: -item[1]["run_ns"])
        },
    }


def loaded_round(binary: Path, server: ServiceProcess, request: Path, in_flight: int, seconds: float) -> dict:
    before = thread_stats(server.pid)
    row = loadgen.run(binary, [server], METHOD, request, in_flight, LOADGEN_CONNECTIONS, seconds, 0.0)
    after = thread_stats(server.pid)
    return {
        "calls": row["calls"],
        "calls_per_s": row["calls"] / row["elapsed"],
        **per_call(before, after, row["calls"]),
    }


def profile(
    binary: Path,
    server: ServiceProcess,
    request: Path,
    in_flight: int,
    seconds: float,
    rate: int,
    py_spy: str,
    out: Path,
) -> dict:
    """py-spy on ``server`` for ``seconds`` while the load generator drives it (from a second before to after)."""
    argv = loadgen.command(binary, [server.address], METHOD, request, in_flight, LOADGEN_CONNECTIONS, seconds + 3)
    tried = []
    for native in (True, False):
        client = loadgen.start(argv)
        time.sleep(1.5)
        spy = [py_spy, "record", "--pid", str(server.pid), "--rate", str(rate), "-d", str(int(seconds))]
        spy += ["-f", "raw", "-o", str(out), *(["--native"] if native else [])]
        done = subprocess.run(spy, capture_output=True, text=True, timeout=seconds + 60)
        row = loadgen.result(client, seconds + 3)
        tried.append({"native": native, "rc": done.returncode, "stderr": done.stderr[-1500:]})
        tried[-1]["calls_per_s_while_sampled"] = row["calls"] / row["elapsed"]
        if done.returncode == 0 and out.exists() and out.stat().st_size:
            break
    return {"calls_per_s_while_sampled": tried[-1]["calls_per_s_while_sampled"], "py_spy": tried}


def top_self(collapsed: Path, n: int = 15) -> list[tuple[str, int, float]]:
    """The ``n`` frames with the most samples as the innermost frame: (frame, samples, share)."""
    counts: collections.Counter = collections.Counter()
    for line in collapsed.read_text(errors="replace").splitlines():
        stack, _, samples = line.rpartition(" ")
        if stack and samples.isdigit():
            counts[stack.split(";")[-1]] += int(samples)
    total = sum(counts.values()) or 1
    return [(frame, c, c / total) for frame, c in counts.most_common(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="medium-64", choices=BATCHES)
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--profile-seconds", type=float, default=8.0)
    parser.add_argument("--rate", type=int, default=500)
    parser.add_argument("--py-spy", default="py-spy")
    parser.add_argument("--out-dir", type=Path, default=Path("."))
    args = parser.parse_args()
    server_cpus = pin_servers(True)
    results: dict = {"batch": args.batch, "in_flight": args.in_flight, "rounds": {}, "profiles": {}}
    with tempfile.TemporaryDirectory(prefix="profile-rpc-") as scratch, ExitStack() as stack:
        canned = Path(scratch)
        service = stack.enter_context(ServiceProcess(*service_flags("numpy"), cpus=server_cpus))
        record_responses(service, canned)
        servers = {"service": service, "echo": start_echo(stack, canned, server_cpus)}
        binary = loadgen.binary()
        request = canned / f"{BATCHES.index(args.batch)}.request"
        rows: dict[str, list[dict]] = {name: [] for name in servers}
        names = list(servers)
        for server in servers.values():  # first touches, warm pools
            loaded_round(binary, server, request, args.in_flight, 1.0)
        for turn in range(args.rounds):
            for name in names[turn % 2 :] + names[: turn % 2]:
                rows[name].append(loaded_round(binary, servers[name], request, args.in_flight, args.seconds))
        for name, server in servers.items():
            out = args.out_dir / f"{name}.collapsed"
            results["profiles"][name] = profile(
                binary, server, request, args.in_flight, args.profile_seconds, args.rate, args.py_spy, out
            )
            results["profiles"][name]["top_self"] = top_self(out) if out.exists() else []
        results["rounds"] = rows
    medians = {
        name: {key: float(np.median([r["all"][key] for r in rs])) for key in rs[0]["all"]}
        | {"calls_per_s": float(np.median([r["calls_per_s"] for r in rs]))}
        for name, rs in rows.items()
    }
    results["medians"] = medians
    print(
        f"{args.batch}, {args.in_flight} in flight, servers on CPUs {sorted(server_cpus or [])}; "
        f"medians of {args.rounds} rounds"
    )
    keys = list(medians["service"])
    print(f"{'':22}" + "".join(f"{k:>22}" for k in ("service", "echo", "service - echo")))
    for key in keys:
        s, e = medians["service"][key], medians["echo"][key]
        print(f"{key:22}{s:>22.2f}{e:>22.2f}{s - e:>22.2f}")
    for name in servers:
        print(f"\n{name}: by thread name (last round), cpu us/call, switches/call")
        for thread, row in rows[name][-1]["by_thread_name"].items():
            print(f"  {thread:24} x{row['threads']:<3} {row['cpu_us']:>8.1f} {row['voluntary_switches']:>6.2f}")
        p = results["profiles"][name]
        print(
            f"{name}: py-spy tries {[(t['native'], t['rc']) for t in p['py_spy']]}, calls/s sampled "
            f"{p['calls_per_s_while_sampled']:,.0f}; top frames by self time:"
        )
        for frame, samples, share in p["top_self"]:
            print(f"  {share:6.1%} {samples:>6} {frame[:150]}")
    write_json(args.out_dir / "profile-rpc.json", results)


if __name__ == "__main__":
    sys.exit(main())
