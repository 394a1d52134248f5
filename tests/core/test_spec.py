"""Speculative decoding's policy: the prompt-lookup proposer, the step-aside rule, the
configuration as vLLM spells it, and how the scheduler plans, caps and rolls back guesses."""

from __future__ import annotations

import pytest

from kvserve.config import SchedulerConfig, SpeculativeConfig, parse_speculative_config
from kvserve.core import BlockPool, KVManager, Prompt, Scheduler, make_sequences
from kvserve.core.spec import (
    MARGIN,
    MAX_PROBE_PERIOD,
    PROBE_PERIOD,
    PROBE_STEPS,
    REST_STEPS,
    WARMUP_STEPS,
    Acceptance,
    Payoff,
    propose_ngram,
)

# -- the proposer --------------------------------------------------------------------------------


def test_prompt_lookup_continues_the_latest_earlier_match_of_the_longest_suffix():
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 2, 3, 4]
    # "2 3 4" occurs twice before the end; the latest (followed by 6 7) wins.
    assert propose_ngram(tokens, 3, 2, 3) == (6, 7, 2)
    # Only the 4-gram "x 2 3 4" can match with min 4: "9 2 3 4" and "7 2 3 4" do not.
    assert propose_ngram(tokens, 3, 4, 4) == ()
    assert propose_ngram([5, 6, 5], 2, 1, 2) == (6, 5)
    assert propose_ngram([1, 2, 3], 2, 2, 4) == ()
    assert propose_ngram([1, 1], 0, 1, 1) == ()


def test_longer_ngrams_are_preferred():
    # "3 4" last occurred followed by 8; "2 3 4" followed by 5.
    tokens = [2, 3, 4, 5, 0, 3, 4, 8, 1, 2, 3, 4]
    assert propose_ngram(tokens, 1, 2, 3) == (5,)
    assert propose_ngram(tokens, 1, 2, 2) == (8,)


def test_acceptance_shrinks_k_on_failures_grows_it_back_and_rests():
    record = Acceptance(4)
    assert record.wants() == 4
    record.record(4, 0)
    assert record.k == 2
    record.record(2, 0)
    assert record.k == 1
    record.record(1, 0)
    assert [record.wants() for _ in range(REST_STEPS)] == [0] * REST_STEPS
    assert record.wants() == 1
    record.record(1, 1)
    record.record(2, 2)
    assert record.k == 3
    record.record(3, 1)  # partly accepted: k stays
    assert record.k == 3
    assert record.num_drafts == 6 and record.num_draft_tokens == 13 and record.num_accepted == 4
    assert record.accepted_per_pos == [3, 1, 0, 0]
    # A lookup's guesses (no model call to make them) rest none: k = 1 is tried again at once.
    lookup = Acceptance(2, rest_steps=0)
    lookup.record(2, 0)
    lookup.record(1, 0)
    assert (lookup.k, lookup.wants(), lookup.wants()) == (1, 1, 1)


# -- the configuration ---------------------------------------------------------------------------


def test_vllm_spellings_parse():
    spec = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 3, '
        '"prompt_lookup_max": 6}'
    )
    assert spec == SpeculativeConfig("ngram", 5, 3, 6)
    draft = parse_speculative_config({"model": "qwen2.5-coder:0.5b", "num_speculative_tokens": 4})
    assert draft.method == "draft_model" and draft.model == "qwen2.5-coder:0.5b"
    assert parse_speculative_config({"method": "[ngram]", "num_speculative_tokens": 2}).method == (
        "ngram"
    )
    assert parse_speculative_config(None) is None
    assert parse_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 6}
    ) == SpeculativeConfig("ngram", 2, 6, 6)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1]", "JSON object"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "not supported"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', r"\[1, 16\]"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}', "unknown key"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, '
            '"prompt_lookup_max": 3}',
            "larger than",
        ),
        ('{"num_speculative_tokens": 2}', "method"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "model"),
    ],
)
def test_bad_configs_are_refused_with_the_reason(value, message):
    with pytest.raises(ValueError, match=message):
        parse_speculative_config(value)


# -- planning, capping, rolling back -------------------------------------------------------------


def _scheduler(num_blocks=32, slots=4, *, k=4, batch=8, admission="partial", reserve=4, **kw):
    pool = BlockPool(num_blocks, 4)
    config = SchedulerConfig(max_num_seqs=slots, admission=admission, reserve_tokens=reserve, **kw)
    spec = SpeculativeConfig(num_speculative_tokens=k, disable_by_batch_size=batch)
    return Scheduler(config, KVManager(pool), 64, speculative=spec), pool


def _admitted(scheduler, name, prompt, max_tokens=20, speculate=True):
    seq = make_sequences(name, len(prompt), max_tokens, Prompt(tuple(prompt), speculate=speculate))[
        0
    ]
    assert scheduler.admit([seq])
    return seq


def _step(scheduler, tokens_for):
    """One planned step; `tokens_for(chunk)` is what each sampling chunk's sequence keeps."""
    plan = scheduler.schedule()
    sampled = {}
    for chunk in plan.chunks:
        if chunk.samples:
            sampled[chunk.request_id] = tokens_for(chunk)
    finished = scheduler.update_from_output(plan, sampled)
    for seq in finished:
        scheduler.release(seq.seq_id)
    return plan


PROMPT = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]


def test_a_decoding_sequence_verifies_guesses_and_keeps_the_accepted_prefix():
    scheduler, pool = _scheduler()
    seq = _admitted(scheduler, "a", PROMPT)
    _step(scheduler, lambda chunk: 4)  # the prompt's chunk samples "4"
    plan = _step(scheduler, lambda chunk: (*chunk.draft_token_ids[:2], 9))
    (chunk,) = plan.chunks
    # Prompt lookup on ... 1 2 3 4 finds "1 2 3 4" earlier, followed by 5 6 7 1.
    assert chunk.draft_token_ids == (5, 6, 7, 1)
    assert chunk.token_ids == (4, 5, 6, 7, 1) and chunk.num_tokens == 5 and chunk.samples
    assert seq.output_token_ids == [4, 5, 6, 9]
    assert seq.num_computed == seq.num_tokens - 1  # 4, 5, 6 computed; 9 is next
    assert seq.acceptance.num_accepted == 2 and seq.acceptance.k == 4
    # Only blocks for what was kept remain beyond the reservation: 13 positions computed.
    assert len(scheduler.kv.table("a")) == max(scheduler.kv.num_reserved("a"), 4)
    assert pool.check_whole()


def test_guesses_never_pass_the_budget_and_the_rollback_frees_emptied_blocks():
    scheduler, pool = _scheduler(reserve=1)
    seq = _admitted(scheduler, "a", PROMPT, max_tokens=4)
    _step(scheduler, lambda chunk: 4)
    reserved = scheduler.kv.num_reserved("a")
    plan = _step(scheduler, lambda chunk: (99,))  # every guess rejected
    # 3 tokens left: at most 2 guesses, so the bonus token still fits the budget.
    assert plan.chunks[0].draft_token_ids == (5, 6)
    assert len(scheduler.kv.table("a")) == max(reserved, pool.blocks_for(seq.num_computed))
    assert seq.acceptance.k == 2  # halved
    while not seq.is_finished:
        remaining = seq.num_remaining
        plan = _step(
            scheduler,
            lambda chunk: (*chunk.draft_token_ids, 8) if chunk.is_speculative else 8,
        )
        assert len(plan.chunks[0].draft_token_ids) <= remaining - 1
    assert seq.num_output == 4
    assert pool.num_free == pool.num_blocks and pool.check_whole()


def test_a_stop_token_inside_the_kept_tokens_ends_the_sequence_there():
    scheduler, pool = _scheduler()
    seq = make_sequences(
        "a", len(PROMPT), 20, Prompt(tuple(PROMPT)), stop_token_ids=frozenset({6})
    )[0]
    assert scheduler.admit([seq])
    _step(scheduler, lambda chunk: 4)
    _step(scheduler, lambda chunk: (*chunk.draft_token_ids, 0))  # all accepted: 5 6 7 1 0
    assert seq.output_token_ids == [4, 5, 6] and seq.finish_reason == "stop"
    assert pool.num_free == pool.num_blocks


def test_nobody_speculates_in_a_large_batch_or_after_opting_out():
    scheduler, _ = _scheduler(slots=4, batch=2)
    for name in "abc":
        _admitted(scheduler, name, PROMPT)
    _step(scheduler, lambda chunk: 4)
    plan = _step(scheduler, lambda chunk: 5 if not chunk.draft_token_ids else (5,))
    assert plan.num_draft_rows == 0  # three decoding sequences, more than 2
    scheduler.release("c")
    plan = _step(scheduler, lambda chunk: (*chunk.draft_token_ids, 0))
    assert plan.num_draft_rows > 0
    opted, _ = _scheduler()
    _admitted(opted, "x", PROMPT, speculate=False)
    _step(opted, lambda chunk: 4)
    assert _step(opted, lambda chunk: 5).num_draft_rows == 0


def test_guesses_take_only_free_blocks_never_preempting():
    # 6 blocks of 4: "old" holds 4 after admission and its first token, "young" 2.
    scheduler, pool = _scheduler(num_blocks=6, slots=2, reserve=1)
    old = _admitted(scheduler, "old", [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 9, 9])
    young = _admitted(scheduler, "young", [1, 2, 3, 1, 2])
    _step(scheduler, lambda chunk: 4 if chunk.request_id == "old" else 3)
    assert pool.num_free == 0
    plan = _step(
        scheduler, lambda chunk: (*chunk.draft_token_ids, 0) if chunk.is_speculative else 0
    )
    assert not plan.preempted_ids and young.status.value == "running"
    assert old.num_output == 2
    # Old's next row fits its last block, its guesses only what that block has left.
    for chunk in plan.chunks:
        end = chunk.start + chunk.num_tokens
        assert end <= len(chunk.block_ids) * 4
    assert pool.check_whole()


@pytest.mark.parametrize("returned", [0, 1])
def test_blocks_grown_for_a_batch_proposers_missing_guesses_go_back_at_once(returned):
    """A batch proposer (the draft model) gets each sequence's blocks grown for every guess it
    may make before it is called; guesses that do not come back (cut by a grammar, the draft's
    context, a failed draft) give those blocks back in the same planning, so the step holds
    only what it computes."""
    pool = BlockPool(32, 4)
    config = SchedulerConfig(max_num_seqs=2, reserve_tokens=1)
    spec = SpeculativeConfig(num_speculative_tokens=4)
    asked = []

    def propose(wanting):
        asked.extend(limit for _, limit in wanting)
        return [(7,) * returned for _ in wanting]

    scheduler = Scheduler(config, KVManager(pool), 64, speculative=spec, batch_proposer=propose)
    seq = _admitted(scheduler, "a", [1, 2, 3, 4, 5, 6, 7])  # 7 positions: the 2nd block's 3rd
    _step(scheduler, lambda chunk: 4)
    plan = scheduler.schedule()
    (chunk,) = plan.chunks
    assert asked == [4] and chunk.draft_token_ids == (7,) * returned
    assert len(scheduler.kv.table("a")) == max(
        scheduler.kv.num_reserved("a"), pool.blocks_for(chunk.start + chunk.num_tokens)
    )
    scheduler.update_from_output(plan, {"a": (*chunk.draft_token_ids, 9) if returned else 9})
    assert seq.num_computed == chunk.start + chunk.num_tokens
    scheduler.release("a")
    assert pool.num_free == pool.num_blocks and pool.check_whole()


def test_counts_only_updates_treat_a_speculative_chunk_as_one_token():
    scheduler, pool = _scheduler()
    seq = _admitted(scheduler, "a", PROMPT)
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, {"a": 4})
    plan = scheduler.schedule()
    assert plan.chunks[0].is_speculative
    scheduler.update(plan)
    assert seq.num_output == 2 and seq.num_computed == seq.num_tokens - 1
    assert pool.check_whole()


# -- whether speculation pays (measured) -----------------------------------------------------------


def _run_payoff(payoff, batch, steps, seconds_on, seconds_off, tokens_on=3, rests=0):
    """`steps` decisions at `batch`, each step observed with the given costs; the choices. With
    `rests`, every `rests`-th step allowed to guess finds nothing to guess (a plain step)."""
    choices = []
    for step in range(steps):
        on = payoff.speculates(batch)
        choices.append(on)
        if on and not (rests and step % rests == 0):
            payoff.observe(batch, True, tokens_on, seconds_on)
        else:
            payoff.observe(batch, False, 1, seconds_off)
    return choices


WARM = 2 * WARMUP_STEPS  # the warm-up: guessing steps, then plain ones


def test_payoff_measures_both_kinds_then_takes_the_faster_and_probes_the_other():
    payoff = Payoff()
    # Speculating gives 3 tokens in 0.05 s (60 a second), plain 1 in 0.02 s (50 a second).
    choices = _run_payoff(payoff, 1, WARM + 3 * PROBE_PERIOD + 2 * PROBE_STEPS, 0.05, 0.02)
    assert choices[:WARM] == [True] * WARMUP_STEPS + [False] * WARMUP_STEPS
    # Probes that change nothing come half as often each time.
    assert choices[WARM:] == (
        [True] * PROBE_PERIOD
        + [False] * PROBE_STEPS
        + [True] * 2 * PROBE_PERIOD
        + [False] * PROBE_STEPS
    )
    on, off = payoff.rates(1)
    assert on == pytest.approx(60.0) and off == pytest.approx(50.0)

    # Where speculation is slower (3 tokens in 0.07 s: 43 a second), plain decoding is kept,
    # with a speculating probe now and then; another batch size is measured on its own.
    slower = Payoff()
    # (a probe comes PROBE_PERIOD decisions after the kind was last measured: the first one
    # counts from the warm-up's guessing steps)
    first = PROBE_PERIOD - WARMUP_STEPS
    choices = _run_payoff(slower, 1, WARM + first + PROBE_STEPS, 0.07, 0.02)
    assert choices[WARM:] == [False] * first + [True] * PROBE_STEPS
    assert slower.rates(2) == (0.0, 0.0)
    assert slower.speculates(2)


def test_plain_steps_that_come_by_themselves_spare_the_probes():
    """A step allowed to guess that has nothing to guess is a plain step, and is measured as
    one: while they come, speculation needs no plain probe."""
    payoff = Payoff()
    choices = _run_payoff(payoff, 1, WARM + 3 * PROBE_PERIOD, 0.05, 0.02, rests=5)
    assert all(choices[WARM:])
    assert payoff.rates(1) == (pytest.approx(60.0), pytest.approx(50.0))


def test_payoff_does_not_alternate_between_kinds_about_as_fast():
    """Within MARGIN of each other the kinds stay as they are (a draft model pays to catch up
    after each pause), and speculation must be faster by MARGIN to be taken at all."""
    payoff = Payoff()
    # 3 tokens in 0.0588 s: 51 a second against plain decoding's 50.
    assert 1 + MARGIN > 51 / 50
    first = PROBE_PERIOD - WARMUP_STEPS
    choices = _run_payoff(payoff, 1, WARM + first + PROBE_STEPS + 2 * PROBE_PERIOD, 0.0588, 0.02)
    assert choices[WARM:] == [False] * first + [True] * PROBE_STEPS + [False] * 2 * PROBE_PERIOD


def test_payoff_follows_a_change_of_costs_through_its_probes():
    payoff = Payoff()
    _run_payoff(payoff, 1, WARM, 0.05, 0.02)  # speculation pays
    # Now the guesses fail: one token a speculating step, 0.05 s (20 a second, plain 50).
    choices = _run_payoff(payoff, 1, 200, 0.05, 0.02, tokens_on=1)
    # A few speculating steps show the change; then the probes start again from the shortest
    # period.
    first = choices.index(False)
    assert first <= 5
    assert choices[first:] == (
        [False] * PROBE_PERIOD
        + [True] * PROBE_STEPS
        + [False] * 2 * PROBE_PERIOD
        + [True] * PROBE_STEPS
        + [False] * (200 - first - 3 * PROBE_PERIOD - 2 * PROBE_STEPS)
    )
    assert MAX_PROBE_PERIOD >= 2 * PROBE_PERIOD


def test_payoff_ignores_empty_steps_and_sizes_it_was_not_asked_about():
    payoff = Payoff()
    payoff.observe(1, True, 3, 0.05)  # no decision at this size yet
    assert payoff.rates(1) == (0.0, 0.0)
    assert payoff.speculates(1)
    payoff.observe(1, True, 0, 0.05)  # no tokens
    payoff.observe(1, False, 1, 0.0)  # no time
    assert payoff.rates(1) == (0.0, 0.0)
    payoff.observe(1, True, 3, 0.05)
    assert payoff.rates(1) == (pytest.approx(60.0), 0.0)


def _timed_step(scheduler, tokens_for, seconds_for):
    """`_step`, then the wall time `seconds_for(plan)` reported as the engine does."""
    plan = _step(scheduler, tokens_for)
    scheduler.observe_step(plan, seconds_for(plan))
    return plan


def test_the_scheduler_stops_speculating_where_its_steps_measure_slower():
    """With `disable_when_slower` (the default) the scheduler measures the steps of decoding
    rows only, as the engine reports them, and plans the faster kind: here a speculating step
    keeps all its guesses (5 tokens) but costs 10x a plain step, so after the warm-up only the
    probes guess."""

    def run(scheduler, steps):
        seq = _admitted(scheduler, "a", [1, 2, 3, 4, 5, 6, 7] * 4, max_tokens=400)

        def follow(chunk):  # the target agrees with every guess and goes on as prompt lookup
            tokens = list(seq.all_token_ids) + list(chunk.draft_token_ids)
            token = propose_ngram(tokens, 1, 1, 4)[0]
            return (*chunk.draft_token_ids, token) if chunk.is_speculative else token

        def cost(plan):
            return 0.2 if any(chunk.is_speculative for chunk in plan.chunks) else 0.02

        first = _timed_step(scheduler, follow, cost)  # the prompt: not measured
        assert first.chunks[0].is_prefill
        plans = [_timed_step(scheduler, follow, cost) for _ in range(steps)]
        return [plan.chunks[0].is_speculative for plan in plans]

    def scheduler_with(spec):
        pool = BlockPool(128, 4)
        return Scheduler(SchedulerConfig(max_num_seqs=2), KVManager(pool), 512, speculative=spec)

    scheduler = scheduler_with(SpeculativeConfig(num_speculative_tokens=4))
    assert scheduler.payoff is not None
    speculating = run(scheduler, WARM + 20)
    assert speculating[:WARMUP_STEPS] == [True] * WARMUP_STEPS
    assert not any(speculating[WARMUP_STEPS:])
    on, off = scheduler.payoff.rates(1)
    assert on == pytest.approx(25.0) and off == pytest.approx(50.0)

    # Without the rule the same costs do not matter: every step guesses.
    plain = scheduler_with(SpeculativeConfig(num_speculative_tokens=4, disable_when_slower=False))
    assert plain.payoff is None
    assert all(run(plain, 12))


def test_disable_when_slower_is_read_and_checked():
    assert SpeculativeConfig().disable_when_slower
    spec = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 2, "disable_when_slower": false}'
    )
    assert not spec.disable_when_slower
    assert "measured slower" not in spec.describe()
    assert "measured slower" in SpeculativeConfig().describe()
    with pytest.raises(ValueError, match="disable_when_slower"):
        SpeculativeConfig(disable_when_slower="no")
