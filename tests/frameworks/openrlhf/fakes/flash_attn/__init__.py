"""FAKE flash_attn (named as such): the import surface OpenRLHF 0.11.2 needs.

OpenRLHF imports flash-attn at module level (``openrlhf/models/ring_attn_utils.py``: ``from flash_attn.bert_padding
import index_first_axis, pad_input, rearrange, unpad_input`` and ``from flash_attn.utils.distributed import
all_gather``), reached from ``openrlhf.models.actor``; flash-attn builds only against CUDA. The functions are used
by packed-sample training (bert_padding: implemented, plain PyTorch as in flash-attn) and ring attention
(utils.distributed: never run by the rlsync tests, calling it raises)."""

__version__ = "0.0.0+rlsync.fake"
