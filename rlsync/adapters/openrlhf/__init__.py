"""OpenRLHF adapter (``pip install 'rlsync[openrlhf]'``): a launcher, since OpenRLHF has no plugin point.

    rlsync launch openrlhf [--max-staleness N] -- <the arguments you give openrlhf.cli.train_ppo_ray>

runs OpenRLHF's own entry point with its weight sync replaced by rlsync's (through ``rlsync.patches.openrlhf``):
every trainer rank sends its share of the weights into every vLLM engine, each byte once, each engine worker
receiving only its tensor-parallel part, a version loaded all at once; a LoRA actor (``--ds.lora.rank``) sends its
adapter alone into engines built to serve it (``--lora-sync merged``: the whole model). Importing this package
patches nothing.
"""

from rlsync.adapters.openrlhf._hooks import setup_worker
from rlsync.adapters.openrlhf._launch import main

__all__ = ["main", "setup_worker"]
