"""The scheduler with steps in flight (pipeline parallelism): a sequence whose step is not
back is neither scheduled again nor preempted (its K/V is still being written: freeing its
blocks would let another sequence's K/V land on top), and ``max_seqs`` spreads the running
sequences over the steps in flight."""

from __future__ import annotations

from pdflow.engine.block_manager import BlockManager
from pdflow.engine.sampling_params import SamplingParams
from pdflow.engine.scheduler import Scheduler
from pdflow.engine.sequence import Sequence, SequenceStatus

BS = 4


def seq(n: int, rid: str) -> Sequence:
    return Sequence(request_id=rid, token_ids=list(range(1, n + 1)), num_prompt_tokens=n,
                    sampling=SamplingParams())


def run_step(batch) -> None:
    """What collecting a step does: the computed tokens count, decode seqs get a token."""
    for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(7)


def test_in_flight_sequences_are_skipped_and_never_preempted():
    blocks = BlockManager(num_blocks=2, block_size=BS, enable_prefix_caching=False)
    sched = Scheduler(blocks, max_num_batched_tokens=64, max_num_seqs=8)
    a, b = seq(4, "a"), seq(4, "b")
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert first.seqs == [a, b]
    run_step(first)  # each now holds 5 tokens: the next step needs a second block each
    assert blocks.num_free_blocks == 0
    a.in_flight = b.in_flight = True
    assert sched.schedule().empty  # nothing to run, and nobody preempted
    assert a.num_preemptions == b.num_preemptions == 0
    # a is back, b (the newest: the usual victim) is not. a needs a block and none is
    # free: a must give its own back, not take b's while b's step still writes into it.
    a.in_flight = False
    b_blocks = list(b.block_table)
    assert sched.schedule().empty
    assert b.status is SequenceStatus.RUNNING and b.num_preemptions == 0
    assert b.block_table == b_blocks
    assert a.status is SequenceStatus.WAITING and a.num_preemptions == 1
    # b comes back: now it can run, with the block a gave back.
    b.in_flight = False
    assert sched.schedule().seqs == [b]


def test_max_seqs_spreads_running_sequences_over_steps():
    blocks = BlockManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    sched = Scheduler(blocks, max_num_batched_tokens=64, max_num_seqs=8)
    seqs = [seq(3, f"s{i}") for i in range(4)]
    for s in seqs:
        sched.add(s)
    step0 = sched.schedule(max_seqs=2)
    for s in step0.seqs:
        s.in_flight = True
    step1 = sched.schedule(max_seqs=2)
    for s in step1.seqs:
        s.in_flight = True
    assert step0.seqs == seqs[:2] and step1.seqs == seqs[2:]
    assert sched.schedule(max_seqs=2).empty  # everyone in flight
