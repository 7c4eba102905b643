"""The image's build and run, checked without building it: the Dockerfile's stage graph as buildah and BuildKit
read it (either variant, a plain build included), its bases fully qualified, the builder's extension check, the
build context's wheelhouse, and `make image-test`'s replay of deploy/base (tests/deploy/image.py) against the
rendered overlay. `make image-test` builds and runs the image itself."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.deploy import image
from tests.deploy.support import (
    INSTALL_HINT,
    ROOT,
    container,
    docker_context_files,
    dockerfile_arg_defaults,
    dockerfile_instructions,
    kustomize_command,
    one,
    render,
    stage_named,
    substitute,
)
from tests.tools import needs_tool

requires_kustomize = needs_tool(None if kustomize_command() else f"no kustomize/kubectl: {INSTALL_HINT}")
VARIANTS = ("cpu", "gpu")


# --- the stage graph ------------------------------------------------------------------------------------------


def stage_graph(build_args: dict[str, str], *, apply_defaults: bool) -> dict[str, object]:
    """The stages a build of the Dockerfile needs and what each starts from: ``{"images": [...], "stages": {name:
    its FROM}, "final": its FROM, "copies": [stage names COPY --from reads]}``. ``apply_defaults=False`` reads the
    FROM lines as buildah does when it picks the stages a build needs: with the build arguments given and no ARG
    defaults (only a ``${VAR:-default}`` of the line's own)."""
    instructions = dockerfile_instructions()
    variables = {**(dockerfile_arg_defaults(instructions) if apply_defaults else {}), **build_args}
    stages: dict[str, str] = {}
    images, copies, final = [], [], ""
    for ins in instructions:
        if ins.keyword == "FROM":
            source, *alias = substitute(ins.args, variables).split()
            if source not in stages:
                images.append(source)
            if alias:
                stages[alias[-1]] = source
            else:
                final = source
        elif ins.keyword == "COPY" and "--from=" in ins.args:
            copies.append(re.search(r"--from=(\S+)", ins.args).group(1))
    return {"images": images, "stages": stages, "final": final, "copies": copies}


@pytest.mark.parametrize("variant", [*VARIANTS, None], ids=[*VARIANTS, "plain build"])
@pytest.mark.parametrize("engine", ["BuildKit", "buildah"])
def test_the_stage_graph_reaches_the_variant_base(variant: str | None, engine: str) -> None:
    """The dependencies' stage and the final stage start from the variant's base stage, the project's stage from
    the dependencies', and the final stage copies from those two only, whether or not VARIANT is passed. A plain
    `podman build .` once failed with `short-name "base-gpu"`: buildah picked the stages before applying VARIANT's
    default, skipped base-gpu, and then looked for an image."""
    default = dockerfile_arg_defaults(dockerfile_instructions())["VARIANT"]
    graph = stage_graph({} if variant is None else {"VARIANT": variant}, apply_defaults=engine == "BuildKit")
    expected = f"base-{variant or default}"
    assert graph["stages"]["deps"] == expected and graph["final"] == expected, graph
    assert graph["stages"]["builder"] == "deps", graph
    assert set(graph["copies"]) == {"deps", "builder"}, graph
    assert set(graph["stages"]) == {"base-cpu", "base-gpu", "deps", "builder"}, graph


def test_every_base_is_fully_qualified() -> None:
    """A short name (python:3.11-slim) is refused by podman with a registries.conf that defines no search
    registries, and means different images on machines whose search lists differ: every base names its
    registry."""
    defaults = dockerfile_arg_defaults(dockerfile_instructions())
    for variant in VARIANTS:
        for source in stage_graph({"VARIANT": variant}, apply_defaults=True)["images"]:
            registry = source.split("/", 1)[0]
            assert "/" in source and ("." in registry or ":" in registry or registry == "localhost"), source
    assert defaults["CPU_BASE"].startswith("docker.io/library/python:3.11-slim-bookworm@sha256:")
    assert defaults["GPU_BASE"].startswith("docker.io/pytorch/pytorch:")


def test_the_final_stage_carries_no_compiler_for_cpu_and_sets_home_after_root() -> None:
    """The compiler is the build stages' (and, on a GPU, the final stage's: Triton builds its launcher stub at the
    first start); HOME is set only once the steps run as the serving user, so no root pip step sees a HOME it does
    not own (pip's cache-ownership warning)."""
    instructions = dockerfile_instructions()
    builder = [*stage_named(instructions, "deps"), *stage_named(instructions, "builder")]
    final = [i for i in instructions if i.stage == max(j.stage for j in instructions)]
    assert any("gcc" in i.args for i in builder if i.keyword == "RUN")
    (compiler,) = [i.args for i in final if i.keyword == "RUN" and "gcc" in i.args]
    assert re.search(r'if \[ "\$\{VARIANT\}" = gpu \]; then.*apt-get install[^;]*gcc', compiler), compiler
    user_at = next(n for n, i in enumerate(final) if i.keyword == "USER")
    home_at = next(n for n, i in enumerate(final) if i.keyword == "ENV" and "HOME=" in i.args)
    assert home_at > user_at
    assert not [i for i in builder if i.keyword == "ENV" and "HOME=" in i.args]


def extension_check() -> str:
    """The builder's last RUN's extension import, as the build runs it."""
    builder = stage_named(dockerfile_instructions(), "builder")
    (step,) = [i.args for i in builder if i.keyword == "RUN" and "--target /opt/indexer/app" in i.args]
    (command,) = re.findall(r'python -c "([^"]+)"', step)
    return command


def test_the_builder_fails_when_an_extension_was_not_built(tmp_path: Path) -> None:
    """setup.py marks both extensions optional (a machine without a compiler still installs), so an image built
    on a base without Python.h served without the compiled fast path, one warning in the log. The builder's check
    names every extension setup.py builds, passes where they are built, and fails where one is missing."""
    command = extension_check()
    modules = re.findall(r'Extension\(\s*"([\w.]+)"', (ROOT / "setup.py").read_text())
    assert modules and all(module in command for module in modules), (modules, command)
    built = subprocess.run([sys.executable, "-c", command], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    # The same package without its compiled modules, first on the path.
    package = tmp_path / "indexer_service"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for part in ("kernels", "service", "protos"):
        shutil.copytree(ROOT / part, package / part, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    missing = subprocess.run([sys.executable, "-c", command], capture_output=True, text=True, timeout=60, env=env)
    assert missing.returncode != 0 and "_fastpath" in missing.stderr, missing.stderr


def test_the_build_refuses_a_lock_resolved_for_another_python(tmp_path: Path) -> None:
    """Each lock names the Python it was resolved for (scripts/lock-image-deps.py's LOCK_PYTHON); the dependencies'
    step checks its base's Python against it before pip runs, so a base whose Python moved fails with that, not with
    a missing wheel. The check, run here: passes on this Python's lock, fails naming both on another's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lock_image_deps", ROOT / "scripts" / "lock-image-deps.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for variant, path in (
        ("cpu", ROOT / "requirements" / "image-cpu.txt"),
        ("gpu", ROOT / "requirements" / "image-gpu.txt"),
    ):
        assert image.lock_python(path.read_text()) == script.LOCK_PYTHON[variant]
        assert path.read_text().startswith(script.header(variant)), f"{path.name}: header not the generator's"
    deps = stage_named(dockerfile_instructions(), "deps")
    (step,) = [i.args for i in deps if i.keyword == "RUN" and "--require-hashes" in i.args]
    (command,) = [c for c in re.findall(r'python -c "([^"]+)" "\$\{lock\}"', step)]
    assert step.index(command) < step.index("pip install"), "checked before pip runs"
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    for python, fails in ((here, False), ("3.99", True)):
        lock = tmp_path / f"lock-{python}.txt"
        lock.write_text(f"# GENERATED\n# python: {python}\nnumpy==2.3.5 \\\n    --hash=sha256:{'0' * 64}\n")
        out = subprocess.run([sys.executable, "-c", command, str(lock)], capture_output=True, text=True, timeout=60)
        assert (out.returncode != 0) == fails, out.stderr
        if fails:
            assert f"locked for Python 3.99, this base has {here}" in out.stderr


def test_the_builder_checks_for_python_headers() -> None:
    """A base without Python.h fails the build at once, naming what is missing, before any install."""
    builder = stage_named(dockerfile_instructions(), "deps")
    (step,) = [i.args for i in builder if i.keyword == "RUN" and "Python.h" in i.args]
    assert "sys.exit(" in step and "python3-dev" in step


def test_the_wheelhouse_reaches_the_build_context_and_nothing_else_does(tmp_path: Path) -> None:
    """.dockerignore lets .cache/wheelhouse/ through (the builder mounts it for its install step, PIP_WHEELHOUSE)
    and nothing else of .cache/."""
    (tmp_path / ".dockerignore").write_text((ROOT / ".dockerignore").read_text())
    for rel in (".cache/wheelhouse/cpu/numpy-2.3.5-cp311-cp311-x.whl", ".cache/image-test/build.log", "pyproject.toml"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert docker_context_files(tmp_path) == [".cache/wheelhouse/cpu/numpy-2.3.5-cp311-cp311-x.whl", "pyproject.toml"]
    assert image.WHEELHOUSE.startswith(".cache/wheelhouse/")
    builder = stage_named(dockerfile_instructions(), "deps")
    (step,) = [i.args for i in builder if i.keyword == "RUN" and "--require-hashes" in i.args]
    assert "--mount=type=bind,target=/context" in step and '--find-links "/context/${PIP_WHEELHOUSE}"' in step
    assert "--no-index" in step, "with a wheelhouse, pip looks nowhere else (a dead find-links host costs retries)"
    args = {i.args.split("=", 1)[0] for i in builder if i.keyword == "ARG"}
    assert {"PIP_WHEELHOUSE", "PIP_RETRIES", "PIP_TIMEOUT"} <= args


def test_a_dead_find_links_host_costs_the_build_seconds_not_minutes(tmp_path: Path) -> None:
    """Without a wheelhouse, the build's pip reads the lock's --find-links line; where that host does not resolve,
    pip's own default (5 retries with backoff) cost about 10 s for every requirement, 9 minutes for the lock. The
    build arguments PIP_RETRIES and PIP_TIMEOUT reach pip as its own variables: with their defaults, a requirement
    gives up on such a host after PIP_RETRIES tries (counted from pip's own "Retrying" lines, not timed: the
    machine may be loaded)."""
    defaults = dockerfile_arg_defaults(stage_named(dockerfile_instructions(), "deps"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env |= {
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_RETRIES": defaults["PIP_RETRIES"],
        "PIP_TIMEOUT": defaults["PIP_TIMEOUT"],
    }
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-index", "--dest", str(tmp_path)]
    out = subprocess.run(
        [*argv, "--find-links", "https://wheels.invalid/torch/", "six"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "wheels.invalid" in out.stdout + out.stderr
    retries = (out.stdout + out.stderr).count("Retrying (Retry(")
    assert retries == int(defaults["PIP_RETRIES"]), (
        f"pip retried {retries} times, PIP_RETRIES is {defaults['PIP_RETRIES']}"
    )
    assert int(defaults["PIP_RETRIES"]) <= 3 and int(defaults["PIP_TIMEOUT"]) <= 60


# --- make image-test's replay of the pod ----------------------------------------------------------------------


def test_the_wheel_download_uses_this_machines_pip_for_the_lock_python() -> None:
    """The wheelhouse is filled by the machine's own pip (its configuration and CA bundle apply there, not in the
    build), for the Python the CPU lock was resolved for, every file by hash."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lock_image_deps", ROOT / "scripts" / "lock-image-deps.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    argv = image.wheel_download_command(Path("lock.txt"), Path("out"))
    assert argv[:4] == [sys.executable, "-m", "pip", "download"]
    assert {"--no-deps", "--require-hashes", "--only-binary=:all:"} <= set(argv)
    assert f"--python-version={script.LOCK_PYTHON['cpu']}" in argv
    assert not [a for a in argv if a.startswith(("--index-url", "--extra-index-url", "--find-links", "--cert"))]


def test_the_build_gets_the_machines_ca_bundle_as_a_secret_and_nothing_else(tmp_path: Path, monkeypatch) -> None:
    """The build reads the wheelhouse (a build argument naming a folder of the context) and, where this machine's
    pip has a CA bundle, that bundle as the `pip-cert` secret (stored in no layer); no index, find-links or pip.conf
    of this machine reaches the build's arguments."""
    cert = tmp_path / "ca.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.setenv("PIP_CERT", str(cert))
    argv = image.build_command(image.Engine("podman", ("--runtime", "runc"), ("--ulimit=nproc=4096:4096",)), "base")
    assert f"--secret=id=pip-cert,src={cert}" in argv
    assert f"--build-arg=PIP_WHEELHOUSE={image.WHEELHOUSE}" in argv and "--format=docker" in argv
    assert argv[:3] == ["podman", "--runtime", "runc"] and "--ulimit=nproc=4096:4096" in argv
    assert not [a for a in argv if re.search(r"index-url|find-links|pip\.conf|PIP_CONFIG", a)]
    monkeypatch.setenv("PIP_CERT", str(tmp_path / "missing.pem"))
    assert not [a for a in image.build_command(image.Engine("docker"), "base") if a.startswith("--secret")]


def fake_docker(folder: Path, version: str, *, buildx: bool = False, daemon: bool = True) -> str:
    """A `docker` CLI that answers `info` (a daemon answers, or not), `buildx version` (the plugin is there, or not)
    and `version` (its client version), as image.py asks them."""
    folder.mkdir(parents=True, exist_ok=True)
    cli = folder / "docker"
    cli.write_text(
        "#!/bin/sh\n"
        f'case "$1" in info) exit {0 if daemon else 1};; buildx) exit {0 if buildx else 1};; version) echo {version};; '
        "esac\n"
    )
    cli.chmod(0o755)
    return str(cli)


def test_docker_builds_with_the_first_cli_on_path_that_has_buildkit(tmp_path: Path, monkeypatch) -> None:
    """The docker path: a newer CLI without the buildx plugin cannot build the Dockerfile (its legacy builder
    refuses RUN --mount), so the next docker CLI on PATH that can is taken (one before 23.0 carries BuildKit,
    behind DOCKER_BUILDKIT=1), and the build command is that CLI's; with the plugin, `buildx build --load`; with
    none that can, the test fails saying what to install; with no daemon, podman's turn."""
    newer = fake_docker(tmp_path / "local", "28.2.2")
    older = fake_docker(tmp_path / "usr", "20.10.24")
    monkeypatch.setenv("PATH", f"{tmp_path / 'local'}{os.pathsep}{tmp_path / 'usr'}")
    assert image.executables("docker") == [newer, older]
    steps = image.Steps()
    engine = image.find_docker(steps)
    assert (engine.cli, engine.builder, engine.build_env) == (older, ("build",), {"DOCKER_BUILDKIT": "1"})
    assert "passed over" in steps.notes["engine"] and newer in steps.notes["engine"]
    argv = image.build_command(engine, "base")
    assert argv[:2] == [older, "build"] and "--progress=plain" in argv and argv[-1] == str(image.REPO)
    assert not [a for a in argv if a in ("--format=docker", "--layers") or a.startswith("--ulimit")]
    assert engine.argv("run", "x")[:2] == [older, "run"]

    with_plugin = fake_docker(tmp_path / "plugin", "28.2.2", buildx=True)
    monkeypatch.setenv("PATH", str(tmp_path / "plugin"))
    engine = image.find_docker(image.Steps())
    assert (engine.cli, engine.builder, engine.build_env) == (with_plugin, ("buildx", "build", "--load"), {})
    assert image.build_command(engine, "base")[:4] == [with_plugin, "buildx", "build", "--load"]

    monkeypatch.setenv("PATH", str(tmp_path / "local"))
    with pytest.raises(image.CheckFailed, match="buildx"):
        image.find_docker(image.Steps())
    fake_docker(tmp_path / "down", "20.10.24", daemon=False)
    monkeypatch.setenv("PATH", str(tmp_path / "down"))
    assert image.find_docker(image.Steps()) is None


def test_buildkit_progress_gives_each_steps_seconds() -> None:
    text = (
        "#1 [internal] load build definition from Dockerfile\n#1 DONE 0.0s\n"
        "#7 [deps 2/6] RUN apt-get update\n#7 0.912 Get:1 http://deb.debian.org\n#7 DONE 35.2s\n"
        "#9 [deps 3/6] RUN python -m venv /opt/indexer/venv\n#9 CACHED\n"
        "#12 [stage-2 5/7] RUN indexer-service precompile\n#12 DONE 4s\n"
    )
    assert image.buildkit_step_seconds(text) == [
        (0.0, "[internal] load build definition from Dockerfile"),
        (35.2, "[deps 2/6] RUN apt-get update"),
        (4.0, "[stage-2 5/7] RUN indexer-service precompile"),
    ]


def test_the_start_is_timed_in_cpu_seconds_too() -> None:
    """Beside the wall seconds to ready, which a shared machine's load stretches, the server's own CPU seconds."""
    spent = image.process_cpu_seconds(os.getpid())
    assert spent is not None and spent > 0
    assert image.process_cpu_seconds(2**22 + 1) is None


def test_podman_limits_fall_back_to_what_the_machine_allows() -> None:
    """Podman's own defaults first; then the machine's hard limits (open files capped at podman's 1048576), then
    process limits podman's monitor can grant."""
    candidates = image.ulimit_candidates({"nofile": 20000, "nproc": 96367})
    assert candidates[0] == ()
    assert candidates[1] == ("--ulimit=nofile=20000:20000", "--ulimit=nproc=96367:96367")
    assert [c[1] for c in candidates[2:]] == ["--ulimit=nproc=32768:32768", "--ulimit=nproc=4096:4096"]
    assert image.ulimit_candidates({"nofile": 1 << 30, "nproc": 1000})[1] == (
        "--ulimit=nofile=1048576:1048576",
        "--ulimit=nproc=1000:1000",
    )


def test_memory_quantities_become_engine_options() -> None:
    assert [image.memory_option(q) for q in ("4Gi", "256Mi", "64Ki", "1024")] == ["4g", "256m", "64k", "1024b"]


def test_times_from_the_engine_and_the_log_are_epoch_seconds() -> None:
    a = image.epoch("2026-12-07T03:05:11.123456789Z")
    b = image.epoch("2026-12-07T05:05:11.623456789+02:00")
    assert abs(b - a - 0.5) < 1e-6
    logged = image.log_time("x\n2026-12-07T03:05:11.223Z INFO server ready backend=numpy", " ready ")
    assert logged == pytest.approx(image.epoch("2026-12-07T03:05:11.223Z"), abs=1e-6) and logged - a < 0.1


def test_the_warmup_check_wants_every_key_cached_by_the_metric_and_the_rpc() -> None:
    """make image-test's warmup check: every key loaded from the seeded cache, as indexer_warmup_keys counts and as
    GetWarmupStatus reports (KEY_STATE_CACHED, a state of its own), and proved; a key the RPC reports COMPILED, or
    a metric that counts one compiled, fails it."""
    from indexer_service.protos.indexer.v1 import indexer_pb2 as pb

    labels = ("r1-b1024-aligned-i32", "r4-b1024-aligned-i32", "r128-b1024-aligned-i32")
    log = "".join(
        f"warmup {n}/3 key={label} seconds=0.002 source=cache proof=ok\n" for n, label in enumerate(labels, 1)
    )

    def metrics(compiled: int) -> dict:
        states = {"planned": 3, "compiled": compiled, "cached": 3 - compiled, "failed": 0}
        return {
            "indexer_warmup_keys": [({"state": state}, value) for state, value in states.items()],
            "indexer_warmup_key_compile_seconds": [({"key": label}, 0.002) for label in labels],
        }

    def status(*states: int) -> pb.GetWarmupStatusResponse:
        return pb.GetWarmupStatusResponse(
            keys=[pb.KeyStatus(label=lb, state=st) for lb, st in zip(labels, states, strict=True)]
        )

    cached = pb.KEY_STATE_CACHED
    image.check_warmup(metrics(0), status(cached, cached, cached), log, image.Steps())
    with pytest.raises(image.CheckFailed, match="KEY_STATE_CACHED"):
        image.check_warmup(metrics(0), status(cached, pb.KEY_STATE_COMPILED, cached), log, image.Steps())
    with pytest.raises(image.CheckFailed, match="none compile"):
        image.check_warmup(metrics(1), status(cached, cached, cached), log, image.Steps())
    with pytest.raises(image.CheckFailed, match="proved"):
        image.check_warmup(metrics(0), status(cached, cached, cached), log.replace("proof=ok", "proof=none", 1),
                           image.Steps())  # fmt: skip


@requires_kustomize
def test_the_replayed_pod_is_the_deployed_one() -> None:
    """What `make image-test` reads from deploy/base (the Deployment and its ConfigMap's files) is what the CPU
    overlay deploys, but for what an overlay may change (image, resources' requests, the ConfigMap's name)."""
    pod = image.Pod.from_base()
    rendered = one(render("deploy/overlays/cpu"), "Deployment")
    spec = rendered["spec"]["template"]["spec"]
    assert spec["securityContext"] == pod.spec["securityContext"]
    (init,) = spec["initContainers"]
    assert (init["command"], init.get("env"), init["securityContext"]) == (
        pod.init["command"],
        pod.init.get("env"),
        pod.init["securityContext"],
    )
    server = container(rendered)
    for key in ("args", "env", "volumeMounts", "securityContext", "ports"):
        assert server[key] == pod.server[key], key
    assert server["resources"]["limits"] == pod.server["resources"]["limits"]
    configmap = one(render("deploy/overlays/cpu"), "ConfigMap", "indexer-model-config")
    assert configmap["data"] == pod.model_files


def test_the_replayed_pod_runs_hardened() -> None:
    """The engine options of the server container: uid/gid 10001, read-only root (podman's own writable /tmp,
    /run and /var/tmp off), every capability dropped, no new privileges, its memory limit, /tmp a tmpfs, the model
    config read-only, the pod's environment."""
    pod = image.Pod.from_base()
    engine = image.Engine("podman", ("--runtime", "runc"), ("--ulimit=nofile=20000:20000",))
    run = image.PodRun(engine, pod)
    options = run.container_options(pod.server, {"triton-cache": "cache-volume"}, healthcheck=True)
    joined = " ".join(options)
    for expected in (
        "--user 10001:10001",
        "--read-only --read-only-tmpfs=false",
        "--security-opt no-new-privileges",
        "--cap-drop ALL",
        "--memory 4g",
        "--tmpfs /tmp:rw,nosuid,nodev,mode=1777",
        "-v cache-volume:/var/cache/indexer/triton",
        f"-v {run.model_dir}:/etc/indexer/model:ro",
        "--env TRITON_CACHE_DIR=/var/cache/indexer/triton",
        "--env INDEXER_WORKERS=1",
        "--pull=never",
        "--ulimit=nofile=20000:20000",
    ):
        assert expected in joined, expected
    assert "--no-healthcheck" not in options
    init_options = run.container_options(pod.init, {"triton-cache": "cache-volume"})
    assert "--no-healthcheck" in init_options and "--memory" in init_options
    docker = image.PodRun(image.Engine("docker"), pod).container_options(pod.server, {"triton-cache": "v"})
    assert "--read-only" in docker and "--read-only-tmpfs=false" not in docker


def test_the_seed_command_works_on_a_volume_the_serving_user_does_not_own(tmp_path: Path) -> None:
    """The kubelet makes an emptyDir owned by root, group fsGroup, mode 2777. The initContainer runs as the serving
    user: it may write into the volume but not chmod its root (`chmod -R u+w "$SEED_TO"` failed there, and the pod
    never started). Replayed here as uid/gid 10001 on such a directory."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to make a root-owned volume and run as uid 10001")
    pod = image.Pod.from_base()
    group = pod.spec["securityContext"]["fsGroup"]
    user = pod.spec["securityContext"]["runAsUser"]
    top = Path(tempfile.mkdtemp(prefix="seed-"))
    try:
        top.chmod(0o755)
        cache, volume = top / "image-cache", top / "volume"
        (cache / "ab12").mkdir(parents=True)
        (cache / "ab12" / "kernel.cubin").write_bytes(b"cubin")
        (cache / "ab12" / "kernel.json").write_text("{}")
        for path in (cache, cache / "ab12"):
            path.chmod(0o555)
        for path in (cache / "ab12" / "kernel.cubin", cache / "ab12" / "kernel.json"):
            path.chmod(0o444)  # read-only in the image: the copy must still become writable
        volume.mkdir()
        os.chown(volume, 0, group)
        volume.chmod(0o2777)
        env = {"PATH": os.environ["PATH"], "TRITON_CACHE_DIR": str(cache), "SEED_TO": str(volume)}
        as_user = ["setpriv", f"--reuid={user}", f"--regid={group}", "--clear-groups"]
        out = subprocess.run([*as_user, *pod.init["command"]], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        copied = volume / "ab12" / "kernel.cubin"
        assert copied.read_bytes() == b"cubin" and copied.stat().st_uid == user
        assert copied.stat().st_mode & 0o200 and (volume / "ab12").stat().st_mode & 0o200
    finally:
        for path in [top, *top.rglob("*")]:
            if path.is_dir():
                path.chmod(0o755)
        shutil.rmtree(top)


def test_check_prebuilt_cache_chooses_every_port_itself() -> None:
    """scripts/check-prebuilt-cache.sh starts servers beside whatever already listens (in `make image-test`, inside
    the serving container): every port setting of `serve` must be 0 on its command line. It once left the health
    port at 50052 and failed wherever that was taken."""
    from indexer_service.service.config import ServiceConfig

    ports = sorted(name for name in ServiceConfig.__dataclass_fields__ if name.endswith("_port"))
    assert {"grpc_port", "health_port", "http_port", "http_rpc_port"} <= set(ports)
    script = (ROOT / "scripts" / "check-prebuilt-cache.sh").read_text()
    (serve,) = [line for line in script.splitlines() if '"${CLI[@]}" serve' in line]
    for name in ports:
        assert f"--{name.replace('_', '-')} 0" in serve, (name, serve)


def test_the_local_base_is_the_pinned_base_made_from_debian(tmp_path: Path) -> None:
    """Where the registry does not answer, the base is made from the distribution the pinned one is built on
    (python:3.11-slim-bookworm: Debian 12, Python 3.11 with its headers), under a name that changes with its
    recipe, so a changed recipe is never served from an older build."""
    pinned = dockerfile_arg_defaults(dockerfile_instructions())["CPU_BASE"]
    assert f"-{image.LOCAL_BASE_SUITE}@" in pinned and "python:3.11" in pinned
    assert {"python3", "python3-dev", "python3-venv", "ca-certificates"} <= set(image.LOCAL_BASE_PACKAGES)
    argv = image.mmdebstrap_command(tmp_path / "base.tar")
    assert image.LOCAL_BASE_SUITE in argv and str(tmp_path / "base.tar") in argv
    assert image.local_base_tag().startswith(f"{image.LOCAL_BASE_NAME}:{image.LOCAL_BASE_SUITE}-")
