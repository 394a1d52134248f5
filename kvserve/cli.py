"""`kvserve` command line: one subcommand per module, each module owning its own flags.

A subcommand module exposes `add_arguments(parser)` and `run(args) -> int`. Modules are
imported only when their subcommand runs, so `kvserve simulate` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from kvserve.config import (
    ADMISSIONS,
    BLOCK_SIZES,
    DEFAULT_RESERVE_TOKENS,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    CacheConfig,
    DeviceConfig,
    EmbeddingConfig,
    EngineConfig,
    QueueConfig,
    SchedulerConfig,
    StreamConfig,
    env_default,
    parse_speculative_config,
)

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvserve.server.cli", "run the OpenAI-compatible HTTP server"),
    "cluster": ("kvserve.cluster.cli", "run N engine replicas on Ray Serve behind one endpoint"),
    "generate": ("kvserve.engine.generate_cli", "generate text for a prompt, streamed"),
    "pull": ("kvserve.hub.pull_cli", "fetch a catalogue model into the models directory"),
    "list": ("kvserve.hub.list_cli", "list the models present, with their sizes"),
    "bench": ("kvserve.bench.loadgen", "load-test an OpenAI-compatible server"),
    "simulate": ("kvserve.sim.cli", "run the scheduling simulator"),
}


def parse_size(text: str) -> int:
    """Bytes from '512MiB', '2G', '1.5GB' or a plain number."""
    units = {
        "k": 1e3,
        "kb": 1e3,
        "kib": 1024,
        "m": 1e6,
        "mb": 1e6,
        "mib": 1024**2,
        "g": 1e9,
        "gb": 1e9,
        "gib": 1024**3,
    }
    raw = text.strip().lower()
    for suffix in sorted(units, key=len, reverse=True):
        if raw.endswith(suffix):
            return int(float(raw[: -len(suffix)]) * units[suffix])
    return int(float(raw))


def parse_memory(text: str) -> int | float:
    """A memory budget: a fraction of the memory available ('0.4', '40%'), else bytes as
    `parse_size` reads them ('4GiB', '512MB')."""
    raw = text.strip()
    if raw.endswith("%"):
        fraction = float(raw[:-1]) / 100
    else:
        try:
            fraction = float(raw)
        except ValueError:
            return parse_size(raw)
        if fraction > 1:
            return int(fraction)
    if not 0 < fraction <= 1:
        raise ValueError(f"a fraction of the memory must be in (0, 1], got {text!r}")
    return fraction


def _optional_int(text: str) -> int | None:
    return None if text.lower() in ("", "none", "auto") else int(text)


class _Models(argparse.Action):
    """The positional models: the list in `models`, the first in `model`."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        names = list(values or [])
        namespace.models = names
        namespace.model = names[0] if names else None


def add_engine_arguments(parser: argparse.ArgumentParser, *, positional_model: bool = True) -> None:
    """Flags shared by every command that runs the engine (serve, generate)."""
    e = env_default
    model_help = (
        "a catalogue name pulled with `kvserve pull` (e.g. qwen2.5-coder:1.5b), a .gguf file "
        "or a Hugging Face model directory (default: embedded SmolLM2-135M)"
    )
    if positional_model:
        # Several models (`kvserve serve A B`) are served side by side; `model` is the first.
        first = e("--model", None)
        parser.add_argument(
            "models",
            nargs="*",
            metavar="MODEL",
            action=_Models,
            default=[first] if first else [],
            help=model_help + "; several are served side by side, each loaded on first use",
        )
        parser.set_defaults(model=first)
    else:
        parser.add_argument("-m", "--model", default=e("--model", None), help=model_help)
    parser.add_argument(
        "--pull",
        action="store_true",
        default=e("--pull", False, bool),
        help="pull a catalogue model first when it is not in the models directory yet "
        "(without it a model not pulled is an error that says how to pull it)",
    )
    g = parser.add_argument_group("device")
    g.add_argument("--device", default=e("--device", "auto"), help="auto | cpu | cuda[:N]")
    g.add_argument(
        "--dtype", default=e("--dtype", "auto"), help="auto | bfloat16 | float16 | float32"
    )
    g.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=e("--quantization", "auto"),
        help="auto (default: a GGUF file with K-quant blocks keeps its blocks, another "
        "quantized checkpoint runs int8 where the CPU kernels run, else none) | none: the "
        "model's dtype | int8: int8 linear layers on the CPU | gguf: the GGUF file's blocks "
        "kept in memory and multiplied as they are | q4: Q4_0/Q4_1 blocks on AVX512-VNNI "
        "(see docs/serving.md)",
    )
    g.add_argument(
        "--weight-cache-dir",
        default=e("--weight-cache-dir", None),
        help="where prepared int8 weights are cached and memory-mapped at the next start "
        "(default: $XDG_CACHE_HOME/kvserve/prepared)",
    )
    g.add_argument(
        "--no-weight-cache",
        action="store_true",
        default=e("--no-weight-cache", False, bool),
        help="prepare the weights at every start; read and write no cache",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=e("--threads", None, int),
        help="CPU threads for torch (default: all cores)",
    )
    g = parser.add_argument_group("KV cache")
    g.add_argument(
        "--block-size",
        type=int,
        choices=BLOCK_SIZES,
        default=e("--block-size", 32, int),
        help="positions per KV block",
    )
    g.add_argument(
        "--num-kv-blocks",
        type=_optional_int,
        default=e("--num-kv-blocks", None, _optional_int),
        help="pool size in blocks (overrides --kv-cache-memory)",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=parse_memory,
        default=e("--kv-cache-memory", None, parse_memory),
        help="memory for the KV pool: bytes (4GiB, 512MB) or a fraction of the memory "
        "available at start (0.4, 40%%) (default: 90%% of free GPU memory, 50%% of available "
        "host memory, at most what --max-num-seqs full contexts can fill)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=e("--kv-cache-dtype", "auto"),
        help="auto (default: int8 with int8 linear layers where its kernels run, else the "
        "model's dtype) | model: the model's dtype | int8: K and V rows as 8-bit integers with "
        "a scale each, half the memory and the reads of bf16 (CPU; see docs/serving.md)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=e("--enable-prefix-caching", True, bool),
        help="reuse the KV of prompt blocks already computed for an earlier request with the "
        "same prefix and cache_salt (--no-enable-prefix-caching turns it off)",
    )
    g = parser.add_argument_group("scheduling")
    g.add_argument("--max-num-seqs", type=int, default=e("--max-num-seqs", 8, int))
    g.add_argument(
        "--admission",
        choices=ADMISSIONS,
        default=e("--admission", "partial"),
        help="partial (default): a request is admitted with KV blocks for its prompt and the "
        "first --reserve-tokens positions of its answer, grows from the free pool, and the "
        "latest arrival is preempted by recompute when the pool runs dry | reserve: blocks for "
        "the prompt and the whole answer budget (the rest of the context without max_tokens)",
    )
    g.add_argument(
        "--reserve-tokens",
        type=int,
        default=e("--reserve-tokens", DEFAULT_RESERVE_TOKENS, int),
        help="answer positions reserved at admission under --admission partial",
    )
    g.add_argument(
        "--max-model-len",
        type=_optional_int,
        default=e("--max-model-len", None, _optional_int),
        help="context length limit (default: the model's)",
    )
    g.add_argument(
        "--max-num-batched-tokens", type=int, default=e("--max-num-batched-tokens", 2048, int)
    )
    g.add_argument("--prefill-chunk", type=int, default=e("--prefill-chunk", 512, int))
    g.add_argument("--max-queue-per-slot", type=int, default=e("--max-queue-per-slot", 8, int))
    g.add_argument("--queue-timeout", type=float, default=e("--queue-timeout", 30.0, float))
    g.add_argument(
        "--max-overtakes",
        type=_optional_int,
        default=e("--max-overtakes", None, _optional_int),
        help="times later requests may overtake the queue head (default: slots; 0 = FIFO)",
    )
    g.add_argument(
        "--stream-buffer",
        type=int,
        default=e("--stream-buffer", 256, int),
        help="undelivered steps before a client is dropped as a slow consumer",
    )
    g.add_argument("--seed", type=int, default=e("--seed", 0, int))
    g = parser.add_argument_group("speculative decoding")
    g.add_argument(
        "--speculative-config",
        default=e("--speculative-config", None),
        help='JSON, as vLLM: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4} guesses tokens by prompt lookup and '
        'verifies them inside the step; {"model": NAME, "num_speculative_tokens": 4} guesses '
        'with a draft model of the same vocabulary ("draft_requantize", default "Q4_0": its '
        "larger layer blocks requantized at load; null keeps the file's); "
        '"disable_by_batch_size" (default 8): above this many '
        'decoding sequences nobody speculates; "disable_when_slower" (default true): below it, '
        "steps speculate only while measured faster than plain decoding (default: off)",
    )
    g = parser.add_argument_group("chat")
    g.add_argument(
        "--chat-template",
        default=e("--chat-template", None),
        help="a Jinja chat template to use in place of the model's: a file, or the template "
        "itself (as vLLM's flag); tool calls are then read in the syntax it teaches",
    )

    g = parser.add_argument_group("embeddings")
    g.add_argument(
        "--pooling",
        choices=("last", "mean"),
        default=e("--pooling", "last"),
        help="how a decoder model's embeddings pool its tokens' final states: last (the last "
        "token's, as decoder-based embedders do) | mean; an encoder model's own config says",
    )


def chat_template_text(value: str | None) -> str | None:
    """`--chat-template`'s template: the file it names, or the value itself when it is no
    file (a template has Jinja markup; a missing file is an error)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{" not in value:
        raise SystemExit(f"kvserve: --chat-template: no such file: {value}")
    return value


def resolve_model_argument(args: argparse.Namespace) -> str | None:
    """Check the model argument before anything heavy starts: None when it names a model
    present here (pulled first with `--pull`), else the message to print. A catalogue name
    not pulled yet is refused with the command that pulls it."""
    for model in getattr(args, "models", None) or [args.model]:
        problem = _resolve_one(model, pull=getattr(args, "pull", False))
        if problem is not None:
            return problem
    return None


def _resolve_one(model: str | None, *, pull: bool) -> str | None:
    from kvserve import hub
    from kvserve.model.paths import resolve_model_path

    try:
        resolve_model_path(model)
    except hub.NotPulledError as exc:
        if not pull:
            return str(exc)
        from kvserve.hub.pull_cli import pull_entry

        try:
            pull_entry(exc.entry)
        except hub.PullError as error:
            return str(error)
    except (FileNotFoundError, ValueError) as exc:
        return str(exc)
    return None


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        device=DeviceConfig(
            device=args.device,
            dtype=args.dtype,
            num_threads=args.threads,
            quantization=args.quantization,
            weight_cache=not args.no_weight_cache,
            weight_cache_dir=args.weight_cache_dir,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory=args.kv_cache_memory,
            kv_cache_dtype=args.kv_cache_dtype,
            enable_prefix_caching=args.enable_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            prefill_chunk=args.prefill_chunk,
            admission=args.admission,
            reserve_tokens=args.reserve_tokens,
        ),
        queue=QueueConfig(
            max_queue_per_slot=args.max_queue_per_slot,
            queue_timeout=args.queue_timeout,
            max_overtakes=args.max_overtakes,
        ),
        stream=StreamConfig(buffer_steps=args.stream_buffer),
        embedding=EmbeddingConfig(pooling=args.pooling),
        speculative=parse_speculative_config(getattr(args, "speculative_config", None)),
        seed=args.seed,
        chat_template=chat_template_text(args.chat_template),
    )


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    return int(args._run(args) or 0)
