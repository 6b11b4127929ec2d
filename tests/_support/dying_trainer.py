"""The vLLM tests' trainer, made to die by SIGKILL in the middle of its first version."""

import os
import runpy
import signal
import sys
from pathlib import Path

from rlsync import Link
from rlsync.plugins import ShmLink

_write = ShmLink.write
_calls = [0]


def _dying_write(self, source, runs):  # type: ignore[no-untyped-def]
    _calls[0] += 1
    _write(self, source, runs)
    if _calls[0] == 3:  # some tensors landed, most did not
        os.kill(os.getpid(), signal.SIGKILL)


ShmLink.write = _dying_write  # type: ignore[method-assign]
ShmLink.prepare = Link.prepare  # type: ignore[method-assign]  # a prepared version written part by part, through write
ShmLink.write_prepared = Link.write_prepared  # type: ignore[method-assign]
sys.argv[0] = str(Path(__file__).with_name("model_trainer.py"))
runpy.run_path(sys.argv[0], run_name="__main__")
