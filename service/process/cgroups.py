"""What the container may use, read from its cgroup (v2, else v1) and its CPU affinity: the memory limit (the
response budget's default, service/overload/admission.py) and the CPUs (how many workers, and whether to pin them,
service/process/supervisor.py). The one place the service reads cgroup files.

cgroup v2: a limit anywhere on the path from this process's cgroup (``/proc/self/cgroup``, ``0::/path``) up to the
root applies, so the smallest over that path counts; inside a container with its own cgroup namespace the path
is ``/`` and the container's own files are at the root. cgroup v1: the ``memory`` and ``cpu`` controllers' files
at the mount root.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
# cgroup v1 says "no memory limit" with a huge number (about 2^63 rounded to a page); v2 says "max".
_V1_NO_LIMIT = 2**60


def _v2_path(root: Path, proc_cgroup: Path) -> list[Path]:
    """This process's cgroup directory and each parent up to ``root`` (nearest first); [] where not cgroup v2."""
    if not (root / "cgroup.controllers").exists():
        return []
    try:
        own = next(
            (line.split("::", 1)[1] for line in proc_cgroup.read_text().splitlines() if line.startswith("0::")), "/"
        )
    except OSError:
        own = "/"
    here = root / own.lstrip("/")
    return [d for d in (here, *here.parents) if d.is_relative_to(root)]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def memory_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int | None:
    """Bytes this process's cgroup may use (the smallest ``memory.max`` on its path), or None where unlimited."""
    v2 = _v2_path(root, proc_cgroup)
    texts = [_read(d / "memory.max") for d in v2] if v2 else [_read(root / "memory" / "memory.limit_in_bytes")]
    limits = [int(t) for t in texts if t is not None and t.isdigit() and int(t) < _V1_NO_LIMIT]
    return min(limits) if limits else None


def cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """CPUs this process's cgroup may use (its CFS quota over its period), or None where there is no quota.

    cgroup v2: ``cpu.max`` (``"max 100000"`` or ``"200000 100000"``) on the path, the smallest; v1:
    ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` (-1: none)."""
    quotas: list[float] = []
    v2 = _v2_path(root, proc_cgroup)
    for directory in v2:
        try:
            quota, period = (_read(directory / "cpu.max") or "").split()[:2]
            if quota != "max" and int(period) > 0:
                quotas.append(int(quota) / int(period))
        except ValueError:
            continue
    if not v2:
        for controller in ("cpu", "cpu,cpuacct"):
            try:
                quota_us = int(_read(root / controller / "cpu.cfs_quota_us") or "")
                period_us = int(_read(root / controller / "cpu.cfs_period_us") or "")
            except ValueError:
                continue
            if quota_us > 0 and period_us > 0:
                quotas.append(quota_us / period_us)
            break
    return min(quotas) if quotas else None


def cpu_set() -> list[int]:
    """The CPUs this process may run on (its affinity, which a cgroup cpuset also narrows), in order."""
    return sorted(os.sched_getaffinity(0))


def available_cpus() -> tuple[int, str]:
    """The CPUs the container may use, and where the figure came from: the cgroup quota rounded up (1.5 CPUs
    run 2 workers, which between them can use the whole quota) or the CPU affinity, whichever is smaller; at
    least 1."""
    affinity = len(cpu_set())
    quota = cpu_quota()
    if quota is not None and math.ceil(quota) < affinity:
        return max(1, math.ceil(quota)), f"cgroup cpu quota {quota:g}"
    return max(1, affinity), f"cpu affinity {affinity}"
