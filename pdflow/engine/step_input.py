"""One scheduled batch as the plain message every executor runs (in process or per rank)."""

from __future__ import annotations

from pdflow.engine.scheduler import ScheduledBatch
from pdflow.engine.sequence import Sequence
from pdflow.parallel.messages import KVExport, PromptLogprobRows, SamplingSpec, StepInput


def _extend_slots(slots: list[int], table: list[int], start: int, end: int, block_size: int) -> None:
    """Cache slots of positions [start, end): one range per block, not a Python step per
    token (a prefill step can carry thousands)."""
    pos = start
    while pos < end:
        block, offset = divmod(pos, block_size)
        stop = min(end, (block + 1) * block_size)
        first = table[block] * block_size + offset
        slots.extend(range(first, first + stop - pos))
        pos = stop


def _check_source(seq: Sequence, step: int) -> None:
    """Every placeholder of a step reads the same earlier step's samples."""
    if not seq.in_flight or seq.sampled_at != seq.last_step or step not in (-1, seq.sampled_at):
        raise RuntimeError(
            f"{seq.request_id}: a placeholder must read the samples of its one step in flight "
            f"(sampled at step {seq.sampled_at}, last in step {seq.last_step}, this batch reads {step})"
        )


def _prompt_rows(seq: Sequence, start: int, end: int, first_row: int) -> PromptLogprobRows | None:
    """Rows of positions [start, end) that score a prompt token not scored yet (position
    p scores token p + 1; a recomputed prompt is not scored twice)."""
    lo, hi = max(start, len(seq.prompt_logprobs)), min(end, seq.num_prompt_tokens - 1)
    if lo >= hi:
        return None
    return PromptLogprobRows(request_id=seq.request_id, first_row=first_row + lo - start,
                             targets=seq.token_ids[lo + 1:hi + 1], top=seq.sampling.prompt_logprobs)


def build_step_input(
    batch: ScheduledBatch, *, block_size: int, step: int, released: list[str], speculative: bool = False,
) -> tuple[StepInput, list[Sequence]]:
    """Flattened ids/positions/slots of the batch's new tokens, its block tables, and the
    sequences sampled this step (those whose last known token is computed now). With
    ``speculative``, a decoding sequence's rows are [last token, drafts] and the message
    says what the drafter needs (drafts per sampled row, next tokens, adopted context).
    An ``ahead`` sequence (overlap scheduling) gets one placeholder row that the rank
    fills with its step in flight's sample."""
    ids, positions, slots, cu, ctx = [], [], [], [0], []
    sampled: list[Sequence] = []
    rows: list[int] = []
    exports: list[KVExport] = []
    num_drafts, next_ids, adopt = [], [], []
    holes, sources, source_step = [], [], -1
    prompt_rows: list[PromptLogprobRows] = []
    for seq, n, d, ahead in zip(batch.seqs, batch.num_new_tokens, batch.num_drafts, batch.ahead, strict=True):
        if ahead:  # overlap: one row, the token its step in flight samples (not known here)
            start, end = seq.num_tokens, seq.num_tokens + 1
            _check_source(seq, source_step)
            source_step = seq.sampled_at
            holes.append(len(ids))
            sources.append(seq.sample_index)
            ids.append(0)
            positions.append(start)
            _extend_slots(slots, seq.block_table, start, end, block_size)
            cu.append(cu[-1] + 1)
            ctx.append(end)
            next_ids.append(-1)
            adopt.append(-1)
            sampled.append(seq)
            rows.append(cu[-1] - 1)
            num_drafts.append(0)
            continue
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        known = end - d  # rows past it are drafts
        if seq.sampling.prompt_logprobs is not None:
            rows_of_prompt = _prompt_rows(seq, start, known, len(ids))
            if rows_of_prompt is not None:
                prompt_rows.append(rows_of_prompt)
        ids.extend(seq.token_ids[start:known])
        ids.extend(seq.draft_ids[:d])
        positions.extend(range(start, end))
        _extend_slots(slots, seq.block_table, start, end, block_size)
        cu.append(cu[-1] + n)
        ctx.append(end)
        next_ids.append(seq.token_ids[known] if known < seq.num_tokens else -1)
        adopt.append(start if seq.fresh else -1)
        if known == seq.num_tokens:
            sampled.append(seq)
            rows.append(cu[-1] - 1)
            num_drafts.append(d)
            target = seq.kv_target
            if target is not None and seq.num_output_tokens == 0:  # the prompt is complete
                exports.append(KVExport(
                    request_id=seq.request_id, nonce=target.nonce, consumer=target.consumer,
                    src_blocks=seq.block_table[target.first_block:target.first_block + len(target.blocks)],
                    dst_blocks=list(target.blocks),
                ))
    width = max(len(seq.block_table) for seq in batch.seqs)
    tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in batch.seqs]
    message = StepInput(
        step=step,
        seq_ids=[s.request_id for s in batch.seqs],
        token_ids=ids,
        positions=positions,
        slot_mapping=slots,
        cu_seqlens_q=cu,
        context_lens=ctx,
        block_tables=tables,
        sample_rows=rows,
        sample_seq_ids=[s.request_id for s in sampled],
        sampling=[
            SamplingSpec(
                temperature=s.sampling.temperature, top_k=s.sampling.top_k,
                top_p=s.sampling.top_p, seed=s.sampling.seed,
            )
            for s in sampled
        ],
        released_seq_ids=released,
        exports=exports,
        placeholder_rows=holes,
        placeholder_samples=sources,
        placeholder_step=source_step,
        prompt_logprobs=prompt_rows,
    )
    if any(s.sampling.logprobs is not None for s in sampled):
        message.top_logprobs = [-1 if s.sampling.logprobs is None else s.sampling.logprobs for s in sampled]
    if speculative:
        message.num_drafts, message.next_token_ids, message.context_adopt = num_drafts, next_ids, adopt
    return message, sampled
