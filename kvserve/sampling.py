"""Sampling parameters and the sampler, under their former module name.

The parameters live in `kvserve.params` (no torch), the batched sampler in
`kvserve.engine.sampler`; import from there.
"""

from kvserve.engine.sampler import RowState, SampleOutput, Sampler, make_generator
from kvserve.params import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRINGS,
    SamplingParams,
    SamplingParamsError,
)

__all__ = [
    "MAX_LOGIT_BIAS_ENTRIES",
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_STOP_STRINGS",
    "RowState",
    "SampleOutput",
    "Sampler",
    "SamplingParams",
    "SamplingParamsError",
    "make_generator",
]
