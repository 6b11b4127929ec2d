"""``python -m rlsync.adapters.openrlhf [OPTIONS] -- <OpenRLHF's arguments>``: see ``_launch``."""

from rlsync.adapters.openrlhf._launch import main

main()
