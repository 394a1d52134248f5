"""The models directory: where pulled models are stored, and which are present.

Layout (`$KVSERVE_MODELS`, default `<user cache dir>/models`):

    qwen2.5-coder/1.5b/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf    a file entry
    all-minilm/22m/config.json, model.safetensors, ...             a directory entry
    .partial/qwen2.5-coder-1.5b/                                   a pull in progress
    .partial/qwen2.5-coder-1.5b.lock                               held while it runs

A model's path appears only once its bytes were verified (pulled under `.partial/`, renamed
into place), so whatever is found at an entry's location is the pinned model.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path

from kvserve.hub.catalogue import Entry, entries
from kvserve.model.paths import user_cache_dir

MODELS_ENV = "KVSERVE_MODELS"


class NotPulledError(FileNotFoundError):
    """A catalogue model asked for by name that is not in the models directory yet."""

    def __init__(self, entry: Entry) -> None:
        self.entry = entry
        super().__init__(
            f"model {entry.name!r} is not pulled yet: run `kvserve pull {entry.name}` "
            f"({format_size(entry.size)}) first, or give `kvserve serve` / `kvserve generate` "
            f"--pull to pull it before loading"
        )


def models_dir() -> Path:
    """`$KVSERVE_MODELS`, else `<user cache dir>/models` (see paths.user_cache_dir)."""
    configured = os.environ.get(MODELS_ENV)
    return Path(configured).expanduser() if configured else user_cache_dir() / "models"


def location(entry: Entry, models: Path | None = None) -> Path:
    """Where `entry` is stored in the models directory (present or not)."""
    base = (models or models_dir()) / entry.family / entry.tag
    return base if entry.is_directory else base / entry.filename


def staging_dir(entry: Entry, models: Path | None = None) -> Path:
    """Where a pull of `entry` keeps its state and partial bytes until they are verified."""
    slug = f"{entry.family}-{entry.tag}".replace("/", "_")
    return (models or models_dir()) / ".partial" / slug


def installed_file(entry: Entry) -> Path | None:
    """The entry's file inside its installed distribution (`entry.installed_dist`), found
    through the distribution's file list so its package is never imported; None when the
    distribution is not installed or holds no such file."""
    if entry.installed_dist is None:
        return None
    try:
        files = importlib.metadata.files(entry.installed_dist) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name == entry.filename:
            path = Path(file.locate()).resolve()
            if path.is_file():
                return path
    return None


def present(entry: Entry, models: Path | None = None) -> Path | None:
    """The path of `entry` when it is here (installed with its distribution, or pulled),
    else None."""
    installed = installed_file(entry)
    if installed is not None:
        return installed
    path = location(entry, models)
    if entry.is_directory:
        return path if path.is_dir() else None
    return path if path.is_file() else None


@dataclass(frozen=True, slots=True)
class PresentModel:
    """A catalogue model found here, for `kvserve list`."""

    entry: Entry
    path: Path
    size: int  # bytes on disk (a directory: its files together)
    modified: float  # st_mtime
    installed: bool  # inside an installed distribution rather than the models directory


def disk_size(path: Path) -> int:
    """Bytes of a file, or of every file under a directory."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def list_present(models: Path | None = None) -> list[PresentModel]:
    """The catalogue's models present here, in catalogue order."""
    found = []
    for entry in entries():
        path = present(entry, models)
        if path is None:
            continue
        found.append(
            PresentModel(
                entry,
                path,
                disk_size(path),
                path.stat().st_mtime,
                installed=installed_file(entry) == path,
            )
        )
    return found


def format_size(num_bytes: int) -> str:
    """Decimal units, as `ollama list` prints them: 98 MB, 1.1 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if num_bytes >= scale:
            value = num_bytes / scale
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{num_bytes} B"
