"""OpenRLHF adapter (``pip install 'rlsync[openrlhf]'``): a launcher, since OpenRLHF has no plugin point.

    rlsync launch openrlhf [--max-staleness N] -- <the arguments you give openrlhf.cli.train_ppo_ray>

runs OpenRLHF's own entry point with its weight sync replaced by rlsync's (through ``rlsync.patches.openrlhf``):
every trainer rank sends its share of the weights into every vLLM engine, each byte once, each engine worker
receiving only its tensor-parallel part, a version loaded all at once; a LoRA actor (``--ds.lora.rank``) sends its
adapter alone into engines built to serve it (``--lora-sync merged``: the whole model). ``--episodes
redis://HOST:6379/0`` records every rollout of the agent executors (``rlsync.adapters.openrlhf._episodes``):
``tool_call_key()`` and ``current_episode()`` are for the agent's own code. Importing this package patches nothing.
"""

from rlsync.adapters.openrlhf._episodes import current_episode, tool_call_key
from rlsync.adapters.openrlhf._hooks import setup_worker
from rlsync.adapters.openrlhf._launch import main

__all__ = ["current_episode", "main", "setup_worker", "tool_call_key"]
