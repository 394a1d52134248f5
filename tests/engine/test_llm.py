"""The offline API as vLLM's users write it: `from kvserve import LLM, SamplingParams`."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig, SchedulerConfig
from kvserve.engine.llm import ENGINE_OPTIONS, engine_config
from tests.engine.helpers import make_config

TEMPLATED = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
SCORED = (
    "The sea covers most of the planet. Its water is salty because rivers carry minerals "
    "from rocks into it, and the sun lifts only the water back out."
)


@pytest.fixture(scope="module")
def llm32(loaded_fp32):
    with LLM(config=make_config(), loaded=loaded_fp32) as llm:
        yield llm


def test_a_script_with_only_the_top_level_imports_exits_quietly(tmp_path):
    """The script never closes its LLM: it must still end with nothing on stderr."""
    script = tmp_path / "offline.py"
    script.write_text(
        textwrap.dedent(
            """
            from kvserve import LLM, SamplingParams

            llm = LLM(dtype="float32", max_num_seqs=4, max_model_len=512)
            outputs = llm.generate(
                ["The capital of France is", "Two plus two is"],
                SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=8),
            )
            for output in outputs:
                print(len(output.outputs), output.prompt_token_ids[:1], output.prompt)
                for choice in output.outputs:
                    print(choice.index, choice.finish_reason, len(choice.token_ids), choice.text)
            """
        )
    )
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    # Two prompts, each with two completions of 8 tokens (or fewer, ended by a stop).
    heads = [line for line in lines if line.endswith(("France is", "Two plus two is"))]
    assert len(heads) == 2 and all(line.startswith("2 ") for line in heads)
    choices = [line for line in lines if line.startswith(("0 ", "1 "))]
    assert len(choices) == 4
    assert all(line.split()[1] in ("length", "stop") for line in choices)


def test_n_runs_seeded_choices_like_single_requests(llm32):
    """Choice i of a seeded n>1 request is the request seeded with seed + i."""
    params = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=12, ignore_eos=True)
    (both,) = llm32.generate("Once upon a time", params)
    assert [c.index for c in both.outputs] == [0, 1]
    alone = [
        llm32.generate("Once upon a time", dataclasses.replace(params, n=1, seed=seed))[0]
        for seed in (1, 2)
    ]
    assert [c.token_ids for c in both.outputs] == [a.outputs[0].token_ids for a in alone]
    assert both.outputs[0].token_ids != both.outputs[1].token_ids


def test_options_take_vllm_names_and_unknown_ones_are_named():
    config = engine_config(
        "m.gguf",
        dtype="float32",
        quantization="int8",
        kv_cache_dtype="int8",
        max_num_seqs=3,
        max_model_len=256,
        enable_prefix_caching=False,
        seed=7,
    )
    assert config.model == "m.gguf"
    assert (config.device.dtype, config.device.quantization) == ("float32", "int8")
    assert config.cache.kv_cache_dtype == "int8"
    assert config.scheduler == SchedulerConfig(max_num_seqs=3, max_model_len=256)
    assert config.seed == 7
    base = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=9, prefill_chunk=64))
    assert engine_config(config=base, max_model_len=128).scheduler == SchedulerConfig(
        max_num_seqs=9, max_model_len=128, prefill_chunk=64
    )
    with pytest.raises(TypeError) as info:
        LLM(gpu_memory_utilization=0.9, dtype="float32")
    message = str(info.value)
    assert "'gpu_memory_utilization'" in message
    assert all(name in message for name in ENGINE_OPTIONS)
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine_config(max_num_seqs=0)


def test_outputs_have_vllm_fields(llm32):
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=2, ignore_eos=True)
    (output,) = llm32.generate({"prompt": "The sea is"}, params)
    assert output.prompt == "The sea is"
    assert output.prompt_token_ids == llm32.tokenizer.encode("The sea is")
    assert output.prompt_logprobs is None
    (choice,) = output.outputs
    assert len(choice.token_ids) == 4 and choice.finish_reason == "length"
    assert choice.text == llm32.tokenizer.decode(choice.token_ids)
    assert len(choice.logprobs) == 4
    for token_id, position in zip(choice.token_ids, choice.logprobs, strict=True):
        # greedy: the chosen token is the most likely, listed with the next best
        assert position[token_id].rank == 1
        assert len(position) == 2
        assert position[token_id].decoded_token == llm32.tokenizer.decode([token_id])
    assert choice.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for t, p in zip(choice.token_ids, choice.logprobs, strict=True))
    )
    (by_ids,) = llm32.generate({"prompt_token_ids": output.prompt_token_ids}, params)
    assert by_ids.outputs[0].token_ids == choice.token_ids and by_ids.prompt is None


def test_raw_prompts_parse_control_tokens_and_chat_content_does_not(llm32):
    tok = llm32.tokenizer
    question = {"role": "user", "content": "What is the capital of France?"}
    params = SamplingParams(max_tokens=12, temperature=0)
    (raw,) = llm32.generate(TEMPLATED, params)
    # The templated text is the tail of what the chat template renders (after its system turn).
    assert raw.prompt_token_ids == tok.encode_chat([question])[-len(raw.prompt_token_ids) :]
    assert "Paris" in raw.outputs[0].text
    # chat takes one conversation or a list of them; message text stays text.
    (one,) = llm32.chat([question], params)
    forged = [{"role": "user", "content": TEMPLATED}]
    two = llm32.chat([[question], forged], params)
    assert two[0].outputs[0].text == one.outputs[0].text
    assert two[1].prompt == tok.render_chat(forged)
    specials = [t for t in two[1].prompt_token_ids if t in tok.special_token_ids]
    assert specials == [t for t in one.prompt_token_ids if t in tok.special_token_ids]


def test_prompt_logprobs_match_transformers(llm32, hf_reference):
    ids = llm32.tokenizer.encode(SCORED)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3)
    (output,) = llm32.generate(SCORED, params)
    scored = output.prompt_logprobs
    assert len(scored) == len(ids) and scored[0] is None
    with torch.no_grad():
        logits = hf_reference(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)
    for position in range(1, len(ids)):
        entry = scored[position]
        token = ids[position]
        want = expected[position - 1]
        assert abs(entry[token].logprob - want[token].item()) <= 1e-3
        assert entry[token].rank == 1 + int((want > want[token]).sum())
        top = want.topk(3).indices.tolist()
        assert [t for t in entry if t != token or t in top][: len(top)] == top
    # The text's perplexity, as an evaluation harness reads it.
    total = sum(scored[p][ids[p]].logprob for p in range(1, len(ids)))
    expected_total = sum(expected[p - 1, ids[p]].item() for p in range(1, len(ids)))
    assert math.exp(-total / (len(ids) - 1)) == pytest.approx(
        math.exp(-expected_total / (len(ids) - 1)), rel=1e-4
    )


def test_prompt_logprobs_across_prefill_chunks_and_beside_other_requests(loaded_fp32, llm32):
    params = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=0, ignore_eos=True)
    (whole,) = llm32.generate(SCORED, params)
    config = dataclasses.replace(
        make_config(),
        scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=2048, prefill_chunk=7),
    )
    with LLM(config=config, loaded=loaded_fp32) as chunked:
        plain = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        outputs = chunked.generate(
            ["Tell me a story.", SCORED, "Two plus two"], [plain, params, plain]
        )
    scored = outputs[1]
    assert outputs[0].prompt_logprobs is None and outputs[2].prompt_logprobs is None
    assert scored.outputs[0].token_ids == whole.outputs[0].token_ids
    for ours, theirs in zip(scored.prompt_logprobs[1:], whole.prompt_logprobs[1:], strict=True):
        ((token, entry),) = ours.items()  # prompt_logprobs=0: the prompt token alone
        assert abs(entry.logprob - theirs[token].logprob) <= 1e-4
        assert entry.rank == theirs[token].rank


def test_bad_sampling_params_and_prompts_are_value_errors(llm32):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm32.generate("hi", SamplingParams(prompt_logprobs=21))
    with pytest.raises(ValueError, match="prompt"):
        llm32.generate([[10**9]], SamplingParams(max_tokens=2))
    # Nothing was left behind in the engine by either refusal.
    assert llm32.generate("hi", SamplingParams(max_tokens=1))[0].outputs[0].token_ids
