"""EAGLE and EAGLE3: chain drafters, one decoder layer proposing one token per step.

Entry t of the draft layer pairs the target's feature at position t with the token at
t+1: fc(concat(embed(x[t+1]), feature[t])). Written after each target forward for the
rows whose next token is known (K/V only); the last row of a request waits for the
sampled token, and the first propose step writes it (so a producer must still propose
once after its final chunk). Step j of a proposal feeds the layer's own output back as
the feature, with the previous draft as the token.

- ``eagle``: the feature is the target's final normed hidden state.
- ``eagle3``: the feature fuses several target taps (fc over them side by side); the
  taps come from its checkpoint, not the run config, so a PP relay cannot carry them:
  the graph refuses it under PP and so does ``check_runtime``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pdflow.graph.refusals import Code
from pdflow.graph.units import UnitSpec
from pdflow.model.layers import Linear, RMSNorm
from pdflow.spec_decode.config import DrafterConfig
from pdflow.spec_decode.drafter import ContextBatch, Drafter, Proposal, ProposeBatch
from pdflow.spec_decode.layers import DraftLayer, dense_attention, rotary
from pdflow.spec_decode.sampling import draft_tokens


class Eagle3UnderPP(RuntimeError):
    """EAGLE3 reached a PP instance although the graph refuses it (EAGLE3_UNDER_PP)."""

    code = Code.EAGLE3_UNDER_PP


def eagle3_default_taps(num_layers: int) -> tuple[int, ...]:
    """Low, middle and high layers, as EAGLE-3 picks them: 2, L/2 and L-3."""
    picks = {min(max(0, t), num_layers - 1) for t in (2, num_layers // 2, num_layers - 3)}
    return tuple(sorted(picks))


class ChainDrafter(Drafter):
    context_kv_only = False
    context_lag = 1

    def __init__(self, config: DrafterConfig, draft_units: Sequence[UnitSpec], *, tp_rank: int = 0,
                 tp_size: int = 1):
        super().__init__(config, draft_units, tp_rank=tp_rank, tp_size=tp_size)
        dcfg = config.decoder_config()
        h = config.hidden_size
        self.fuse = Linear(config.feature_size, h, bias=False) if config.tap_layers else None
        self.fc = Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([DraftLayer(dcfg, tp_rank, tp_size)])
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary = rotary(dcfg)

    def target_feature(self, features: torch.Tensor) -> torch.Tensor:
        """[..., feature_size] target features -> [..., hidden] chain feature."""
        features = features.to(self.fc.weight.dtype)
        return features if self.fuse is None else self.fuse(features)

    def entry_inputs(self, next_ids: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.embed(next_ids).to(feature.dtype), feature], dim=-1))

    # -- serving (paged) ---------------------------------------------------------------

    def _write_context(self, batch: ContextBatch) -> None:
        ids = batch.token_ids
        nxt = torch.roll(ids, -1)
        last = torch.tensor(batch.cu_seqlens[1:], dtype=torch.int64, device=ids.device) - 1
        after = batch.next_token_ids or [-1] * len(batch.seq_ids)
        nxt[last] = torch.tensor(after, dtype=ids.dtype, device=ids.device)
        slot_mapping = torch.where(nxt >= 0, batch.slot_mapping, -1)
        x = self.entry_inputs(nxt.clamp(min=0), self.target_feature(batch.features))
        layer = self.layers[0]
        k, v = layer.kv(layer.input_layernorm(x), batch.positions, self.rotary)
        k_cache, v_cache = self._cache(0)
        self.backend.store_kv(k, v, k_cache, v_cache, slot_mapping, **self._scales(0))

    def _propose(self, batch: ProposeBatch) -> Proposal:
        if batch.anchor_features is None:
            raise ValueError(f"{self.kind} proposes from the target feature of the row before the "
                             "anchor: pass ProposeBatch.anchor_features")
        device = batch.anchor_ids.device
        layer, attn_mod = self.layers[0], self.layers[0].self_attn
        k_cache, v_cache = self._cache(0)
        scales = self._scales(0)
        bs = self.block_size
        position = torch.tensor(batch.anchor_positions, dtype=torch.int64, device=device) - 1
        feature = self.target_feature(batch.anchor_features)
        token = batch.anchor_ids
        tokens, probs, logits = [], [], []
        for _ in range(batch.num_drafts):
            x = self.entry_inputs(token, feature)
            q, k, v = layer.qkv(x, position, self.rotary)
            blocks = batch.block_tables.gather(1, (position // bs)[:, None])[:, 0].long()
            self.backend.store_kv(k, v, k_cache, v_cache, blocks * bs + position % bs, **scales)
            attn = self.backend.decode_attention(
                q, k_cache, v_cache, (position + 1).to(torch.int32), batch.block_tables, attn_mod.scale,
                **scales,
            )
            feature = layer.finish(x, attn)
            step_logits = self.logits(self.norm(feature))
            tok, prob = draft_tokens(step_logits[:, None], batch.sampling, batch.generator)
            tokens.append(tok[:, 0])
            probs.append(None if prob is None else prob[:, 0])
            logits.append(step_logits)
            token, position = tok[:, 0], position + 1
        return Proposal(
            tokens=torch.stack(tokens, 1),
            probs=None if probs[0] is None else torch.stack(probs, 1),
            logits=torch.stack(logits, 1),
        )

    # -- training (dense) --------------------------------------------------------------

    def dense_logits(self, features: torch.Tensor, tokens: torch.Tensor, steps: int) -> torch.Tensor:
        """Teacher-forced chains from every entry at once: features [N, T, F], tokens
        [N, T]. Returns [N, steps, T-1, V]: step j at entry t predicts token t+2+j after
        drafts tokens[t+1 .. t+j], seeing entries [0, t] and its own chain's earlier
        steps, exactly as ``propose`` does (training-time test)."""
        n, t, _ = features.shape
        e = t - 1
        device = features.device
        layer, attn_mod = self.layers[0], self.layers[0].self_attn
        hq, hkv, d = attn_mod.num_heads, attn_mod.num_kv_heads, attn_mod.head_dim
        padded = torch.cat([tokens, tokens.new_zeros(n, steps)], dim=1)
        feature = self.target_feature(features[:, :e])
        causal = torch.ones(e, e, dtype=torch.bool, device=device).tril()
        diag = torch.eye(e, dtype=torch.bool, device=device)
        keys, values, out = [], [], []
        for j in range(steps):
            x = self.entry_inputs(padded[:, 1 + j:1 + j + e], feature).reshape(n * e, -1)
            pos = (torch.arange(e, device=device) + j).repeat(n)
            q, k, v = layer.qkv(x, pos, self.rotary)
            keys.append(k.view(n, e, hkv, d))
            values.append(v.view(n, e, hkv, d))
            visible = torch.cat([causal] + [diag] * j, dim=1)
            attn = dense_attention(q.view(n, e, hq, d), torch.cat(keys, 1), torch.cat(values, 1), visible,
                                   attn_mod.scale)
            hidden = layer.finish(x, attn.reshape(-1, hq, d))
            out.append(self.logits(self.norm(hidden)).view(n, e, -1))
            feature = hidden.view(n, e, -1)
        return torch.stack(out, 1)


class EagleDrafter(ChainDrafter):
    kind = "eagle"


class Eagle3Drafter(ChainDrafter):
    kind = "eagle3"

    def check_runtime(self, *, pp: int) -> None:
        if pp > 1:
            raise Eagle3UnderPP(
                f"eagle3 taps target layers {list(self.tap_layers)} named by its checkpoint; a pp={pp} "
                "instance relays only taps its config declares, so its context K/V would be wrong. "
                "Serve it with pp=1 (the graph refuses this run: EAGLE3_UNDER_PP)."
            )
