"""Build schedulers and admit requests by counts in policy tests: no model, integers only."""

from __future__ import annotations

from kvserve.config import SchedulerConfig
from kvserve.core import (
    BlockPool,
    KVManager,
    Prompt,
    Scheduler,
    Sequence,
    StepPlan,
    make_sequences,
)


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 64,
    caching: bool = False,
    policy: type[Scheduler] = Scheduler,
    window: int | None = None,
    **config: object,
) -> Scheduler:
    """`window`: the sliding window of a model whose every layer is windowed (None: none)."""
    pool = BlockPool(num_blocks, block_size, prefix_caching=caching)
    return policy(SchedulerConfig(**config), KVManager(pool, window=window), max_model_len)


def sequences(
    request_id: str,
    num_prompt_tokens: int,
    max_tokens: int,
    arrival: int = 0,
    prompt: Prompt | None = None,
) -> list[Sequence]:
    return make_sequences(request_id, num_prompt_tokens, max_tokens, prompt, arrival=arrival)


def admit(
    scheduler: Scheduler,
    request_id: str,
    num_prompt_tokens: int,
    max_tokens: int,
    arrival: int = 0,
    prompt: Prompt | None = None,
) -> Sequence | None:
    """Admit a request's sequences; its first sequence, or None when it does not fit."""
    seqs = sequences(request_id, num_prompt_tokens, max_tokens, arrival, prompt)
    return seqs[0] if scheduler.admit(seqs) else None


def can_admit(
    scheduler: Scheduler, num_prompt_tokens: int, max_tokens: int, prompt: Prompt | None = None
) -> bool:
    return scheduler.can_admit(sequences("probe", num_prompt_tokens, max_tokens, prompt=prompt))


def run(scheduler: Scheduler, token: int | None = 7) -> StepPlan:
    """One step where every chunk runs and every sampled sequence gets `token` (None: counts
    only). Finished sequences stay until the caller releases them."""
    plan = scheduler.schedule()
    if token is None:
        scheduler.update(plan)
    else:
        sampled = {seq_id: token for chunk in plan.chunks for seq_id in chunk.sampler_ids}
        scheduler.update_from_output(plan, sampled)
    return plan


def release_finished(scheduler: Scheduler) -> list[str]:
    done = [seq.seq_id for seq in scheduler.running if seq.is_finished]
    for seq_id in done:
        scheduler.release(seq_id)
    return done
