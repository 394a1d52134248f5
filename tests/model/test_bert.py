"""The BERT encoder against transformers' BertModel on the same directory (the independent
reference), with the model's own pooling and normalization; and its sentence-transformers
configuration read as sentence-transformers reads it."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
import torch.nn.functional as F

from kvserve.bench.loadgen import WORDS
from kvserve.model.bert import BertConfig, _groups, pool

EXTRA = [
    "",
    "a",
    "Hello, world!",
    "Ünïcödé café, naïve façade — 北京欢迎你 🌊",
    "The year 2024: 3.14159 × 2 = 6.28318 (approximately).",
    "UPPER case and lower case are the same to an uncased model.",
]


def sentences(count: int = 60, seed: int = 7) -> list[str]:
    """Sentences of 1 to ~400 words (some past the model's 256 tokens), plus odd ones."""
    rng = random.Random(seed)
    lengths = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 400]
    out = list(EXTRA)
    while len(out) < count:
        n = lengths[len(out) % len(lengths)] + rng.randint(0, 4)
        words = [rng.choice(WORDS) for _ in range(n)]
        out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ""]))
    return out


@pytest.fixture(scope="module")
def reference(minilm_dir):
    from transformers import AutoTokenizer, BertModel

    model = BertModel.from_pretrained(str(minilm_dir), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(minilm_dir))


def reference_embeddings(reference, texts: list[str]) -> torch.Tensor:
    """transformers' BertModel, then the model's pooling (mean over the attention mask) and
    normalization (its modules.json has Normalize), inputs cut at max_seq_length (256) as
    sentence-transformers cuts them."""
    model, tokenizer = reference
    out = []
    for start in range(0, len(texts), 16):
        batch = tokenizer(
            texts[start : start + 16],
            padding=True,
            truncation=True,
            max_length=256,
            return_tensors="pt",
        )
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        out.append(F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1))
    return torch.cat(out)


def test_minilm_config_is_read_from_its_sentence_transformers_files(loaded_minilm):
    config = loaded_minilm.config
    assert (config.pooling, config.normalize) == ("mean", True)
    assert config.max_input_tokens == 256  # sentence_bert_config.json, not the 512 positions
    assert loaded_minilm.model.dimensions == 384


def test_minilm_matches_transformers_over_sentences_of_every_length(loaded_minilm, reference):
    texts = sentences()
    assert len(texts) >= 50
    tokenizer = loaded_minilm.tokenizer
    ids = [tokenizer.encode(text, truncate=True) for text in texts]
    assert max(len(i) for i in ids) == 256 and min(len(i) for i in ids) == 2
    # The same token ids as the reference tokenizer, [CLS] and [SEP] included.
    _, hf_tokenizer = reference
    assert ids == [
        hf_tokenizer(text, truncation=True, max_length=256)["input_ids"] for text in texts
    ]
    ours = loaded_minilm.model.embed(ids)
    theirs = reference_embeddings(reference, texts)
    cosine = F.cosine_similarity(ours, theirs, dim=-1)
    assert cosine.min().item() >= 0.9999, cosine.min().item()
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(texts)), atol=1e-5)


def test_batched_equals_one_by_one(loaded_minilm):
    texts = sentences(24, seed=3)
    ids = [loaded_minilm.tokenizer.encode(text, truncate=True) for text in texts]
    together = loaded_minilm.model.embed(ids)
    alone = torch.cat([loaded_minilm.model.embed([one]) for one in ids])
    assert torch.allclose(together, alone, atol=1e-5)
    # ...and in any order: each vector belongs to its own input.
    order = list(reversed(range(len(ids))))
    shuffled = loaded_minilm.model.embed([ids[i] for i in order])
    assert torch.allclose(shuffled, together[order], atol=1e-5)


def test_truncation_keeps_the_special_tokens(loaded_minilm):
    tokenizer = loaded_minilm.tokenizer
    long = " ".join(["word"] * 600)
    assert len(tokenizer.encode(long)) == 602
    cut = tokenizer.encode(long, truncate=True)
    assert len(cut) == 256 and (cut[0], cut[-1]) == (101, 102)


def test_groups_bound_padding_and_keep_every_input():
    lengths = [3, 200, 4, 5, 190, 3, 60, 61]
    groups = _groups(lengths)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    for group in groups:
        padded = max(lengths[i] for i in group) * len(group)
        assert padded - sum(lengths[i] for i in group) <= 0.25 * padded


def test_pooling_modes():
    hidden = torch.tensor([[[1.0, 0.0], [3.0, 2.0], [9.0, 9.0]]])  # [1, 3, 2]
    mask = torch.tensor([[True, True, False]])
    assert pool(hidden, mask, "mean").tolist() == [[2.0, 1.0]]
    assert pool(hidden, mask, "cls").tolist() == [[1.0, 0.0]]
    assert pool(hidden, mask, "max").tolist() == [[3.0, 2.0]]
    assert pool(hidden, mask, "last").tolist() == [[3.0, 2.0]]
    sqrt = pool(hidden, mask, "mean_sqrt_len")
    assert torch.allclose(sqrt, torch.tensor([[4.0, 2.0]]) / 2**0.5)


@pytest.mark.parametrize(
    ("pooling", "modules", "expected"),
    [
        ({"pooling_mode_cls_token": True}, ["Pooling"], ("cls", False)),
        ({"pooling_mode": "lasttoken"}, ["Pooling", "Normalize"], ("last", True)),
        (None, None, ("mean", False)),
    ],
)
def test_the_head_is_read_from_the_sentence_transformers_files(
    minilm_dir, tmp_path, pooling, modules, expected
):
    shutil.copy(minilm_dir / "config.json", tmp_path / "config.json")
    if modules is not None:
        listed = [
            {"idx": i, "name": str(i), "path": f"{i}_{kind}" if kind == "Pooling" else "",
             "type": f"sentence_transformers.models.{kind}"}
            for i, kind in enumerate(modules, start=1)
        ]  # fmt: skip
        (tmp_path / "modules.json").write_text(json.dumps(listed))
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    config = BertConfig.from_dir(tmp_path)
    assert (config.pooling, config.normalize) == expected
    assert config.max_input_tokens == 512  # no sentence_bert_config.json: the positions
