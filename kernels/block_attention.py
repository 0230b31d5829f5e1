"""DSpark block attention: K draft positions attend non-causally to the paged context
plus the K block positions themselves.

The block's own K/V are not in the cache yet, so they ride along as ``NX`` extra
tokens of the split-K paged kernel (decode_attention.py): each (sequence, KV head)
program puts all K positions times the GQA group in the rows of one ``tl.dot``, so
the context is read once per step whatever K is.
"""

from __future__ import annotations

from .decode_attention import paged_attention
from .reference import block_attention as block_attention_reference

__all__ = ["block_attention", "block_attention_reference"]


def block_attention(
    q, k_block, v_block, k_cache, v_cache, context_lens, block_tables, scale, k_scale=None,
    v_scale=None, **tuning
):
    """q [B, K, H_q, D]; k/v_block [B, K, H_kv, D]; context_lens excludes the block. An fp8
    cache's scales dequantize the context; the block itself is read in q's dtype."""
    return paged_attention(
        q, k_cache, v_cache, context_lens, block_tables, scale, k_block, v_block,
        k_scale=k_scale, v_scale=v_scale, **tuning
    )
