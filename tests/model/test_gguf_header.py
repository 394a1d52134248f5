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
