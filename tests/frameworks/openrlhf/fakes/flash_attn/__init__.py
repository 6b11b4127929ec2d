"""FAKE flash_attn (named as such): the import surface OpenRLHF 0.11.2 needs at import time, nothing more.

OpenRLHF imports flash-attn at module level (``openrlhf/models/ring_attn_utils.py``: ``from flash_attn.bert_padding
import index_first_axis, pad_input, rearrange, unpad_input`` and ``from flash_attn.utils.distributed import
all_gather``), reached from ``openrlhf.models.actor``; flash-attn builds only against CUDA. The functions are used
by packed-sample and ring-attention training, which the rlsync tests never run: calling one raises."""

__version__ = "0.0.0+rlsync.fake"
