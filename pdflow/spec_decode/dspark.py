"""DSpark: a block drafter (the DFlash / DSpark recipe).

The target's hidden states at the tap layers, side by side, go through fc + RMSNorm
into one context feature per token. Every draft layer projects K/V of those features
(K/V only: a context row never queries) into its own paged pool, which rides the
target's block ids (page 16 per the drafter's binding). Proposing is one parallel
pass over a block [anchor, mask, ..., mask] at positions P..P+k-1: every block
position attends, non-causally, to the context entries [0, P) and to the whole block;
block position j predicts the token at P+j+1. The embedding and LM head are the
target's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pdflow.graph.units import UnitSpec
from pdflow.model.layers import Linear, RMSNorm
from pdflow.spec_decode.config import DrafterConfig
from pdflow.spec_decode.drafter import ContextBatch, Drafter, Proposal, ProposeBatch
from pdflow.spec_decode.layers import DraftLayer, dense_attention, rotary
from pdflow.spec_decode.sampling import draft_tokens


class DSparkDrafter(Drafter):
    kind = "dspark"
    context_kv_only = True
    context_lag = 0
    graphable = True

    def __init__(self, config: DrafterConfig, draft_units: Sequence[UnitSpec], *, tp_rank: int = 0,
                 tp_size: int = 1):
        super().__init__(config, draft_units, tp_rank=tp_rank, tp_size=tp_size)
        dcfg = config.decoder_config()
        h = config.hidden_size
        self.fc = Linear(config.feature_size, h, bias=False)
        self.context_norm = RMSNorm(h, config.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(h))
        self.layers = nn.ModuleList(DraftLayer(dcfg, tp_rank, tp_size) for _ in range(config.num_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary = rotary(dcfg)

    def context_features(self, features: torch.Tensor) -> torch.Tensor:
        """[..., taps * hidden] -> [..., hidden]."""
        return self.context_norm(self.fc(features.to(self.fc.weight.dtype)))

    def block_inputs(self, anchor_ids: torch.Tensor, k: int) -> torch.Tensor:
        """[..., k, hidden]: the anchor's embedding, then the mask embedding."""
        first = self.embed(anchor_ids)
        rest = self.mask_embedding.to(first.dtype).expand(*first.shape[:-1], k - 1, first.shape[-1])
        return torch.cat([first.unsqueeze(-2), rest], dim=-2)

    # -- serving (paged) ---------------------------------------------------------------

    def _write_context(self, batch: ContextBatch) -> None:
        self.write_context_device(batch.features, batch.positions, batch.slot_mapping)

    def write_context_device(self, features: torch.Tensor, positions: torch.Tensor,
                             slot_mapping: torch.Tensor) -> None:
        c = self.context_features(features)
        for row, layer in enumerate(self.layers):
            k, v = layer.kv(c, positions, self.rotary)
            k_cache, v_cache = self._cache(row)
            self.backend.store_kv(k, v, k_cache, v_cache, slot_mapping, **self._scales(row))

    def _propose(self, batch: ProposeBatch) -> Proposal:
        anchor = torch.tensor(batch.anchor_positions, dtype=torch.int64, device=batch.anchor_ids.device)
        return self._block_pass(batch.anchor_ids, anchor, batch.block_tables, batch.num_drafts,
                                batch.sampling, batch.generator)

    def propose_device(self, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor,
                       block_tables: torch.Tensor, num_drafts: int) -> Proposal:
        return self._block_pass(anchor_ids, anchor_positions, block_tables, num_drafts, None, None)

    def _block_pass(self, anchor_ids: torch.Tensor, anchor: torch.Tensor, block_tables: torch.Tensor, k: int,
                    sampling, generator) -> Proposal:
        """The block pass from device tensors only (anchor [B] int64 positions)."""
        b, device = anchor_ids.shape[0], anchor_ids.device
        positions = (anchor[:, None] + torch.arange(k, device=device)).reshape(-1)
        context_lens = anchor.to(torch.int32)
        x = self.block_inputs(anchor_ids, k).reshape(b * k, -1)
        for row, layer in enumerate(self.layers):
            a = layer.self_attn
            q, kb, vb = layer.qkv(x, positions, self.rotary)
            k_cache, v_cache = self._cache(row)
            attn = self.backend.block_attention(
                q.view(b, k, a.num_heads, a.head_dim),
                kb.contiguous().view(b, k, a.num_kv_heads, a.head_dim),  # the kernel wants one
                vb.contiguous().view(b, k, a.num_kv_heads, a.head_dim),  # stride for both
                k_cache, v_cache, context_lens,
                block_tables, a.scale, **self._scales(row),
            )
            x = layer.finish(x, attn.reshape(b * k, a.num_heads, a.head_dim))
        logits = self.logits(self.norm(x)).view(b, k, -1)
        tokens, probs = draft_tokens(logits, sampling, generator)
        return Proposal(tokens=tokens, probs=probs, logits=logits)

    # -- training (dense) --------------------------------------------------------------

    def dense_logits(self, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                     k: int | None = None) -> torch.Tensor:
        """Many blocks at once without a pool: features [N, T, F] and tokens [N, T] of
        whole sequences, anchors [N, A] positions (>= 0, anchor + k <= T not required).
        Returns logits [N, A, k, V]; block (n, a) position j predicts token
        anchors[n, a] + j + 1, seeing context [0, anchor) and its own block, exactly as
        ``propose`` does."""
        k = k or self.config.num_speculative_tokens
        n, t, _ = features.shape
        a_count = anchors.shape[1]
        device = features.device
        c = self.context_features(features).reshape(n * t, -1)
        ctx_pos = torch.arange(t, device=device).repeat(n)
        blk_pos = (anchors[..., None] + torch.arange(k, device=device)).reshape(-1)
        x = self.block_inputs(tokens.gather(1, anchors), k).reshape(n * a_count * k, -1)
        # Query (block a, position j) sees context t < anchor_a and every position of block a.
        q_anchor = anchors.repeat_interleave(k, dim=1)  # [N, A*k]
        sees_ctx = torch.arange(t, device=device)[None, None, :] < q_anchor[..., None]
        block_id = torch.arange(a_count, device=device).repeat_interleave(k)
        sees_blk = (block_id[:, None] == block_id[None, :]).expand(n, -1, -1)
        visible = torch.cat([sees_ctx, sees_blk], dim=2)
        for layer in self.layers:
            attn_mod = layer.self_attn
            kc, vc = layer.kv(c, ctx_pos, self.rotary)
            q, kb, vb = layer.qkv(x, blk_pos, self.rotary)
            hkv, hq, d = attn_mod.num_kv_heads, attn_mod.num_heads, attn_mod.head_dim
            keys = torch.cat([kc.view(n, t, hkv, d), kb.view(n, -1, hkv, d)], dim=1)
            values = torch.cat([vc.view(n, t, hkv, d), vb.view(n, -1, hkv, d)], dim=1)
            attn = dense_attention(q.view(n, -1, hq, d), keys, values, visible, attn_mod.scale)
            x = layer.finish(x, attn.reshape(-1, hq, d))
        return self.logits(self.norm(x)).view(n, a_count, k, -1)
