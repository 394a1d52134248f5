"""The GGUF header parser (kvserve/model/gguf.py) against ggml-org's `gguf.GGUFReader`."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from kvserve.model.gguf import GGUFFormatError, dequantize_tensor, read_header


def test_the_header_matches_gguf_reader(model_path):
    header = read_header(model_path)
    reader = GGUFReader(model_path)
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert header.fields == expected
    assert len(header.fields["tokenizer.ggml.tokens"]) == 49152
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(header.tensors, reader.tensors, strict=True):
        assert ours.tensor_type == theirs.tensor_type
        assert ours.shape.tolist() == theirs.shape.tolist()
        assert ours.data_offset == theirs.data_offset
        assert np.array_equal(
            np.asarray(ours.data).view(np.uint8).ravel(),
            np.asarray(theirs.data).view(np.uint8).ravel(),
        )
    for index in (0, 1, len(header.tensors) - 1):
        assert dequantize_tensor(header.tensors[index]).equal(
            dequantize_tensor(reader.tensors[index])
        )


@pytest.mark.parametrize("keep", [0, 3, 24, 4096, "most"])
def test_a_truncated_or_foreign_file_is_refused(model_path, tmp_path, keep):
    data = model_path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000 if keep == "most" else keep])
    with pytest.raises(GGUFFormatError):
        read_header(cut)


def test_string_arrays_are_read_across_the_copied_stretches(tmp_path):
    """Strings are decoded from bytes copies of the file's next stretch: strings longer than a
    stretch, many empty ones, multi-byte characters, and a string or a length cut off by the
    end of the file (refused), all as `gguf.GGUFWriter` writes them and `GGUFReader` reads
    them."""
    from gguf import GGUFWriter

    arrays = {
        "test.short": ["a", "bc", "Ġthe"] * 5000,
        "test.long": ["x" * 70_000, "b", "y" * 200_000, ""],
        "test.empty": [""] * 3000 + ["é" * 40_000, "中文"],
    }
    path = tmp_path / "strings.gguf"
    writer = GGUFWriter(str(path), "llama")
    for key, values in arrays.items():
        writer.add_array(key, values)
    writer.add_string("test.after", "the field after the arrays")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    fields = read_header(path).fields
    assert {key: fields[key] for key in arrays} == arrays
    assert fields["test.after"] == "the field after the arrays"
    expected = {k: f.contents() for k, f in GGUFReader(path).fields.items() if k in fields}
    assert {k: fields[k] for k in expected} == expected
    data = path.read_bytes()
    end_of_long = data.index(b"y" * 1000) + 150_000  # inside the 200,000-byte string
    for keep in (end_of_long, data.index(b"y" * 1000) - 4):  # a string, then a length, cut off
        cut = tmp_path / "cut.gguf"
        cut.write_bytes(data[:keep])
        with pytest.raises(GGUFFormatError):
            read_header(cut)
