"""The CUDA path, checked and timed on a machine with a GPU, in one run.

Nothing is downloaded on the GPU machine, so its inputs are prepared here first:

    python -m kvserve.bench.cuda_check prepare DIR     # tiny GGUFs, the default's tokenizer
    python -m kvserve.bench.cuda_check run DIR --out results.json   # on the GPU machine

`run` checks, each part on its own so one failure does not hide the others:
- parity: greedy answers and their log-probabilities on CUDA in float32 against the CPU in
  float32, for the tiny random-weight GGUFs (Q8_0 and Q4_0 blocks, dequantized on CUDA);
- bfloat16 (CUDA's `auto`): how many greedy tokens agree with float32 on CUDA;
- speculation (prompt lookup) on CUDA: greedy answers equal with and without it;
- the server on CUDA: `kvserve serve --device cuda`, a streamed chat completion whose last event
  carries the stop reason and usage, a client that disconnects mid-stream, /ready and /metrics;
- speed: a 1.5B-shaped random checkpoint (Qwen2 shape, written by transformers on the GPU
  machine), the engine benchmark at 1/8/32/64 streams next to transformers' static batches.
Random weights check shapes and arithmetic, not answer quality.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

PROMPTS = [
    "The history of the city begins",
    "def fibonacci(n):\n    ",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Once upon a time, in a small village, there lived",
]
# A prompt with a repeated passage, so prompt lookup finds something to guess.
SPEC_PROMPT = "alpha beta gamma delta epsilon zeta eta theta iota kappa. " * 6 + "alpha beta gamma"
DEVICE = "cuda"  # `run --device cpu` is a dry run of this script
# The shape of Qwen2.5-1.5B with the default model's vocabulary (its tokenizer travels).
SHAPE_1_5B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


def prepare(directory: Path) -> None:
    from kvserve.bench.big_model import TINY, generate
    from kvserve.model.paths import default_model_path
    from kvserve.tokenizer import Tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    for qtype, path in generate(TINY, ("Q8_0", "Q4_0"), directory).items():
        print(f"{qtype}: {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    hf = Tokenizer.from_gguf(default_model_path()).save_pretrained(directory / "hf-tokenizer")
    print(f"tokenizer: {hf}")


def _tiny_files(directory: Path) -> dict[str, Path]:
    return {p.stem.rsplit("-", 1)[-1]: p for p in sorted(directory.glob("*.gguf"))}


def _greedy(llm, prompts, max_tokens=24):
    from kvserve.params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [
        [next(iter(pos.values())).logprob if pos else None for pos in o.outputs[0].logprobs]
        for o in outs
    ]
    return tokens, logprobs


def check_parity(directory: Path) -> dict:
    from kvserve.engine.llm import LLM

    result = {}
    for name, path in _tiny_files(directory).items():
        answers = {}
        for device, dtype in (("cpu", "float32"), (DEVICE, "float32"), (DEVICE, "auto")):
            with LLM(str(path), device=device, dtype=dtype, max_num_seqs=8) as llm:
                answers[(device, dtype)] = _greedy(llm, PROMPTS)
        cpu_tokens, cpu_lp = answers[("cpu", "float32")]
        cuda_tokens, cuda_lp = answers[(DEVICE, "float32")]
        bf_tokens, _ = answers[(DEVICE, "auto")]
        # Log-probabilities compared where both sides chose the same tokens so far.
        diff = 0.0
        for a_tok, b_tok, a_lp, b_lp in zip(cpu_tokens, cuda_tokens, cpu_lp, cuda_lp, strict=True):
            for i in range(len(a_tok)):
                if a_tok[: i + 1] != b_tok[: i + 1]:
                    break
                diff = max(diff, abs(a_lp[i] - b_lp[i]))
        total = sum(len(t) for t in cpu_tokens)
        result[name] = {
            "fp32_answers_equal": cpu_tokens == cuda_tokens,
            "fp32_max_logprob_diff": diff,
            "bf16_tokens_agreeing_with_fp32": sum(
                x == y
                for a, b in zip(cuda_tokens, bf_tokens, strict=True)
                for x, y in zip(a, b, strict=True)
            )
            / total,
        }
    return result


def check_speculation(directory: Path) -> dict:
    from kvserve.engine.llm import LLM

    path = _tiny_files(directory)["Q8_0"]
    prompts = [SPEC_PROMPT, *PROMPTS]
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    with LLM(str(path), device=DEVICE, dtype="float32") as llm:
        plain, _ = _greedy(llm, prompts, max_tokens=48)
    with LLM(str(path), device=DEVICE, dtype="float32", speculative_config=spec) as llm:
        guessed, _ = _greedy(llm, prompts, max_tokens=48)
    return {"answers_equal": plain == guessed, "tokens": sum(len(t) for t in plain)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_server(directory: Path) -> dict:
    import httpx

    path = _tiny_files(directory)["Q8_0"]
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve", "serve", str(path), "--device", DEVICE,
         "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    result: dict = {}
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                ready = httpx.get(f"{base}/ready", timeout=2)
                if ready.status_code == 200:
                    result["ready"] = ready.json()
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited: {proc.stdout.read()[-3000:]}")
            time.sleep(0.5)
        else:
            raise RuntimeError("the server did not become ready in 120 s")
        model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": 32,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        events = []
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
            result["stream_status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                elif line.strip():
                    result.setdefault("stream_other_lines", []).append(line[:500])
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        result["stream_events"] = len(events)
        result["stream_ends_with_done"] = events[-1] == "[DONE]"
        result["finish_reason"] = next(
            (c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")
             and c["choices"][0].get("finish_reason")), None,
        )  # fmt: skip
        result["usage"] = chunks[-1].get("usage")
        # A client that leaves mid-stream: the server goes on answering others.
        with httpx.stream(
            "POST",
            f"{base}/v1/chat/completions",
            json={**body, "max_tokens": 2000, "ignore_eos": True},
            timeout=60,
        ) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 5:
                    break
        plain = httpx.post(
            f"{base}/v1/chat/completions",
            json={**body, "stream": False, "stream_options": None},
            timeout=60,
        )
        result["after_disconnect_status"] = plain.status_code
        result["after_disconnect_answer"] = plain.json()["choices"][0]["message"]["content"][:80]
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        result["metrics_lines_kvserve"] = sum(
            1 for line in metrics.splitlines() if line.startswith(("kvserve", "vllm"))
        )
    finally:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        result["server_log_tail"] = out[-2500:]
        result["exit_code"] = proc.returncode
    return result


def check_speed(directory: Path, concurrencies: list[int], shape: dict) -> dict:
    import transformers

    from kvserve.bench.engine_bench import bench_prompts, measure_engine, measure_reference
    from kvserve.config import DeviceConfig
    from kvserve.model.loader import load_model

    target = Path(f"/tmp/kvserve-1.5b-shaped-{shape.get('num_hidden_layers', 28)}")
    started = time.perf_counter()
    if not (target / "config.json").exists():
        tok = json.loads((directory / "hf-tokenizer" / "tokenizer.json").read_text())
        vocab = len(tok["model"]["vocab"]) + len(tok.get("added_tokens", []))
        vocab = -(-vocab // 64) * 64
        config = transformers.Qwen2Config(vocab_size=vocab, **{**SHAPE_1_5B, **shape})
        torch.manual_seed(0)
        with torch.device(DEVICE):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(target)
        del model
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            (target / name).write_bytes((directory / "hf-tokenizer" / name).read_bytes())
    written = time.perf_counter() - started
    t0 = time.perf_counter()
    loaded = load_model(str(target), DeviceConfig(device=DEVICE))
    load_s = time.perf_counter() - t0
    reference = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).to(
        DEVICE
    )
    rows = []
    for c in concurrencies:
        r = measure_engine(loaded, c)
        prompts = bench_prompts(loaded, r.num_requests, 128)
        r.reference_output_tok_s = measure_reference(reference, prompts, c)
        rows.append(r.to_dict())
        print(json.dumps(rows[-1]), flush=True)
    return {"write_s": written, "load_s": load_s, "dtype": str(loaded.model.dtype), "rows": rows}


def run(directory: Path, out: Path, concurrencies: list[int], shape: dict) -> int:
    report: dict = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cpu": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    # float32 means float32 on CUDA too (no TF32 products) for the parity check.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    checks = {
        "parity": lambda: check_parity(directory),
        "speculation": lambda: check_speculation(directory),
        "server": lambda: check_server(directory),
        "speed": lambda: check_speed(directory, concurrencies, shape),
    }
    only = os.environ.get("KVSERVE_CUDA_CHECKS")
    failed = 0
    for name, check in checks.items():
        if only and name not in only.split(","):
            continue
        started = time.perf_counter()
        try:
            report[name] = check()
        except Exception:
            failed += 1
            report[name] = {"error": traceback.format_exc()[-4000:]}
        report[name]["seconds"] = round(time.perf_counter() - started, 1)
        print(f"== {name}: {json.dumps(report[name], default=str)[:3000]}", flush=True)
        out.write_text(json.dumps(report, indent=1, default=str))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("directory", type=Path)
    r = sub.add_parser("run")
    r.add_argument("directory", type=Path)
    r.add_argument("--out", type=Path, default=Path("cuda_check.json"))
    r.add_argument("--concurrency", default="1,8,32,64")
    r.add_argument("--device", default="cuda", help="cpu: a dry run of this script")
    r.add_argument("--layers", type=int, default=28, help="layers of the 1.5B-shaped model")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare(args.directory)
        return 0
    global DEVICE
    DEVICE = args.device
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    return run(args.directory, args.out, concurrencies, {"num_hidden_layers": args.layers})


if __name__ == "__main__":
    sys.exit(main())
