"""The scheduling simulator: the real `core/` Scheduler and BlockPool driven by a simulated step.

No model and no torch: a step "computes" whatever the StepPlan says. See `simulator` for the
loop and the default workload, `policies` for the two policies shown beside the engine's,
`figure` for the HTML page and the PNG, `cli` for `kvserve simulate`.
"""

from kvserve.sim.simulator import (
    CONTINUOUS_RESERVE,
    CONTINUOUS_SLOT_ONLY,
    DEFAULT_WORKLOAD,
    PARTIAL_PREEMPT,
    PREFIX_CACHING,
    REQUEST_LEVEL,
    SCENARIOS,
    Frame,
    RequestOutcome,
    RequestSpec,
    RowView,
    Scenario,
    SimulationResult,
    SlotView,
    Workload,
    format_table,
    load_workload,
    prompt_token_ids,
    scenario_by_name,
    simulate,
    simulate_all,
)

__all__ = [
    "CONTINUOUS_RESERVE",
    "CONTINUOUS_SLOT_ONLY",
    "DEFAULT_WORKLOAD",
    "PARTIAL_PREEMPT",
    "PREFIX_CACHING",
    "REQUEST_LEVEL",
    "SCENARIOS",
    "Frame",
    "RequestOutcome",
    "RequestSpec",
    "RowView",
    "Scenario",
    "SimulationResult",
    "SlotView",
    "Workload",
    "format_table",
    "load_workload",
    "prompt_token_ids",
    "scenario_by_name",
    "simulate",
    "simulate_all",
]
