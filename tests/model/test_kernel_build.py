"""The kernels' build: each symbol declared once on the Python side and held to its C header,
families compiled apart (a broken file disables only its families), an unwritable cache
directory and a missing compiler degrade with one clear line, and the model still serves."""

from __future__ import annotations

import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvserve.config import DeviceConfig
from kvserve.model import kernel_build
from kvserve.model.kernel_build import CSRC, FAMILIES, Family, Symbol
from kvserve.model.kernels import CpuKernels, kernels_from
from kvserve.model.loader import load_model
from tests.model.helpers import greedy_continuation

C_TYPES = {"int64_t": "i64", "int": "i32", "float": "f32"}


def header_prototypes(text: str) -> dict[str, tuple[str | None, tuple[tuple[str, str], ...]]]:
    """The exported prototypes of a C header: name -> (result, ((argument, type), ...)), types
    as the declarations' short names (any pointer "p")."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    text = re.sub(r"^\s*#(?:[^\n]*\\\n)*[^\n]*", " ", text, flags=re.M)  # directives, macros
    found = {}
    pattern = r"([A-Za-z_][\w\s]*?\**)\s*\b(kvserve_\w+)\s*\(([^;{]*?)\)\s*;"
    for result, name, args in re.findall(pattern, text):
        kind = _kind(result)
        params = []
        for arg in args.split(","):
            arg = " ".join(arg.split())
            if arg in ("", "void"):
                continue
            match = re.fullmatch(r"(.*?)(\w+)", arg)
            params.append((match.group(2), _kind(match.group(1))))
        found[name] = (kind, tuple(params))
    return found


def _kind(c_type: str) -> str | None:
    c_type = " ".join(c_type.replace("const", " ").split())
    if "*" in c_type:
        return "p"
    if c_type == "void":
        return None
    return C_TYPES[c_type]


def mismatches(family: Family, header: str) -> list[str]:
    """How a family's declarations disagree with its header (empty: they agree)."""
    prototypes = header_prototypes(header)
    problems = []
    for symbol in family.symbols:
        if symbol.name not in prototypes:
            problems.append(f"{symbol.name} is not in {family.header}")
            continue
        result, args = prototypes[symbol.name]
        if result != symbol.result:
            problems.append(f"{symbol.name} returns {result}, declared {symbol.result}")
        if len(args) != len(symbol.args):
            problems.append(
                f"{symbol.name} takes {len(args)} arguments, declared {len(symbol.args)}"
            )
        for index, (header_arg, declared) in enumerate(zip(args, symbol.args, strict=False)):
            if header_arg != declared:
                problems.append(f"{symbol.name} argument {index}: {header_arg} != {declared}")
    return problems


def test_every_declaration_agrees_with_its_header_and_every_export_is_declared():
    headers: dict[str, set[str]] = {}
    for family in FAMILIES:
        text = (CSRC / family.header).read_text()
        assert mismatches(family, text) == [], family.name
        headers.setdefault(family.header, set()).update(s.name for s in family.symbols)
    for header, declared in headers.items():
        exported = set(header_prototypes((CSRC / header).read_text()))
        assert exported == declared, f"{header}: undeclared {sorted(exported - declared)}"
    assert len(header_prototypes((CSRC / "quant_ops.h").read_text())) == 10


def test_a_changed_argument_type_is_caught():
    """Change one argument's type, on either side: the check names the symbol and argument."""
    family = next(f for f in FAMILIES if f.name == "int8_gemm")
    header = (CSRC / family.header).read_text()
    gemm = next(s for s in family.symbols if s.name == "kvserve_int8_gemm")
    args = list(gemm.args)
    args[1] = ("rows", "i32")  # int64_t rows declared as an int
    changed = replace(family, symbols=(replace(gemm, args=tuple(args)),))
    assert mismatches(changed, header) == [
        "kvserve_int8_gemm argument 1: ('rows', 'i64') != ('rows', 'i32')"
    ]
    edited = header.replace("int64_t rows, int64_t k", "int rows, int64_t k")
    assert edited != header
    assert mismatches(family, edited) == [
        "kvserve_int8_gemm argument 1: ('rows', 'i32') != ('rows', 'i64')"
    ]
    swapped = header.replace("const int8_t *packed", "int64_t packed")
    assert "argument 3" in mismatches(family, swapped)[0]


def test_declarations_bind_ctypes_types():
    symbol = Symbol.of("kvserve_x", "i32", "a:p rows:i64 scale:f32 threads:i32")
    assert symbol.args == (("a", "p"), ("rows", "i64"), ("scale", "f32"), ("threads", "i32"))


@pytest.fixture(scope="module")
def broken_kernels(tmp_path_factory):
    """The kernels built from a copy of the sources whose int8 product does not compile."""
    root = tmp_path_factory.mktemp("broken")
    csrc = root / "csrc"
    shutil.copytree(CSRC, csrc)
    source = csrc / "int8_gemm.c"
    source.write_text(source.read_text() + "\nthis is not C;\n")
    return kernels_from(csrc, root / "objects")


def test_a_source_that_fails_to_compile_disables_only_its_families(broken_kernels):
    kernels = broken_kernels
    assert set(kernels.failures) == {"int8_gemm", "int8_driver"}
    assert "compiling int8_gemm.c failed" in kernels.failures["int8_gemm"]
    assert "needs int8_gemm" in kernels.failures["int8_driver"]
    assert kernels.has("layer_ops", "attention", "quant_ops", "f32_gemm", "bitmask", "q4_driver")
    assert kernels.int8_gemm_isa is None
    assert "not built: int8_gemm" in kernels.describe()


def test_the_other_families_still_serve(broken_kernels):
    """auto then keeps the float path (no int8 product here), on the C attention and layer ops,
    and the model answers."""
    loaded = load_model(None, DeviceConfig(device="cpu", weight_cache=False), broken_kernels)
    assert loaded.model.quantization == "none"
    assert loaded.model.attention.name == "cpu-paged"
    assert "int8 product kernel does not run" in loaded.quantization_reason
    ids = loaded.tokenizer.encode_chat(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    assert "Paris" in loaded.tokenizer.decode(greedy_continuation(loaded.model, ids, 12))


def test_an_unwritable_cache_directory_falls_back_to_a_temporary_one(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    directory, warning = kernel_build.writable_directory(blocker / "kernels")
    assert directory is not None and directory.exists()
    assert not str(directory).startswith(str(blocker))
    assert "cannot be written" in warning and str(blocker / "kernels") in warning
    assert kernel_build.writable_directory(tmp_path / "fine") == (tmp_path / "fine", None)


def test_the_block_products_prefetch_as_the_vendors_cores_measured(monkeypatch):
    """prefetchnta on AMD's cores, prefetcht0 elsewhere (csrc/blocks_gemm.c): the flags say
    which, and they are part of every object's key."""
    monkeypatch.setattr(kernel_build, "cpu_vendor", lambda: "AuthenticAMD")
    amd = kernel_build.compile_flags()
    monkeypatch.setattr(kernel_build, "cpu_vendor", lambda: "GenuineIntel")
    intel = kernel_build.compile_flags()
    assert "-DKVSERVE_PREFETCH_NTA" in amd and "-DKVSERVE_PREFETCH_NTA" not in intel
    assert set(kernel_build.FLAGS) <= set(intel) and set(kernel_build.FLAGS) <= set(amd)
    monkeypatch.undo()
    with open("/proc/cpuinfo") as cpuinfo:
        vendors = {line.split(":")[1].strip() for line in cpuinfo if line.startswith("vendor_id")}
    assert vendors == {kernel_build.cpu_vendor()}


def test_amx_int8_is_asked_for_where_the_cpu_lists_it(monkeypatch):
    """-mamx-tile -mamx-int8 (the block product's many-row path) exactly where /proc/cpuinfo
    has both flags; part of every object's key like the other flags."""
    for flags, expected in (
        ({"avx512f", "amx_tile", "amx_int8", "amx_bf16"}, True),
        ({"avx512f", "amx_tile", "amx_bf16"}, False),
        ({"avx2"}, False),
        (set(), False),
    ):
        monkeypatch.setattr(kernel_build, "cpu_flags", lambda flags=flags: frozenset(flags))
        chosen = kernel_build.compile_flags()
        assert (set(kernel_build.AMX_FLAGS) <= set(chosen)) == expected, flags
        assert set(kernel_build.FLAGS) <= set(chosen)
    monkeypatch.undo()
    assert (kernel_build.AMX_FLAGS[0] in kernel_build.compile_flags()) == kernel_build.cpu_has_amx()


def test_no_compiler_builds_nothing_and_says_what_it_costs(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert kernel_build.find_compiler() is None
    result = kernel_build.build(directory=tmp_path / "objects")
    assert not result.libraries
    assert set(result.failures) == {f.name for f in FAMILIES}
    kernels = CpuKernels(result.libraries, result.failures)
    line = kernels.describe()
    assert line.startswith("CPU kernels: none (no C compiler") and "slower" in line
    assert not kernels.supports(torch.device("cpu"), torch.float32, 9, 3, 64)


def test_a_model_without_kernels_runs_the_torch_path(loaded_fp32_torch_ops):
    loaded = loaded_fp32_torch_ops
    assert loaded.model.attention.name == "torch-sdpa" and loaded.model.driver is None
    assert loaded.describe_kernels().startswith("CPU kernels: none (kernels left out")
    ids = loaded.tokenizer.encode_chat(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    assert "Paris" in loaded.tokenizer.decode(greedy_continuation(loaded.model, ids, 12))


def test_families_build_into_one_shared_object_each(kernels):
    assert kernels.directory is not None
    names = [p.name for p in Path(kernels.directory).glob("*.so")]
    for family in FAMILIES:
        assert any(re.fullmatch(rf"{family.name}-[0-9a-f]{{16}}\.so", n) for n in names), family
