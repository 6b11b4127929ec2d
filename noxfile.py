"""Test environments. Each framework adapter gets an environment of its own, because verl, TRL,
OpenRLHF and vLLM pin versions of torch, transformers and ray that cannot share one.

``nox`` runs every session; ``nox -s core`` runs one. (Sessions for the vLLM, verl, TRL and
OpenRLHF adapters join as those adapters land.) Sessions reuse their virtualenv when
``-R`` is given, which is the fast path for local iteration.
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True

# torch 2.13.0 (CPU) is the build every session uses on machines without a GPU; pin it first so
# that no extra pulls a multi-gigabyte CUDA build instead.
TORCH = "torch==2.13.0"


@nox.session(python="3.11")
def core(session: nox.Session) -> None:
    """The framework-free core, the transports (shm, tcp, NIXL), the transformers receiver and the CLI."""
    session.install(TORCH)
    session.install("-e", ".[nixl,dev]")
    session.run(
        "pytest", "tests/core", "tests/plugins", "tests/adapters", "tests/cli", "tests/test_public_api.py",
        "-p", "no:cacheprovider", *session.posargs,
    )
