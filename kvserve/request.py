"""What a caller hands the engine, and the error classes every layer maps to one HTTP status."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from kvserve.params import SamplingParams

_ids = itertools.count()


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{next(_ids)}-{time.monotonic_ns() & 0xFFFFFF:06x}"


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One generation: prompt token ids and how to sample. `max_tokens` None = rest of context.

    `cache_salt` isolates a tenant in the prefix cache: requests with different salts never
    share a KV block; without one, requests share by default.
    """

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=new_request_id)
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether every prompt row must be computed for its logits (prompt log-probabilities
        were asked for): such a prompt's KV may not be taken from a cache in place of them."""
        return self.params.prompt_logprobs is not None


class EngineError(Exception):
    """Base of every error the engine reports about a request."""

    status = 500
    error_type = "server_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(EngineError):
    """The request itself is wrong (bad parameter, could never fit): 400."""

    status = 400
    error_type = "invalid_request_error"


class Overloaded(EngineError):
    """Refused for load, not for content: 429 with Retry-After."""

    status = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, reason: str, retry_after: float) -> None:
        super().__init__(message)
        self.reason = reason  # "queue_full" | "queue_timeout"
        self.retry_after = retry_after


class QueueFull(Overloaded):
    def __init__(self, retry_after: float) -> None:
        super().__init__(
            "the server is at capacity and its admission queue is full; retry later",
            "queue_full",
            retry_after,
        )


class QueueTimeout(Overloaded):
    def __init__(self, retry_after: float) -> None:
        super().__init__(
            f"the request waited {retry_after:g} s for capacity without being admitted; retry later",
            "queue_timeout",
            retry_after,
        )


class RequestCancelled(EngineError):
    """The client went away (499: logged, no body)."""

    status = 499
    error_type = "client_closed_request"


class EngineStopped(EngineError):
    """The engine is shutting down or failed; the request cannot be served."""

    status = 503
    error_type = "server_error"
