"""Prefix caching and n > 1 in the scheduler and pool: hashes, hits, publishing, eviction,
forks, and the accounting staying whole under any mix of them. No model: integers only."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.core import Prompt, Scheduler, block_hashes, sequence_id
from kvserve.core.prefix import chain_hash, root_hash
from tests.core.helpers import admit, can_admit, make_scheduler, run

BS = 4


def make(
    num_blocks: int = 16, slots: int = 4, caching: bool = True, admission="reserve", **config
) -> Scheduler:
    return make_scheduler(
        num_blocks=num_blocks,
        block_size=BS,
        max_model_len=256,
        caching=caching,
        max_num_seqs=slots,
        admission=admission,
        **config,
    )


def test_hashes_chain_from_the_salt_and_cover_full_blocks_only() -> None:
    tokens = list(range(10))
    hashes = block_hashes(tokens, BS)
    assert len(hashes) == 2
    assert hashes[0] == chain_hash(root_hash(None), tokens[:4])
    assert hashes[1] == chain_hash(hashes[0], tokens[4:8])
    assert block_hashes(tokens, BS, "tenant-a") != hashes
    assert block_hashes(tokens, BS, "a")[0] != block_hashes(tokens, BS, "b")[0]
    # The same block content under a different parent is a different block.
    assert block_hashes([9, 9, 9, 9] + tokens[:4], BS)[1] != hashes[0]
    assert block_hashes(tokens, BS, known=hashes[:1]) == hashes


def test_a_second_request_reuses_published_blocks_and_computes_the_rest() -> None:
    scheduler = make()
    prompt = tuple(range(1, 11))  # 10 tokens: 2 full blocks
    admit(scheduler, "a", 10, 2, 0, Prompt(prompt))
    assert scheduler.get("a").num_cached_tokens == 0
    run(scheduler)  # the whole prompt in one chunk; both full blocks are published
    assert scheduler.pool.cache.num_cached == 2
    a_table = scheduler.pool.table("a")
    scheduler.release("a")
    # Both full blocks, and the tail (positions 8, 9 of the third block: tokens 9, 10).
    assert scheduler.pool.num_cached_free == 3
    seq = admit(scheduler, "b", 10, 2, 1, Prompt(prompt))
    # Two blocks by reference, then one position of the tail by copy: the last prompt token
    # is computed.
    assert seq.num_cached_tokens == 9 and seq.num_computed == 9
    assert scheduler.pool.table("b")[:2] == a_table[:2]
    assert scheduler.pool.num_cached_free == 0  # the tail is held until its copy has run
    plan = run(scheduler)
    assert [(c.source, c.target) for c in plan.copies] == [
        (a_table[2], scheduler.pool.table("b")[2])
    ]
    assert [(c.start, c.num_tokens) for c in plan.chunks] == [(9, 1)]
    assert plan.chunks[0].token_ids == (10,)
    assert scheduler.pool.num_cached_free == 1  # the tail, back once the copy landed
    scheduler.release("b")
    assert scheduler.pool.check_whole()


def test_a_prompt_of_whole_blocks_still_computes_its_last_token() -> None:
    scheduler = make()
    prompt = tuple(range(1, 9))  # exactly 2 blocks
    admit(scheduler, "a", 8, 1, 0, Prompt(prompt))
    run(scheduler)
    scheduler.release("a")
    seq = admit(scheduler, "b", 8, 1, 1, Prompt(prompt))
    assert seq.num_cached_tokens == 4  # one block: the second holds the token to sample from
    plan = run(scheduler)
    assert [(c.start, c.num_tokens, c.samples) for c in plan.chunks] == [(4, 4, True)]


def test_salts_never_share_and_no_prompt_means_no_lookup() -> None:
    scheduler = make()
    prompt = tuple(range(1, 11))
    admit(scheduler, "a", 10, 1, 0, Prompt(prompt, salt="x"))
    run(scheduler)
    scheduler.release("a")
    assert admit(scheduler, "b", 10, 1, 1, Prompt(prompt, salt="y")).num_cached_tokens == 0
    assert admit(scheduler, "c", 10, 1, 2, Prompt(prompt)).num_cached_tokens == 0
    assert admit(scheduler, "d", 10, 1, 3).num_cached_tokens == 0
    assert admit(scheduler, "e", 10, 1, 4, Prompt(prompt, salt="x")).num_cached_tokens == 9


def test_reservation_counts_only_blocks_still_to_fill() -> None:
    scheduler = make(num_blocks=5)
    prompt = tuple(range(1, 13))  # 12 tokens: 3 blocks
    admit(scheduler, "a", 12, 4, 0, Prompt(prompt))  # 4 blocks
    run(scheduler)
    # 4 blocks held, 1 free: a copy without the cache could not be admitted.
    assert not can_admit(scheduler, 12, 4)
    # With the cache, 2 blocks are hits (the third holds the last prompt token): 2 fresh.
    assert not can_admit(scheduler, 12, 4, Prompt(prompt))
    scheduler.release("a")
    assert scheduler.pool.num_cached_free == 3
    seq = admit(scheduler, "b", 12, 4, 1, Prompt(prompt))
    assert seq.num_cached_tokens == 8
    # The third published block was not a hit; it is evicted now only if a fresh block is
    # needed, and b needed 2 of the 2 free + 1 cached-free.
    assert scheduler.pool.num_used == 4
    assert scheduler.pool.check_whole()


def test_eviction_takes_the_least_recently_freed_and_only_when_the_free_list_is_empty() -> None:
    scheduler = make(num_blocks=4)
    admit(scheduler, "a", 8, 1, 0, Prompt(tuple(range(1, 9))))
    run(scheduler)
    scheduler.release("a")
    pool = scheduler.pool
    assert pool.num_cached_free == 2 and pool.num_free == 4
    admit(scheduler, "b", 3, 1, 1, Prompt((50, 51, 52)))  # one fresh block from the free list
    assert pool.num_cached_free == 2
    admit(scheduler, "c", 7, 1, 2, Prompt(tuple(range(60, 67))))  # 2 blocks: 1 free, 1 evicted
    assert pool.num_cached_free == 1
    assert pool.check_whole()


def test_a_failed_step_publishes_nothing() -> None:
    scheduler = make()
    prompt = tuple(range(1, 11))
    admit(scheduler, "a", 10, 1, 0, Prompt(prompt))
    plan = scheduler.schedule()
    scheduler.abort(plan)
    scheduler.release("a")
    assert scheduler.pool.cache.num_cached == 0
    assert scheduler.pool.num_cached_free == 0 and scheduler.pool.check_whole()


def test_n_answers_prefill_once_then_share_full_blocks_and_copy_the_partial_one() -> None:
    scheduler = make(num_blocks=16)
    prompt = tuple(range(1, 11))  # 2 full blocks + 2 tokens
    leader = admit(scheduler, "r", 10, 3, 0, Prompt(prompt, n=3))
    ids = [sequence_id("r", i) for i in range(3)]
    assert leader.seq_id == "r" and [s.seq_id for s in scheduler.running] == ids
    # reserve prompt once plus 3 answers: 4 blocks for the leader, 2 for each follower
    assert scheduler.pool.num_used == 4 + 2 * 2
    plan = scheduler.schedule()
    assert [c.request_id for c in plan.chunks] == ["r"]
    assert plan.chunks[0].sampler_ids == tuple(ids)
    assert set(plan.waiting_ids) == set(ids[1:])
    scheduler.update_from_output(plan, {"r": 5, "r#1": 6, "r#2": 7})
    leader_table = scheduler.pool.table("r")
    for seq_id, token in zip(ids[1:], (6, 7), strict=True):
        seq = scheduler.get(seq_id)
        assert seq.output_token_ids == [token] and seq.num_computed == 10
        table = scheduler.pool.table(seq_id)
        assert table[:2] == leader_table[:2] and table[2] != leader_table[2]
    plan = scheduler.schedule()
    assert [(c.request_id, c.source, c.target) for c in plan.copies] == [
        (seq_id, leader_table[2], scheduler.pool.table(seq_id)[2]) for seq_id in ids[1:]
    ]
    assert [c.request_id for c in plan.chunks] == ids
    assert [c.token_ids for c in plan.chunks] == [(5,), (6,), (7,)]
    scheduler.update_from_output(plan, {"r": 1, "r#1": 1, "r#2": 1})
    for seq_id in ids:
        scheduler.release(seq_id)
    assert scheduler.pool.check_whole() and scheduler.pool.num_used == 0


def test_n_answers_are_admitted_all_or_nothing() -> None:
    scheduler = make(num_blocks=7, slots=4)
    prompt = tuple(range(1, 11))
    assert not can_admit(scheduler, 10, 3, Prompt(prompt, n=3))  # needs 8 blocks
    assert admit(scheduler, "r", 10, 3, 0, Prompt(prompt, n=3)) is None
    assert scheduler.pool.num_used == 0 and scheduler.num_free_slots == 4
    assert not can_admit(make(slots=2), 10, 3, Prompt(prompt, n=3))


def test_releasing_a_leader_before_its_prompt_is_done_releases_its_followers() -> None:
    scheduler = make()
    admit(scheduler, "r", 10, 3, 0, Prompt(tuple(range(1, 11)), n=2))
    scheduler.release("r")
    assert scheduler.num_running == 0 and scheduler.pool.num_used == 0


specs = st.lists(
    st.tuples(
        st.sampled_from(["p1", "p2", "p3"]),  # one of a few shared prefixes
        st.integers(0, 9),  # distinct tail length
        st.integers(1, 6),  # answer budget
        st.integers(1, 3),  # n
        st.sampled_from([None, "s"]),  # salt
        st.integers(0, 4),  # cancel after this many steps (4 = never)
    ),
    min_size=1,
    max_size=10,
)
PREFIXES = {"p1": tuple(range(100, 109)), "p2": tuple(range(100, 105)), "p3": (7,) * 13}


@settings(max_examples=150, deadline=None)
@given(specs=specs, num_blocks=st.integers(8, 24), chunk=st.sampled_from([3, 5, 64]))
def test_any_mix_drains_to_a_whole_pool(specs, num_blocks, chunk) -> None:
    scheduler = make(num_blocks=num_blocks, slots=4, prefill_chunk=chunk)
    pending = list(enumerate(specs))
    ages: dict[str, tuple[int, int]] = {}
    arrival = 0
    for _ in range(400):
        while pending:
            index, (prefix, tail, budget, n, salt, cancel_at) = pending[0]
            prompt = PREFIXES[prefix] + tuple(range(200 + index, 200 + index + tail))
            try:
                reserve = scheduler.check(len(prompt), budget)
            except ValueError:
                pending.pop(0)
                continue
            if n * scheduler.pool.blocks_for(len(prompt) + reserve) > num_blocks:
                pending.pop(0)
                continue
            request_id = f"q{index}"
            if admit(scheduler, request_id, len(prompt), reserve, arrival, Prompt(prompt, salt, n)):
                arrival += 1
                pending.pop(0)
                ages[request_id] = (n, cancel_at)
            else:
                break
        if not scheduler.running and not pending:
            break
        run(scheduler, token=3)
        assert scheduler.pool.check_whole()
        for request_id, (n, cancel_at) in list(ages.items()):
            ids = [sequence_id(request_id, i) for i in range(n)]
            ages[request_id] = (n, cancel_at - 1)
            if cancel_at == 0:  # a disconnect ends every answer, mid-prefill or not
                for seq_id in ids:
                    scheduler.release(seq_id)
            for seq_id in ids:
                seq = scheduler.get(seq_id)
                if seq is not None and seq.is_finished:
                    scheduler.release(seq_id)
            if all(scheduler.get(seq_id) is None for seq_id in ids):
                del ages[request_id]
    assert not scheduler.running and not pending
    pool = scheduler.pool
    assert pool.check_whole() and pool.num_used == 0 and pool.num_free == num_blocks
    assert scheduler.num_free_slots == 4


def test_a_chat_turn_reuses_the_previous_answer_up_to_its_last_token() -> None:
    """Turn 2's prompt is turn 1's prompt, its answer and a new user turn: it takes every
    position turn 1 computed (all but the last sampled token, which never had KV)."""
    scheduler = make(num_blocks=16)
    first = tuple(range(1, 9))  # 2 blocks
    admit(scheduler, "t1", 8, 3, 0, Prompt(first))
    answer = []
    for token in (41, 42, 43):
        run(scheduler, token)
        answer.append(token)
    assert scheduler.get("t1").num_computed == 10  # 8 prompt + 2 answer tokens fed back
    table = scheduler.pool.table("t1")
    scheduler.release("t1")
    second = first + tuple(answer) + (60, 61, 62)
    seq = admit(scheduler, "t2", len(second), 1, 1, Prompt(second))
    assert seq.num_cached_tokens == 10
    plan = run(scheduler)
    assert [(c.source, c.target) for c in plan.copies] == [
        (table[2], scheduler.pool.table("t2")[2])
    ]
    assert [(c.start, c.token_ids) for c in plan.chunks] == [(10, (43, 60, 61, 62))]
    # A prompt that leaves the answer early takes only the positions it shares.
    diverged = first + (41, 99, 98)
    assert admit(scheduler, "t3", 11, 1, 2, Prompt(diverged)).num_cached_tokens == 9
    # A tail under another salt, or after other blocks, is never a match.
    assert (
        admit(scheduler, "t4", len(second), 1, 3, Prompt(second, salt="s")).num_cached_tokens == 0
    )
    scheduler.release("t2")
    scheduler.release("t3")
    scheduler.release("t4")
    assert scheduler.pool.check_whole()


def test_a_released_tail_is_published_only_from_landed_steps() -> None:
    scheduler = make()
    prompt = tuple(range(1, 11))
    admit(scheduler, "a", 10, 4, 0, Prompt(prompt, salt="s"))
    run(scheduler)
    plan = scheduler.schedule()  # a decode row that fails: position 10 never lands
    scheduler.abort(plan)
    scheduler.release("a")
    seq = admit(scheduler, "b", 12, 1, 1, Prompt((*prompt, 7, 5), salt="s"))
    assert seq.num_cached_tokens == 10  # 2 blocks and the tail's 2 landed positions, not 11
    scheduler.release("b")
    assert scheduler.pool.check_whole()


TOKENS = st.lists(st.integers(1, 3), min_size=1, max_size=14)


@settings(max_examples=150, deadline=None)
@given(
    prompts=st.lists(
        st.tuples(TOKENS, st.integers(1, 5), st.integers(0, 5)), min_size=1, max_size=8
    ),
    num_blocks=st.integers(6, 20),
    chunk=st.sampled_from([2, 5, 64]),
    admission=st.sampled_from(["reserve", "partial"]),
)
def test_every_position_a_row_reads_holds_its_own_sequence_s_kv(
    prompts, num_blocks, chunk, admission
) -> None:
    """A model-free oracle for reuse: the KV of position p "is" the tokens 0..p of the sequence
    that wrote it. Copies and rows write it, rows read every earlier position, and a read must
    find exactly its own sequence's tokens, whatever was shared, copied, evicted, cancelled,
    preempted or recomputed."""
    scheduler = make(
        num_blocks=num_blocks, slots=3, prefill_chunk=chunk, admission=admission, reserve_tokens=1
    )
    kv: dict[tuple[int, int], tuple[int, ...]] = {}
    history: list[int] = []  # a chat: every prompt continues the previous turn's tokens
    pending = list(prompts)
    step = 0
    while pending or scheduler.running or scheduler.num_preempted:
        scheduler.resume()
        while pending and not scheduler.num_preempted:
            extra, budget, cancel_after = pending[0]
            prompt = (*history, *extra)[-40:]
            if scheduler.pool.blocks_for(len(prompt) + budget) > num_blocks:
                pending.pop(0)
                continue
            request_id = f"r{len(prompts) - len(pending)}"
            if not admit(scheduler, request_id, len(prompt), budget, step, Prompt(prompt)):
                break
            pending.pop(0)
            history = list(prompt)
        plan = scheduler.schedule()
        for copy in plan.copies:
            for offset in range(BS):
                if (copy.source, offset) in kv:
                    kv[(copy.target, offset)] = kv[(copy.source, offset)]
                else:
                    kv.pop((copy.target, offset), None)
        for c in plan.chunks:
            tokens = scheduler.get(c.request_id).all_token_ids
            for p in range(c.start, c.end):
                kv[(c.block_ids[p // BS], p % BS)] = tuple(tokens[: p + 1])
            for q in range(c.end):
                assert kv.get((c.block_ids[q // BS], q % BS)) == tuple(tokens[: q + 1])
        sampled = {s: 1 + (step + len(s)) % 3 for c in plan.chunks for s in c.sampler_ids}
        scheduler.update_from_output(plan, sampled)
        step += 1
        for seq in scheduler.running:
            if seq.is_finished or step % 7 == 6:
                history = seq.all_token_ids
                scheduler.release(seq.seq_id)
        assert scheduler.pool.check_whole()
        assert step < 2000
    assert scheduler.pool.num_used == 0 and scheduler.pool.check_whole()
    if admission == "reserve":
        assert scheduler.num_preemptions == 0
