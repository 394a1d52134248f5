"""`kvserve list`: the catalogue models present here, with their sizes and paths."""

from __future__ import annotations

import argparse
import datetime

from kvserve import hub


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--all",
        action="store_true",
        help="every catalogue entry, pulled or not (with the size it would take)",
    )


def run(args: argparse.Namespace) -> int:
    found = {model.entry.name: model for model in hub.list_present()}
    rows = [("NAME", "SIZE", "MODIFIED", "PATH")]
    for entry in hub.entries():
        model = found.get(entry.name)
        if model is not None:
            modified = datetime.datetime.fromtimestamp(model.modified).strftime("%Y-%m-%d %H:%M")
            where = f"{model.path}{' (installed package)' if model.installed else ''}"
            rows.append((entry.name, hub.format_size(model.size), modified, where))
        elif args.all:
            rows.append((entry.name, hub.format_size(entry.size), "-", "not pulled"))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False))
            + "  "
            + row[3]
        )
    if len(rows) == 1:
        print(
            f"(no model pulled yet into {hub.models_dir()}; `kvserve list --all` shows the catalogue)"
        )
    return 0
