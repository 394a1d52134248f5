"""`kvserve simulate`: run the scheduling simulator and print, draw or save what it did.

kvserve simulate                         # every scenario's table
kvserve simulate --html simulator.html   # plus the interactive page
kvserve simulate --png simulator.png     # plus the static overview
kvserve simulate --print-workload > w.json; kvserve simulate --workload w.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from kvserve.sim.simulator import (
    DEFAULT_WORKLOAD,
    SCENARIOS,
    Workload,
    format_table,
    load_workload,
    scenario_by_name,
    simulate,
)

# Flag -> Workload field; the names are the server's flags for the same quantities.
WORKLOAD_FLAGS = {
    "max_num_seqs": "num_slots",
    "num_kv_blocks": "num_blocks",
    "block_size": "block_size",
    "prefill_chunk": "prefill_chunk",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "reserve_tokens": "reserve_tokens",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The simulator's flags; unset engine flags keep the workload's values."""
    parser.add_argument(
        "--workload",
        metavar="FILE",
        help="a JSON workload (see --print-workload for the format; default: the built-in one)",
    )
    parser.add_argument(
        "--scenario",
        action="append",
        choices=[scenario.name for scenario in SCENARIOS],
        help="run only this scenario (repeatable; default: all of them)",
    )
    group = parser.add_argument_group("engine constants (override the workload's)")
    group.add_argument("--max-num-seqs", type=int, metavar="N", help="slots")
    group.add_argument("--num-kv-blocks", type=int, metavar="N", help="blocks in the KV pool")
    group.add_argument("--block-size", type=int, metavar="N", help="token positions per block")
    group.add_argument(
        "--prefill-chunk", type=int, metavar="N", help="prompt tokens per sequence per step"
    )
    group.add_argument("--max-num-batched-tokens", type=int, metavar="N", help="rows per step")
    group.add_argument(
        "--reserve-tokens",
        type=int,
        metavar="N",
        help="answer positions reserved at admission under partial reservation",
    )
    group = parser.add_argument_group("output")
    group.add_argument("--html", metavar="FILE", help="write the interactive page here")
    group.add_argument("--png", metavar="FILE", help="write the static overview here")
    group.add_argument(
        "--print-workload",
        action="store_true",
        help="print the workload (after overrides) as JSON and exit",
    )
    group.add_argument("--quiet", action="store_true", help="do not print the tables")


def build_workload(args: argparse.Namespace) -> Workload:
    """The workload file (or the default) with the engine-constant flags applied."""
    workload = DEFAULT_WORKLOAD if args.workload is None else load_workload(args.workload)
    overrides = {
        field: getattr(args, flag)
        for flag, field in WORKLOAD_FLAGS.items()
        if getattr(args, flag, None) is not None
    }
    return replace(workload, **overrides) if overrides else workload


def run(args: argparse.Namespace) -> int:
    """Simulate, print the tables and write the requested files; 0, or 2 for a bad workload."""
    try:
        workload = build_workload(args)
    except (OSError, ValueError, TypeError) as error:
        print(f"kvserve simulate: {error}", file=sys.stderr)
        return 2
    if args.print_workload:
        print(json.dumps(workload.to_dict(), indent=2))
        return 0
    names = args.scenario or [scenario.name for scenario in SCENARIOS]
    scenarios = [scenario_by_name(name) for name in dict.fromkeys(names)]
    results = [simulate(workload, scenario) for scenario in scenarios]
    if not args.quiet:
        print("\n\n".join(format_table(result) for result in results))
    if args.html or args.png:
        from kvserve.sim import figure

        if args.html:
            print(f"wrote {figure.write_html(args.html, results)}")
        if args.png:
            print(f"wrote {figure.write_png(args.png, results)}")
    return 0
