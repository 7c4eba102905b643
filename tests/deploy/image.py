"""``make image-test``: the CPU image built from the Dockerfile, run the way deploy/base runs its pod, and checked
from outside, each step timed.

    python -m tests.deploy.image            # what `make image-test` runs (after `make test` in .ci/run)

1. **engine**: docker where its daemon answers (the first docker CLI on PATH that builds with BuildKit: its buildx
   plugin, or a CLI before 23.0, which carries BuildKit), else podman (podman and buildah installed from the
   distribution where neither exists). Podman's runtime and limits are probed on this machine: a runtime that
   refuses its cgroups (crun on a hybrid cgroup hierarchy) gives way to runc, and limits above the machine's hard
   limits (podman asks for more open files and processes than this host lets it) are lowered to what it allows.
2. **base**: the Dockerfile's pinned CPU base where its registry answers, else the equivalent base made here from
   the distribution's packages (mmdebstrap: the same Debian release, Python 3.11 with its headers, pip, venv, CA
   certificates) and imported, kept in the engine's storage under a name that hashes its recipe; it says which.
3. **wheels**: every file of requirements/image-cpu.txt in .cache/wheelhouse/cpu, fetched by this machine's pip
   with this machine's configuration (its indexes, find-links, CA bundle); the build mounts that directory for its
   install step (build argument PIP_WHEELHOUSE), so nothing of the configuration reaches the image.
   **gpu lock**: requirements/image-gpu.txt resolved (nothing downloaded) for the Python its header names, the GPU
   base's, on the image's platform: the GPU variant is not built here, its lock is checked.
4. **build**: `--build-arg VARIANT=cpu`, each step's seconds printed.
5. **image**: size (at most 2.0 GB), no C compiler, both C extensions load, no build tree or pip configuration,
   the HEALTHCHECK kept (podman keeps it in the docker format only), the commit named (label and environment).
   **revision**: the tree built again for another commit on that layer cache names the new commit (buildah reuses
   a cached LABEL or ENV whose ARG changed) and shares every other layer with the image.
6. **pod**: the initContainer seeds the Triton cache into a volume, then the server runs as deploy/base's container
   does: uid/gid 10001, read-only root, every capability dropped, no new privileges, tmpfs /tmp, the model
   ConfigMap read-only, the pod's environment and memory limit; its ports published on 127.0.0.1 only. Then:
   ready (the health port and /readyz, seconds from container start), every warmup key loaded from the cache (the
   metric, and KEY_STATE_CACHED in GetWarmupStatus) and proved, BuildChunk over gRPC and over HTTP JSON equal to the
   golden answers, the image's HEALTHCHECK, `indexer-service check`, no compile after ready,
   scripts/check-prebuilt-cache.sh inside the running container (every default port taken there), and SIGTERM:
   NOT_SERVING within 1 s, exit 0.

Containers and volumes are removed at the end, pass or fail; the image stays, tagged IMAGE_TAG, with its layers in
the engine's storage (podman's /var/lib/containers persists on the machine): the next run builds from that cache.
Environment: IMAGE_ENGINE (docker, podman), IMAGE_BASE (auto, pinned, local), IMAGE_TAG, IMAGE_READY_SECONDS (the
ready-time target, 2.0 s, reported), IMAGE_READY_LIMIT (10 s: a start slower than this fails).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from testkit.paths import REPO

if TYPE_CHECKING:
    from indexer_service.protos.indexer.v1 import indexer_pb2 as pb

DOCKERFILE = REPO / "Dockerfile"
DEPLOY_BASE = REPO / "deploy" / "base"
LOCK = REPO / "requirements" / "image-cpu.txt"
# Inside the build context (.dockerignore lets it through); the build mounts it for its install step only.
WHEELHOUSE = ".cache/wheelhouse/cpu"
WORK = REPO / ".cache" / "image-test"
TAG = os.environ.get("IMAGE_TAG", "localhost/indexer-service:image-test-cpu")
# The commit the image is built from: its REVISION build argument (the revision label, and the build the server names).
REVISION = (
    subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip() or "unknown"
)
REVISION_LABEL = "org.opencontainers.image.revision"  # the Dockerfile's, from that build argument
# The targets of the issue this test holds the image to.
IMAGE_SIZE_LIMIT = 2_000_000_000
READY_SECONDS = float(os.environ.get("IMAGE_READY_SECONDS", "2.0"))
# Reported against READY_SECONDS, failed only past this: on a 2-core machine shared with other jobs, torch's import
# alone (which Triton 3.6's argument binder makes every warmup pay) took 1.7-2.1 s.
READY_LIMIT = float(os.environ.get("IMAGE_READY_LIMIT", "10.0"))
NOT_SERVING_SECONDS = 1.0

# The base made here when the pinned one cannot be pulled: what python:3.11-slim-bookworm is, from Debian's own
# packages (Debian 12's python3 is 3.11, the CPU lock's Python). python3-dev: the headers the C extensions build
# against; python3-venv: the image's virtual environment; python-is-python3: `python`, as the pinned base has.
LOCAL_BASE_NAME = "localhost/indexer-base-cpu"
LOCAL_BASE_SUITE = "bookworm"
LOCAL_BASE_PACKAGES = ("python3", "python3-dev", "python3-pip", "python3-venv", "python-is-python3", "ca-certificates")
LOCAL_BASE_MIRRORS = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
# Documentation, manuals and translations are left out, as the slim images leave them out.
LOCAL_BASE_DPKG_OPTIONS = (
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/locale/*",
)

# pip download's view of the image: CPython 3.11 on x86_64 glibc (the lock's platform, scripts/lock-image-deps.py).
WHEEL_PLATFORMS = ("manylinux2014_x86_64", *(f"manylinux_2_{minor}_x86_64" for minor in range(17, 29)))

# Messages whose presence in a log is a defect (each came with an image that built and served).
PROOF_SKIPPED = "proof skipped"
PIP_HOME_WARNING = "is not owned by the current user"
NO_FAST_PATH = "not built"


class CheckFailed(AssertionError):
    """One check of the image failed: the message says which and what was seen."""


def check(condition: object, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


# --- reporting ------------------------------------------------------------------------------------------------


@dataclass
class Steps:
    """Each step's wall seconds, printed as it ends and summed up at the end."""

    seconds: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    ready: float | None = None  # seconds from the server container's start to ready

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        print(f"== {name}", flush=True)
        start = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = time.monotonic() - start
            print(f"   {name}: {self.seconds[name]:.2f} s", flush=True)

    def note(self, name: str, text: str) -> None:
        self.notes[name] = text
        print(f"   {text}", flush=True)

    def summary(self) -> str:
        width = max(map(len, self.seconds), default=0)
        lines = [f"  {name:<{width}}  {seconds:7.2f} s" for name, seconds in self.seconds.items()]
        lines.append(f"  {'total':<{width}}  {sum(self.seconds.values()):7.2f} s")
        if self.ready is not None:
            verdict = "met" if self.ready <= READY_SECONDS else "missed"
            lines.append(
                f"  ready {self.ready:.2f} s after the container started (target {READY_SECONDS} s: {verdict})"
            )
        return "\n".join(lines)


def run(argv: Sequence[str], *, timeout: float = 600, check_rc: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """``argv`` to its end, output captured as text; a non-zero exit fails with its output unless ``check_rc`` is
    off."""
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False, **kwargs)
    if check_rc and out.returncode != 0:
        raise CheckFailed(f"{shlex.join(argv)} exited {out.returncode}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return out


def sudo() -> list[str]:
    return [] if os.geteuid() == 0 else ["sudo"]


def apt_install(*packages: str) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run([*sudo(), "apt-get", "update", "-qq"], env=env)
    run([*sudo(), "apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages], env=env)


# --- the engine -----------------------------------------------------------------------------------------------


def hard_limits() -> dict[str, int]:
    """This process's hard limits on open files and processes: what any container started from here can get."""
    limits = {}
    for name, which in (("nofile", resource.RLIMIT_NOFILE), ("nproc", resource.RLIMIT_NPROC)):
        hard = resource.getrlimit(which)[1]
        limits[name] = hard if hard != resource.RLIM_INFINITY else 1 << 20
    return limits


def ulimit_candidates(limits: dict[str, int]) -> list[tuple[str, ...]]:
    """The --ulimit settings to try, in order: the engine's own defaults, then the machine's hard limits, then
    lower process limits (podman runs its monitor under a process limit of its own, 32768, and a container cannot
    raise past it without CAP_SYS_RESOURCE)."""
    nofile = min(limits["nofile"], 1 << 20)
    nprocs = sorted({min(limits["nproc"], cap) for cap in (limits["nproc"], 32768, 4096)}, reverse=True)
    return [(), *((f"--ulimit=nofile={nofile}:{nofile}", f"--ulimit=nproc={n}:{n}") for n in nprocs)]


@dataclass
class Engine:
    """docker or podman, with the options this machine needs: global ones (podman's runtime) and limits for every
    container (build steps included); for docker, the CLI that builds with BuildKit (``cli``, by default the one
    named ``name`` on PATH) and how (``builder``: the build command's words, ``build_env``: its environment)."""

    name: str
    global_options: tuple[str, ...] = ()
    limits: tuple[str, ...] = ()
    cli: str = ""
    builder: tuple[str, ...] = ("build",)
    build_env: dict[str, str] = field(default_factory=dict)

    def argv(self, *args: str) -> list[str]:
        return [self.cli or self.name, *self.global_options, *args]

    def __call__(self, *args: str, timeout: float = 600, check_rc: bool = True) -> subprocess.CompletedProcess:
        return run(self.argv(*args), timeout=timeout, check_rc=check_rc)

    @property
    def podman(self) -> bool:
        return self.name == "podman"

    def image_exists(self, ref: str) -> bool:
        return self("image", "inspect", ref, check_rc=False, timeout=120).returncode == 0

    def inspect(self, what: str, ref: str) -> dict:
        (info,) = json.loads(self(what, "inspect", ref, timeout=120).stdout)
        return info

    def run_options(self, healthcheck: bool = False) -> list[str]:
        """Options of every `run`: the limits, no pull (every image is local by then), and no HEALTHCHECK but for
        the server (podman would try to schedule it with systemd timers, which a machine without systemd lacks;
        this test runs it itself)."""
        return [*self.limits, "--pull=never", *(() if healthcheck else ("--no-healthcheck",))]


def works(argv: list[str], env: dict[str, str] | None = None) -> bool:
    return (
        shutil.which(argv[0]) is not None
        and run(argv, check_rc=False, timeout=120, env={**os.environ, **(env or {})}).returncode == 0
    )


def executables(name: str, path: str | None = None) -> list[str]:
    """Every executable called ``name`` on PATH, in PATH's order (``which -a``)."""
    found: list[str] = []
    for folder in (os.environ.get("PATH", "") if path is None else path).split(os.pathsep):
        candidate = os.path.join(folder or ".", name)
        real = os.path.realpath(candidate)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK) and real not in map(os.path.realpath, found):
            found.append(candidate)
    return found


# The first docker CLI release whose `docker build` needs the buildx plugin for BuildKit (before it, BuildKit was
# built in, behind DOCKER_BUILDKIT=1).
DOCKER_BUILDX_REQUIRED = 23


def docker_builder(cli: str) -> tuple[tuple[str, ...], dict[str, str]] | None:
    """How ``cli`` builds with BuildKit, which the Dockerfile's `RUN --mount` needs: ``docker buildx build --load``
    where the buildx plugin is installed; ``docker build`` with DOCKER_BUILDKIT=1 where the CLI predates 23.0 and
    carries BuildKit itself; None where it can do neither (a newer CLI without buildx would fall back to the legacy
    builder, which refuses `RUN --mount`)."""
    if works([cli, "buildx", "version"]):
        return ("buildx", "build", "--load"), {}
    version = run([cli, "version", "--format", "{{.Client.Version}}"], check_rc=False).stdout.strip()
    major = re.match(r"(\d+)\.", version)
    if major and int(major.group(1)) < DOCKER_BUILDX_REQUIRED:
        return ("build",), {"DOCKER_BUILDKIT": "1"}
    return None


def find_docker(steps: Steps) -> Engine | None:
    """docker, where its daemon answers: the first docker CLI on PATH that builds with BuildKit (a machine may carry
    several: a distribution's beside a newer one without the buildx plugin). Fails where the daemon answers but no
    CLI can build the image; None where no daemon answers."""
    clis = executables("docker")
    if not clis or not works([clis[0], "info"]):
        return None
    refused = []
    for cli in clis:
        builder = docker_builder(cli)
        if builder is not None and works([cli, "info"]):
            version = run([cli, "version", "--format", "client {{.Client.Version}}, daemon {{.Server.Version}}"])
            said = f"docker ({cli}: {version.stdout.strip()}; builds with `{' '.join(('docker', *builder[0]))}`"
            if refused:
                said += f"; passed over {', '.join(refused)}: no buildx plugin, and no BuildKit of its own"
            steps.note("engine", said + ")")
            return Engine("docker", cli=cli, builder=builder[0], build_env=builder[1])
        refused.append(cli)
    raise CheckFailed(
        f"the docker daemon answers, but no docker CLI here builds with BuildKit, which the Dockerfile's RUN --mount "
        f"needs: {', '.join(clis)} (install the buildx plugin: docker-buildx-plugin, or Debian's docker-buildx), "
        "or run with IMAGE_ENGINE=podman"
    )


def find_engine(steps: Steps) -> Engine:
    """IMAGE_ENGINE, else docker where its daemon answers, else podman (installed with buildah where missing)."""
    wanted = os.environ.get("IMAGE_ENGINE", "")
    if wanted not in ("", "docker", "podman"):
        raise CheckFailed(f"IMAGE_ENGINE={wanted}: docker or podman")
    if wanted in ("", "docker") and (docker := find_docker(steps)) is not None:
        return docker
    if wanted == "docker":
        raise CheckFailed("IMAGE_ENGINE=docker, but `docker info` fails: no daemon answers")
    if shutil.which("podman") is None:
        steps.note("engine", "neither docker nor podman here: installing podman and buildah from the distribution")
        apt_install("podman", "buildah")
    if not works(["podman", "info"]):
        raise CheckFailed(f"podman info fails:\n{run(['podman', 'info'], check_rc=False).stderr}")
    steps.note("engine", f"podman ({run(['podman', '--version']).stdout.strip()})")
    return Engine("podman")


def settle_podman(engine: Engine, image: str, steps: Steps) -> Engine:
    """The runtime and limits under which podman starts a container here: its default runtime first, then runc
    (installed where missing); for each, its own limits first, then this machine's. Docker's daemon sets its own."""
    if not engine.podman:
        return engine
    failures = []
    for runtime in (None, "runc"):
        if runtime is not None and shutil.which(runtime) is None:
            apt_install(runtime)
        options = ("--runtime", runtime) if runtime else ()
        for limits in ulimit_candidates(hard_limits()):
            candidate = Engine(engine.name, options, limits)
            out = candidate("run", "--rm", *candidate.run_options(), "--network=none", image, "true", check_rc=False)
            if out.returncode == 0:
                said = f"podman: runtime {runtime or 'default'}, " + (" ".join(limits) or "its default limits")
                if failures:  # what was refused on the way, each once
                    said += "; refused before: " + "; ".join(dict.fromkeys(f[-90:] for f in failures))
                steps.note("runtime", said)
                return candidate
            failures.append(last_line(out.stderr))
    raise CheckFailed("podman cannot start a container here:\n" + "\n".join(failures))


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


# --- the base -------------------------------------------------------------------------------------------------


def dockerfile_arg(name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE.read_text(), re.M)
    check(match, f"the Dockerfile has no ARG {name}=...")
    return match.group(1).strip('"')


def local_base_recipe() -> dict:
    return {
        "suite": LOCAL_BASE_SUITE,
        "variant": "minbase",
        "packages": list(LOCAL_BASE_PACKAGES),
        "mirrors": list(LOCAL_BASE_MIRRORS),
        "dpkg": list(LOCAL_BASE_DPKG_OPTIONS),
    }


def local_base_tag() -> str:
    digest = hashlib.sha256(json.dumps(local_base_recipe(), sort_keys=True).encode()).hexdigest()[:12]
    return f"{LOCAL_BASE_NAME}:{LOCAL_BASE_SUITE}-{digest}"


def mmdebstrap_command(tarball: Path) -> list[str]:
    recipe = local_base_recipe()
    return [
        *sudo(),
        "mmdebstrap",
        f"--variant={recipe['variant']}",
        f"--include={','.join(recipe['packages'])}",
        *(f"--dpkgopt={option}" for option in recipe["dpkg"]),
        recipe["suite"],
        str(tarball),
        *recipe["mirrors"],
    ]


def choose_base(engine: Engine, steps: Steps) -> str:
    """The CPU base to build on: the pinned one where it is here or its registry answers, else the local one."""
    pinned = dockerfile_arg("CPU_BASE")
    mode = os.environ.get("IMAGE_BASE", "auto")
    if mode not in ("auto", "pinned", "local"):
        raise CheckFailed(f"IMAGE_BASE={mode}: auto, pinned or local")
    if mode != "local":
        if engine.image_exists(pinned):
            steps.note("base", f"the pinned base {pinned} (already here)")
            return pinned
        pulled = engine("pull", pinned, check_rc=False, timeout=900)
        if pulled.returncode == 0:
            steps.note("base", f"the pinned base {pinned} (pulled)")
            return pinned
        if mode == "pinned":
            raise CheckFailed(f"IMAGE_BASE=pinned, but {pinned} cannot be pulled: {last_line(pulled.stderr)}")
        steps.note("base", f"its registry does not answer ({last_line(pulled.stderr)[:160]})")
    tag = local_base_tag()
    if engine.image_exists(tag):
        steps.note("base", f"the local base {tag} (made earlier from Debian's packages)")
        return tag
    if shutil.which("mmdebstrap") is None:
        apt_install("mmdebstrap")
    WORK.mkdir(parents=True, exist_ok=True)
    tarball = WORK / "base.tar"
    start = time.monotonic()
    run(mmdebstrap_command(tarball), timeout=1200)
    engine(
        "import",
        "--change",
        'CMD ["python3"]',
        "--change",
        "ENV LANG=C.UTF-8",
        str(tarball),
        tag,
        timeout=600,
    )
    tarball.unlink()
    steps.note(
        "base",
        f"the local base {tag}, made now from Debian {LOCAL_BASE_SUITE}'s packages in {time.monotonic() - start:.0f} s",
    )
    return tag


# --- the wheels -----------------------------------------------------------------------------------------------


def lock_hashes(text: str) -> set[str]:
    return set(re.findall(r"--hash=sha256:([0-9a-f]{64})", text))


def lock_python(text: str) -> str:
    """The Python a lock was resolved for (its `# python:` header line), which its image's base must have."""
    match = re.search(r"^# python: (\d+)\.(\d+)$", text, re.M)
    check(match, "a lock without its `# python: X.Y` line: regenerate it with scripts/lock-image-deps.py")
    return f"{match.group(1)}.{match.group(2)}"


def image_platform_pip(command: str, python: str, *options: str) -> list[str]:
    """This machine's pip (its configuration, indexes, CA bundle) running ``command`` for a lock's files on the
    image's platform and ``python``: binary files only, nothing resolved beyond the lock."""
    return [
        sys.executable,
        "-m",
        "pip",
        command,
        "--quiet",
        *options,
        "--no-deps",
        "--only-binary=:all:",
        f"--python-version={python}",
        "--implementation=cp",
        f"--abi=cp{python.replace('.', '')}",
        *(f"--platform={p}" for p in WHEEL_PLATFORMS),
    ]


def wheel_download_command(requirements: Path, destination: Path, python: str = "3.11") -> list[str]:
    """The lock's files fetched by hash for the image's Python and platform."""
    return [
        *image_platform_pip("download", python, "--require-hashes"),
        f"--dest={destination}",
        f"--requirement={requirements}",
    ]


def lock_resolution_command(requirements: Path, python: str) -> list[str]:
    """pip finding, for every requirement of a lock, a file for ``python`` on the image's platform, downloading
    nothing: the GPU lock cannot be installed here (no GPU base), but it can be resolved for its Python."""
    return [
        *image_platform_pip("install", python, "--dry-run", "--ignore-installed"),
        f"--target={WORK / 'lock-resolution'}",
        f"--requirement={requirements}",
    ]


def check_gpu_lock(steps: Steps) -> None:
    """requirements/image-gpu.txt, resolved for the Python its header names (the GPU base's) on the image's
    platform: every pinned version has a file there."""
    lock = REPO / "requirements" / "image-gpu.txt"
    text = lock.read_text()
    python = lock_python(text)
    bare = WORK / "image-gpu.requirements.txt"
    bare.write_text("".join(line for line in text.splitlines(keepends=True) if not line.startswith("--")))
    out = run(lock_resolution_command(bare, python), check_rc=False, timeout=600)
    check(out.returncode == 0, f"the GPU lock does not resolve for Python {python}:\n{out.stderr[-2000:]}")
    steps.note("gpu lock", f"requirements/image-gpu.txt resolves for Python {python} on x86_64 manylinux")


def fill_wheelhouse(steps: Steps) -> None:
    """Every file of the CPU lock in WHEELHOUSE, and nothing else. First from the machine's pip configuration alone
    (the lock's own --find-links host may not answer here); then, for what is still missing, with the lock's
    options too."""
    destination = REPO / WHEELHOUSE
    destination.mkdir(parents=True, exist_ok=True)
    lock = LOCK.read_text()
    wanted = lock_hashes(lock)
    for path in destination.iterdir():  # a file of an older lock
        if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() not in wanted:
            path.unlink()
    WORK.mkdir(parents=True, exist_ok=True)
    bare = WORK / "image-cpu.requirements.txt"
    bare.write_text("".join(line for line in lock.splitlines(keepends=True) if not line.startswith("--")))
    python = lock_python(lock)
    out = run(wheel_download_command(bare, destination, python), check_rc=False, timeout=1800)
    if out.returncode != 0:
        steps.note("wheels", f"not all found through this machine's pip configuration: {last_line(out.stderr)}")
        run(wheel_download_command(LOCK, destination, python), timeout=1800)
    count = sum(1 for p in destination.iterdir() if p.suffix == ".whl")
    size = sum(p.stat().st_size for p in destination.iterdir())
    steps.note("wheels", f"{count} files, {size / 1e6:.0f} MB in {WHEELHOUSE}")


# --- the build ------------------------------------------------------------------------------------------------


def machine_pip_cert() -> str | None:
    """The CA bundle this machine's pip is configured with (PIP_CERT or pip.conf's cert), if any."""
    cert = os.environ.get("PIP_CERT")
    if not cert:
        out = run([sys.executable, "-m", "pip", "config", "get", "global.cert"], check_rc=False)
        cert = out.stdout.strip() if out.returncode == 0 else ""
    return cert if cert and Path(cert).is_file() else None


def build_command(engine: Engine, base: str, revision: str = REVISION, tag: str = TAG) -> list[str]:
    """The build: the CPU variant on ``base``, pip reading the wheelhouse alone. The machine's CA bundle goes in as
    the `pip-cert` build secret, mounted for the install step and kept in no layer (the image's check below looks
    for it); not its pip.conf, whose paths (find-links, constraints) lie on this machine, not in the build."""
    args = [
        *engine.builder,
        "--build-arg=VARIANT=cpu",
        f"--build-arg=CPU_BASE={base}",
        f"--build-arg=REVISION={revision}",
    ]
    args += [f"--build-arg=PIP_WHEELHOUSE={WHEELHOUSE}", "--tag", tag, "--file", str(DOCKERFILE)]
    if cert := machine_pip_cert():
        args.append(f"--secret=id=pip-cert,src={cert}")
    if engine.podman:
        # The OCI format has no HEALTHCHECK: podman would drop it. Its limits apply to the build's steps too.
        args += ["--format=docker", "--layers", *engine.limits]
    else:
        args += ["--progress=plain"]
    return engine.argv(*args, str(REPO))


def build(
    engine: Engine, base: str, steps: Steps, revision: str = REVISION, tag: str = TAG, log_name: str = "build.log"
) -> str:
    """Builds the image, printing each build step that took a second or more; returns the build's output."""
    WORK.mkdir(parents=True, exist_ok=True)
    log_path = WORK / log_name
    env = {**os.environ, **engine.build_env}
    lines: list[str] = []
    timings: list[tuple[float, str]] = []
    current, since = "", time.monotonic()
    with (
        log_path.open("w") as log,
        subprocess.Popen(
            build_command(engine, base, revision, tag),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        ) as process,
    ):
        for line in process.stdout:
            log.write(line)
            lines.append(line)
            step = re.match(r"(\[\d+/\d+\] STEP \d+/\d+: .*)", line)
            if step:
                timings.append((time.monotonic() - since, current))
                current, since = step.group(1), time.monotonic()
        process.wait()
    timings.append((time.monotonic() - since, current))
    text = "".join(lines)
    check(process.returncode == 0, f"the build failed (exit {process.returncode}); its log: {log_path}\n{text[-4000:]}")
    if not engine.podman:  # BuildKit's plain progress says each step's own seconds
        timings = buildkit_step_seconds(text)
    for seconds, what in timings:
        if what and seconds >= 1.0:
            print(f"   {seconds:6.1f} s  {what[:110]}", flush=True)
    cached = text.count("Using cache") + len(re.findall(r"^#\d+ CACHED$", text, re.M))
    steps.note("build", f"{cached} steps from the layer cache; log: {log_path.relative_to(REPO)}")
    return text


def buildkit_step_seconds(text: str) -> list[tuple[float, str]]:
    """Each step's seconds from BuildKit's plain progress (``#8 [deps 2/6] RUN ...`` then ``#8 DONE 35.2s``), in
    the order the steps began; a step from the cache says CACHED and no seconds."""
    names: dict[str, str] = {}
    seconds: dict[str, float] = {}
    for line in text.splitlines():
        if began := re.match(r"#(\d+) (\[[^\]]+\] .*)", line):
            names.setdefault(began.group(1), began.group(2))
        elif done := re.match(r"#(\d+) DONE (\d+(?:\.\d+)?)s", line):
            seconds[done.group(1)] = float(done.group(2))
    return [(seconds[step], name) for step, name in names.items() if step in seconds]


def check_build_log(text: str) -> None:
    """What a build's output must never say (a step from the cache says nothing, which the pod's checks cover)."""
    check(PROOF_SKIPPED not in text, "the build's precompile skipped a proof:\n" + grep(text, PROOF_SKIPPED))
    check(PIP_HOME_WARNING not in text, "pip warned about its cache's owner (HOME set before a root pip step)")


def grep(text: str, needle: str) -> str:
    return "\n".join(line for line in text.splitlines() if needle in line)


def image_env(info: dict) -> dict[str, str]:
    """An image's environment (its inspected config's ``NAME=value`` list)."""
    return dict(item.partition("=")[::2] for item in (info.get("Config") or {}).get("Env", []))


def check_names_commit(info: dict, revision: str) -> None:
    """The inspected image names ``revision`` in its revision label and in both variables the server reads it from
    (``--version``, the start line, ``indexer_build_info``)."""
    labels = (info.get("Config") or {}).get("Labels") or info.get("Labels") or {}
    env = image_env(info)
    named = (labels.get(REVISION_LABEL), env.get("INDEXER_BUILD_COMMIT"), env.get("INDEXER_IMAGE_REVISION"))
    check(named == (revision,) * 3, f"the image does not name its commit {revision}: labels {labels}, env {env}")


def check_revision_rebuild(engine: Engine, base: str, steps: Steps) -> None:
    """The same tree built again for another commit, on the layer cache the build above left: the image must name
    that commit, not the one its cached layers were built for, and share every layer but the revision's own with
    the image above (the environment, the project and the compiled cache come from the cache)."""
    other, tag = f"rebuilt-{REVISION}", f"{TAG}-revision"
    build(engine, base, steps, revision=other, tag=tag, log_name="build-revision.log")
    try:
        rebuilt = engine.inspect("image", tag)
    finally:
        engine("rmi", tag, check_rc=False)
    check_names_commit(rebuilt, other)  # else a LABEL or ENV layer cached for another commit was reused
    before, after = engine.inspect("image", TAG)["RootFS"]["Layers"], rebuilt["RootFS"]["Layers"]
    check(
        len(after) == len(before) and after[:-1] == before[:-1],
        f"a new commit must change only the revision's own layer, not the environment, the project or the "
        f"compiled cache: layers before {before}, after {after}",
    )
    steps.note(
        "revision",
        f"built again for another commit: names it, and shares {len(before) - 1} of its "
        f"{len(before)} layers with the image above",
    )


# --- the image ------------------------------------------------------------------------------------------------


def run_in_image(engine: Engine, script: str, *, user: str = "10001:10001") -> subprocess.CompletedProcess:
    return engine(
        "run", "--rm", *engine.run_options(), "--network=none", "--user", user, "--entrypoint", "sh", TAG, "-c", script
    )


def machine_pip_values() -> list[str]:
    """This machine's pip configuration values that are paths or addresses: none may be found in the image."""
    out = run([sys.executable, "-m", "pip", "config", "list"], check_rc=False)
    values = []
    for line in out.stdout.splitlines():
        _, _, value = line.partition("=")
        for token in value.strip().strip("'\"").split():
            if "/" in token:
                values.append(token)
    return values


def check_image(engine: Engine, steps: Steps) -> dict:
    """Size, HEALTHCHECK, no compiler, the extensions, no build tree, nothing of the machine's pip configuration."""
    info = engine.inspect("image", TAG)
    size = int(info["Size"])
    steps.note("image", f"{TAG}: {size / 1e9:.2f} GB ({size} bytes)")
    check(size <= IMAGE_SIZE_LIMIT, f"the image is {size / 1e9:.2f} GB, over {IMAGE_SIZE_LIMIT / 1e9:.1f} GB")
    config = info.get("Config") or {}
    healthcheck = config.get("Healthcheck") or info.get("Healthcheck") or {}
    check(healthcheck.get("Test"), f"the image has no HEALTHCHECK (podman keeps it in the docker format): {info}")
    check(config.get("User") == "10001:10001", f"the image runs as {config.get('User')!r}, not 10001:10001")
    env = image_env(info)
    check(not [k for k in env if k.startswith("PIP_")], f"pip settings in the image's environment: {env}")
    check_names_commit(info, REVISION)
    probe = run_in_image(
        engine,
        "set -e; for cc in gcc cc c99 clang tcc x86_64-linux-gnu-gcc; do if command -v $cc; then exit 3; fi; done; "
        'python -c "import indexer_service.service.compute._fastpath, indexer_service.service.overload._budget"; '
        "ls -A /opt/indexer; find /opt/indexer/app -maxdepth 1 -name '*.egg-info' -o -maxdepth 1 -name build; "
        "ls -A /etc/pip.conf /etc/xdg/pip /root/.config/pip 2>/dev/null || true",
    )
    check(
        probe.stdout.split() == ["app", "triton-cache", "venv"],
        f"/opt/indexer holds more than the project, its environment and the cache (a build tree?), or a pip "
        f"configuration is in the image:\n{probe.stdout}",
    )
    history = engine("history", "--no-trunc", "--format", "{{.CreatedBy}}", TAG).stdout
    leaked = [value for value in machine_pip_values() if value in history or value in json.dumps(config)]
    check(not leaked, f"the machine's pip configuration is in the image's history or config: {leaked}")
    steps.note("image", "no compiler, both C extensions load, no build tree, no pip configuration, HEALTHCHECK kept")
    return healthcheck


# --- the pod --------------------------------------------------------------------------------------------------


@dataclass
class Pod:
    """deploy/base's Deployment, as far as one machine's container engine can replay it."""

    deployment: dict
    model_files: dict[str, str]

    @classmethod
    def from_base(cls) -> Pod:
        kustomization = yaml.safe_load((DEPLOY_BASE / "kustomization.yaml").read_text())
        (deployment,) = [
            doc
            for doc in yaml.safe_load_all((DEPLOY_BASE / "deployment.yaml").read_text())
            if doc and doc["kind"] == "Deployment"
        ]
        generator = next(g for g in kustomization["configMapGenerator"] if g["name"] == "indexer-model-config")
        files = {}
        for entry in generator["files"]:
            key, _, source = entry.partition("=")
            files[key] = (DEPLOY_BASE / (source or key)).read_text()
        return cls(deployment, files)

    @property
    def spec(self) -> dict:
        return self.deployment["spec"]["template"]["spec"]

    @property
    def init(self) -> dict:
        (init,) = self.spec["initContainers"]
        return init

    @property
    def server(self) -> dict:
        return next(c for c in self.spec["containers"] if c["name"] == "indexer")

    def volume(self, name: str) -> dict:
        return next(v for v in self.spec["volumes"] if v["name"] == name)


def memory_option(quantity: str) -> str:
    """A Kubernetes memory quantity (Mi, Gi...) as an engine's --memory value."""
    match = re.fullmatch(r"(\d+)([KMGT]i)?", str(quantity))
    check(match, f"memory quantity {quantity!r} not understood")
    return match.group(1) + {"Ki": "k", "Mi": "m", "Gi": "g", "Ti": "t", None: "b"}[match.group(2)]


def cpu_cores(quantity: str) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def container_env(pod: Pod, c: dict) -> dict[str, str]:
    """The container's environment: its values, and the downward API's resource fields as the kubelet resolves
    them (rounded up to the divisor)."""
    env = {}
    for item in c.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
        elif "resourceFieldRef" in item.get("valueFrom", {}):
            ref = item["valueFrom"]["resourceFieldRef"]
            kind, resource_name = ref["resource"].split(".")
            amount = cpu_cores(c["resources"][kind][resource_name])
            env[item["name"]] = str(-(-amount // float(ref.get("divisor", 1))).__int__())
        else:
            source = item.get("valueFrom")
            raise CheckFailed(f"{c['name']}: env {item['name']} comes from {source}: not replayable here")
    return env


def security_options(engine: Engine, pod: Pod, c: dict) -> list[str]:
    """The pod's and the container's securityContext as engine options; a setting with no counterpart fails."""
    pod_context, context = pod.spec.get("securityContext", {}), c.get("securityContext", {})
    merged = {**pod_context, **context}
    options = ["--user", f"{merged['runAsUser']}:{merged['runAsGroup']}"]
    if "fsGroup" in pod_context:
        options += ["--group-add", str(pod_context["fsGroup"])]
    if context.get("readOnlyRootFilesystem"):
        options.append("--read-only")
        if engine.podman:
            options.append("--read-only-tmpfs=false")  # podman adds writable /tmp, /run, /var/tmp; a pod has none
    if context.get("allowPrivilegeEscalation") is False:
        options += ["--security-opt", "no-new-privileges"]
    for capability in context.get("capabilities", {}).get("drop", []):
        options += ["--cap-drop", capability]
    check(not context.get("capabilities", {}).get("add"), "added capabilities are not replayed")
    seccomp = merged.get("seccompProfile", {}).get("type", "RuntimeDefault")
    check(seccomp == "RuntimeDefault", f"seccomp {seccomp}: only RuntimeDefault (the engine's default) is replayed")
    memory = c.get("resources", {}).get("limits", {}).get("memory")
    if memory:
        options += ["--memory", memory_option(memory)]
    return options


@dataclass
class Running:
    """A started server container and what the host reaches it by."""

    name: str
    ports: dict[str, int]  # container port name -> host port on 127.0.0.1
    started_at: float  # the engine's start time of the container, epoch seconds
    pid: int


def epoch(stamp: str) -> float:
    """An engine's RFC 3339 time (nanoseconds, Z or an offset) as epoch seconds."""
    match = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", stamp)
    check(match, f"time {stamp!r} not understood")
    whole = datetime.fromisoformat(match.group(1) + (match.group(3).replace("Z", "+00:00")))
    return whole.timestamp() + float("0." + (match.group(2) or "0"))


class PodRun:
    """The pod on this machine: its volumes and containers, every one of them removed at the end."""

    def __init__(self, engine: Engine, pod: Pod) -> None:
        self.engine, self.pod = engine, pod
        self.suffix = f"{os.getpid()}"
        self.volumes: list[str] = []
        self.containers: list[str] = []
        self.model_dir = WORK / f"model-{self.suffix}"

    def close(self) -> None:
        for name in self.containers:
            self.engine("rm", "--force", name, check_rc=False)
        for name in self.volumes:
            self.engine("volume", "rm", "--force", name, check_rc=False)
        shutil.rmtree(self.model_dir, ignore_errors=True)

    def empty_dir(self, name: str) -> str:
        """An emptyDir: a fresh volume, writable by the pod's group as the kubelet's fsGroup makes it."""
        volume = f"indexer-image-test-{name}-{self.suffix}"
        self.engine("volume", "create", volume)
        self.volumes.append(volume)
        group = self.pod.spec.get("securityContext", {}).get("fsGroup", 0)
        self.engine(
            "run",
            "--rm",
            *self.engine.run_options(),
            "--network=none",
            "--user=0:0",
            "--entrypoint=sh",
            f"--volume={volume}:/volume",
            TAG,
            "-c",
            f"chgrp {group} /volume && chmod 2777 /volume",
        )
        return volume

    def mounts(self, c: dict, volumes: dict[str, str]) -> list[str]:
        options = []
        for mount in c.get("volumeMounts", []):
            source = self.pod.volume(mount["name"])
            read_only = ",ro" if mount.get("readOnly") else ""
            if "emptyDir" in source and mount["mountPath"] == "/tmp":
                options += ["--tmpfs", "/tmp:rw,nosuid,nodev,mode=1777"]
            elif "emptyDir" in source:
                options += ["-v", f"{volumes[mount['name']]}:{mount['mountPath']}{read_only.replace(',', ':')}"]
            elif "configMap" in source:
                options += ["-v", f"{self.model_dir}:{mount['mountPath']}:ro"]
            else:
                raise CheckFailed(f"volume {mount['name']}: {source} is not replayed here")
        return options

    def volumes_for(self, *containers: dict) -> dict[str, str]:
        names = {m["name"] for c in containers for m in c.get("volumeMounts", [])}
        made = {}
        for name in sorted(names):
            source = self.pod.volume(name)
            if "emptyDir" in source and not any(
                m["mountPath"] == "/tmp" for c in containers for m in c.get("volumeMounts", []) if m["name"] == name
            ):
                made[name] = self.empty_dir(name)
        self.model_dir.mkdir(parents=True, exist_ok=True)
        self.model_dir.chmod(0o755)
        for key, text in self.pod.model_files.items():
            (self.model_dir / key).write_text(text)
            (self.model_dir / key).chmod(0o644)
        return made

    def container_options(self, c: dict, volumes: dict[str, str], healthcheck: bool = False) -> list[str]:
        options = [*self.engine.run_options(healthcheck), *security_options(self.engine, self.pod, c)]
        options += self.mounts(c, volumes)
        for key, value in container_env(self.pod, c).items():
            options += ["--env", f"{key}={value}"]
        return options

    def seed(self, volumes: dict[str, str]) -> subprocess.CompletedProcess:
        """The initContainer, to its end."""
        init = self.pod.init
        name = f"indexer-image-test-init-{self.suffix}"
        self.containers.append(name)
        command = init["command"]
        out = self.engine(
            "run",
            f"--name={name}",
            *self.container_options(init, volumes),
            "--network=none",
            f"--entrypoint={command[0]}",
            TAG,
            *command[1:],
            *init.get("args", []),
            check_rc=False,
        )
        check(out.returncode == 0, f"the initContainer failed (exit {out.returncode}):\n{out.stdout}{out.stderr}")
        return out

    def start(self, volumes: dict[str, str]) -> Running:
        """The server container, detached, its container ports published on 127.0.0.1 only."""
        server = self.pod.server
        name = f"indexer-image-test-server-{self.suffix}"
        self.containers.append(name)
        publish = []
        for port in server["ports"]:
            publish += ["--publish", f"127.0.0.1::{port['containerPort']}"]
        options = self.container_options(server, volumes, healthcheck=True)
        self.engine("run", "--detach", "--name", name, *options, *publish, TAG, *server.get("args", []))
        info = self.engine.inspect("container", name)
        ports = {}
        for port in server["ports"]:
            bound = self.engine("port", name, f"{port['containerPort']}/tcp").stdout.split()[0]
            ports[port["name"]] = int(bound.rsplit(":", 1)[1])
        return Running(name, ports, epoch(info["State"]["StartedAt"]), int(info["State"]["Pid"]))

    def logs(self, name: str) -> str:
        out = self.engine("logs", name, check_rc=False)
        return out.stdout + out.stderr

    def volume_tree(self, volume: str) -> list[str]:
        out = self.engine(
            "run",
            "--rm",
            *self.engine.run_options(),
            "--network=none",
            "--entrypoint=sh",
            f"--volume={volume}:/volume:ro",
            TAG,
            "-c",
            "cd /volume && find . -type f | sort",
        )
        return out.stdout.split()


# --- checks against the running server ------------------------------------------------------------------------


def http(port: int, path: str, body: bytes | None = None, content_type: str = "") -> tuple[int, bytes]:
    headers = {"content-type": content_type} if content_type else {}
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait(predicate: Callable[[], object], timeout: float, what: str, alive: Callable[[], bool]) -> float:
    """Polls ``predicate`` every 10 ms (errors count as not yet) until true; returns the epoch time it came true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return time.time()
        except Exception:  # refused, reset, not serving yet: the server is still starting
            pass
        check(alive(), f"{what}: the container exited")
        time.sleep(0.01)
    raise CheckFailed(f"{what}: not within {timeout} s")


def samples(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    from prometheus_client.parser import text_string_to_metric_families

    status, body = http(port, "/metrics")
    check(status == 200, f"/metrics answered {status}")
    result: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            result.setdefault(sample.name, []).append((sample.labels, sample.value))
    return result


def log_time(log: str, marker: str) -> float | None:
    """The epoch time of the first log line holding ``marker`` (the server logs UTC, milliseconds)."""
    for line in log.splitlines():
        if marker in line:
            return epoch(line.split()[0])
    return None


def warmup_status(running: Running) -> pb.GetWarmupStatusResponse:
    """GetWarmupStatus of the running server, over gRPC."""
    from indexer_service.client import IndexerClient

    with IndexerClient(f"127.0.0.1:{running.ports['grpc']}", max_attempts=1) as client:
        return client.warmup_status()


def check_warmup(metrics: dict, status: pb.GetWarmupStatusResponse, log: str, steps: Steps) -> None:
    """Every key loaded from the prebuilt cache (none compiled, none failed), as the metric and GetWarmupStatus say
    (KEY_STATE_CACHED for each), and proved."""
    from indexer_service.protos.indexer.v1 import indexer_pb2 as pb

    states = {labels["state"]: value for labels, value in metrics["indexer_warmup_keys"]}
    planned = states.get("planned", 0)
    check(planned >= 1, f"no warmup keys planned: {states}")
    check(
        states.get("cached") == planned and states.get("compiled") == 0 and states.get("failed") == 0,
        f"every key must load from the prebuilt cache, none compile: indexer_warmup_keys {states}",
    )
    reported = {key.label: pb.KeyState.Name(key.state) for key in status.keys}
    check(
        len(reported) == planned and set(reported.values()) == {"KEY_STATE_CACHED"},
        f"GetWarmupStatus must report every key KEY_STATE_CACHED (loaded from the prebuilt cache): {reported}",
    )
    seconds = {labels["key"]: value for labels, value in metrics["indexer_warmup_key_compile_seconds"]}
    check(PROOF_SKIPPED not in log, "the warmup skipped a proof:\n" + grep(log, PROOF_SKIPPED))
    proved = [line for line in log.splitlines() if re.search(r"warmup \d+/\d+ key=\S+ .*\bproof=ok\b", line)]
    check(len(proved) == planned, f"{len(proved)} of {int(planned)} keys proved:\n" + grep(log, "warmup "))
    check(NO_FAST_PATH not in log, "an extension is missing:\n" + grep(log, NO_FAST_PATH))
    listed = ", ".join(f"{key} {value * 1000:.1f} ms" for key, value in sorted(seconds.items()))
    steps.note("warmup", f"{int(planned)} keys loaded from the cache (metric and RPC) and proved: {listed}")


def golden_cases() -> list[dict]:
    return json.loads((REPO / "tests" / "data" / "golden-cases.json").read_text())["chunk_metadata"]


def check_golden(running: Running, steps: Steps) -> None:
    """BuildChunk of every golden case over gRPC and over HTTP JSON, equal to its expected answer."""
    from google.protobuf import json_format

    from indexer_service.client import IndexerClient
    from indexer_service.protos.indexer.v1 import indexer_pb2 as pb
    from indexer_service.service import codec
    from tests.golden import chunk_inputs, metadata_as_dict

    cases = golden_cases()
    with IndexerClient(f"127.0.0.1:{running.ports['grpc']}", max_attempts=1) as client:
        for case in cases:
            got = client.build_chunk(chunk_inputs(case))
            answer = None if got is None else metadata_as_dict(got)
            check(answer == case["expected"], f"gRPC BuildChunk {case['name']}: {answer} != {case['expected']}")
    for case in cases:
        request = json_format.MessageToJson(codec.chunk_inputs_to_proto(chunk_inputs(case))).encode()
        status, body = http(
            running.ports["http-rpc"], "/indexer.v1.PrefillMetadata/BuildChunk", request, "application/json"
        )
        check(status == 200, f"HTTP JSON BuildChunk {case['name']}: {status} {body[:300]!r}")
        response = json_format.Parse(body, pb.BuildChunkResponse())
        metadata = codec.metadata_from_proto(response.metadata) if response.HasField("metadata") else None
        answer = None if metadata is None else metadata_as_dict(metadata)
        check(answer == case["expected"], f"HTTP JSON BuildChunk {case['name']}: {answer} != {case['expected']}")
    steps.note("golden", f"{len(cases)} golden cases equal over gRPC and over HTTP JSON")


def exercise_every_ratio(running: Running) -> None:
    """Calls at every compress ratio of the warmup set (BuildChunk and PlanBatch): none may compile anything."""
    import numpy as np

    from indexer_service.client import IndexerClient
    from indexer_service.kernels.inputs import ChunkInputs
    from indexer_service.kernels.planner import BatchInputs

    qsl, seq_lens = np.array([0, 4, 10, 300]), np.array([8, 20, 1000])
    with IndexerClient(f"127.0.0.1:{running.ports['grpc']}", max_attempts=1) as client:
        for ratio in (0, 1, 4, 128):
            client.build_chunk(ChunkInputs(qsl, seq_lens, ratio, 0, 3))
            client.plan_batch(BatchInputs(qsl, seq_lens, ratio, 1, 1 << 20))


def check_healthcheck(engine: Engine, running: Running, healthcheck: dict, steps: Steps) -> None:
    """The image's own HEALTHCHECK command, run in the container as the engine would: exit 0 while ready."""
    test = healthcheck["Test"]
    check(test[0] == "CMD", f"HEALTHCHECK {test[0]}: exec form (CMD) expected")
    start = time.monotonic()
    out = engine("exec", running.name, *test[1:], check_rc=False)
    check(out.returncode == 0, f"the image's HEALTHCHECK exited {out.returncode}:\n{out.stdout}{out.stderr}")
    if engine.podman:
        verdict = engine("healthcheck", "run", running.name, check_rc=False)
        check(verdict.returncode == 0, f"podman healthcheck run: {verdict.stdout}{verdict.stderr}")
    steps.note("healthcheck", f"exit 0 in {time.monotonic() - start:.2f} s")


def check_cli(engine: Engine, running: Running, steps: Steps) -> None:
    """`indexer-service check` inside the container, on its own gRPC port."""
    port = next(p["containerPort"] for p in Pod.from_base().server["ports"] if p["name"] == "grpc")
    out = engine("exec", running.name, "indexer-service", "check", f"127.0.0.1:{port}", check_rc=False)
    check(out.returncode == 0, f"indexer-service check exited {out.returncode}:\n{out.stdout}{out.stderr}")
    check(f"(commit {REVISION}, image {REVISION})" in out.stdout, f"check does not name the build:\n{out.stdout}")
    said = out.stdout.strip().splitlines()
    steps.note("check", f"exit 0: {' / '.join(said[:2])}" if said else "exit 0")


def check_prebuilt_cache_script(engine: Engine, running: Running, steps: Steps) -> None:
    """scripts/check-prebuilt-cache.sh in the running container, where the server holds every default port: it must
    choose its own (every port 0) and pass."""
    script = (REPO / "scripts" / "check-prebuilt-cache.sh").read_text()
    out = subprocess.run(
        engine.argv("exec", "-i", running.name, "bash", "-s", "--", "cuda:90"),
        input=script,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    (WORK / "check-prebuilt-cache.log").write_text(out.stdout + out.stderr)
    check(
        out.returncode == 0,
        f"check-prebuilt-cache.sh exited {out.returncode}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}",
    )
    new = re.search(r"cache files: (\d+) after the build, (\d+) after serving \((\d+) new\)", out.stdout)
    check(new and new.group(3) == "0", f"serving on the prebuilt cache compiled something:\n{out.stdout[-2000:]}")
    steps.note("check-prebuilt-cache", f"passed: {new.group(0)}")


class HealthWatch(threading.Thread):
    """A grpc.health.v1 Watch stream on the health port, recording each status with the time it arrived.
    ``wait_for_ready``: opened before the port listens (the container just started), it connects once it does."""

    def __init__(self, port: int, *, wait_for_ready: bool = False, timeout: float = 60) -> None:
        super().__init__(daemon=True)
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        # Reconnecting every 20 ms, not after gRPC's second-long backoff: the port opens a moment after the start.
        backoff = [(f"grpc.{kind}_reconnect_backoff_ms", 20) for kind in ("initial", "min", "max")]
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=backoff if wait_for_ready else None)
        request = health_pb2.HealthCheckRequest(service="indexer.v1.PrefillMetadata")
        self.stream = health_pb2_grpc.HealthStub(self.channel).Watch(
            request, timeout=timeout, wait_for_ready=wait_for_ready
        )
        self.names = health_pb2.HealthCheckResponse.ServingStatus.Name
        self.seen: list[tuple[float, str]] = []
        self.start()

    def run(self) -> None:
        with contextlib.suppress(Exception):  # the stream ends with the server
            for response in self.stream:
                self.seen.append((time.time(), self.names(response.status)))

    def close(self) -> None:
        self.stream.cancel()
        self.channel.close()


def check_sigterm(engine: Engine, running: Running, steps: Steps) -> None:
    """SIGTERM to the server (PID 1 of its container): NOT_SERVING on a health Watch within 1 s, then exit 0."""
    watch = HealthWatch(running.ports["grpc-health"])
    try:
        deadline = time.monotonic() + 10
        while not watch.seen and time.monotonic() < deadline:
            time.sleep(0.01)
        check(watch.seen and watch.seen[-1][1] == "SERVING", f"the health Watch said {watch.seen} before SIGTERM")
        sent = time.time()
        try:
            os.kill(running.pid, signal.SIGTERM)
        except PermissionError:  # a rootless engine's process: ask the engine
            engine("kill", "--signal", "TERM", running.name)
        exit_code = int(engine("wait", running.name, timeout=60).stdout.split()[0])
        exited = epoch(engine.inspect("container", running.name)["State"]["FinishedAt"])
        watch.join(5)
        not_serving = [at for at, status in watch.seen if status == "NOT_SERVING"]
    finally:
        watch.close()
    check(not_serving, f"the health Watch never said NOT_SERVING after SIGTERM: {watch.seen}")
    reaction = not_serving[0] - sent
    check(reaction <= NOT_SERVING_SECONDS, f"NOT_SERVING {reaction:.2f} s after SIGTERM, over {NOT_SERVING_SECONDS} s")
    check(exit_code == 0, f"the server exited {exit_code} after SIGTERM")
    steps.note("sigterm", f"NOT_SERVING after {reaction:.3f} s, exit 0 after {exited - sent:.2f} s")


def process_cpu_seconds(pid: int) -> float | None:
    """The CPU seconds (user and system, every thread) process ``pid`` has used, from /proc; None where it cannot
    be read (a rootless engine's process in another namespace)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # utime and stime, the 14th and 15th fields of stat(5), after the command's parenthesised name.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_ready(running: Running, alive: Callable[[], bool], timeout: float = 180) -> float:
    """The epoch time the server was ready on both: /readyz 200 (polled every 10 ms) and SERVING on a health Watch
    of the health port (opened at once, so the time is the one the status arrived, not a poll's)."""
    watch = HealthWatch(running.ports["grpc-health"], wait_for_ready=True, timeout=timeout)
    try:
        readyz_at = wait(lambda: http(running.ports["http-metrics"], "/readyz")[0] == 200, timeout, "ready", alive)
        wait(lambda: any(status == "SERVING" for _, status in watch.seen), 30, "health port SERVING", alive)
        serving_at = next(at for at, status in watch.seen if status == "SERVING")
    finally:
        watch.close()
    return max(readyz_at, serving_at)


def serve_and_check(engine: Engine, healthcheck: dict, steps: Steps) -> None:
    pod = Pod.from_base()
    run_ = PodRun(engine, pod)
    try:
        with steps.step("seed"):
            volumes = run_.volumes_for(pod.init, pod.server)
            run_.seed(volumes)
            (cache_volume,) = (v for k, v in volumes.items() if k == "triton-cache")
            seeded = run_.volume_tree(cache_volume)
            check(seeded, "the initContainer seeded nothing")
            steps.note("seed", f"{len(seeded)} cache files seeded")
        with steps.step("ready"):
            running = run_.start(volumes)

            def alive() -> bool:
                return engine.inspect("container", running.name)["State"]["Running"]

            ready_at = wait_ready(running, alive)
            cpu = process_cpu_seconds(running.pid)
            log = run_.logs(running.name)
            logged = log_time(log, " ready ")
            ready = ready_at - running.started_at
            said = f"ready {ready:.2f} s after container start (health port and /readyz seen from the host"
            if logged:
                said += f"; the log's `ready` line at {logged - running.started_at:.2f} s"
            if cpu is not None:  # what the start cost, whatever else the machine runs: its time on one core
                said += f"; {cpu:.2f} CPU-seconds by then"
            steps.note("ready", f"{said}; load average {os.getloadavg()[0]:.1f})")
            steps.ready = ready
            check(ready <= READY_LIMIT, f"ready {ready:.2f} s after container start, over {READY_LIMIT} s")
            if ready > READY_SECONDS:
                steps.note(
                    "ready", f"over the {READY_SECONDS} s target (IMAGE_READY_SECONDS); failed past {READY_LIMIT} s"
                )
        with steps.step("warmup"):
            check_warmup(samples(running.ports["http-metrics"]), warmup_status(running), log, steps)
        with steps.step("golden"):
            check_golden(running, steps)
        with steps.step("healthcheck"):
            check_healthcheck(engine, running, healthcheck, steps)
        with steps.step("check"):
            check_cli(engine, running, steps)
        with steps.step("no compiles after ready"):
            exercise_every_ratio(running)
            metrics = samples(running.ports["http-metrics"])
            after = sum(value for _, value in metrics.get("indexer_compiles_after_ready_total", []))
            check(after == 0, f"{after} compiles after ready")
            check(run_.volume_tree(cache_volume) == seeded, "serving wrote to the seeded cache: something compiled")
        with steps.step("check-prebuilt-cache.sh"):
            check_prebuilt_cache_script(engine, running, steps)
        with steps.step("sigterm"):
            check_sigterm(engine, running, steps)
        log = run_.logs(running.name)
        (WORK / "server.log").write_text(log)
        check("Traceback" not in log, f"a traceback in the server's log:\n{log[-3000:]}")
    finally:
        run_.close()


def main() -> int:
    # gRPC core's own INFO lines (a GOAWAY as the server drains) would interleave with the steps' report; set
    # before this process first imports grpc.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    steps = Steps()
    WORK.mkdir(parents=True, exist_ok=True)
    try:
        with steps.step("engine"):
            engine = find_engine(steps)
        with steps.step("base"):
            base = choose_base(engine, steps)
            engine = settle_podman(engine, base, steps)
        with steps.step("wheels"):
            fill_wheelhouse(steps)
        with steps.step("gpu lock"):
            check_gpu_lock(steps)
        with steps.step("build"):
            check_build_log(build(engine, base, steps))
        with steps.step("image"):
            healthcheck = check_image(engine, steps)
        with steps.step("revision"):
            check_revision_rebuild(engine, base, steps)
        serve_and_check(engine, healthcheck, steps)
    except CheckFailed as exc:
        print(f"\nimage-test FAILED: {exc}", file=sys.stderr)
        print(steps.summary())
        return 1
    print("\nimage-test passed\n" + steps.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
