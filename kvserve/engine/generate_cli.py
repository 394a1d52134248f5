"""`kvserve generate PROMPT`: stream one answer to the terminal, token by token."""

from __future__ import annotations

import argparse
import logging
import sys

from kvserve.cli import add_engine_arguments, engine_config_from_args, resolve_model_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the user message (or raw text with --raw)")
    add_engine_arguments(parser, positional_model=False)
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--system", default=None, help="a system message for the chat template")
    g.add_argument("--raw", action="store_true", help="send the prompt as plain text, no template")


def run(args: argparse.Namespace) -> int:
    """Stream the answer to stdout; 2 when the model is not here (the message says how to
    pull a catalogue model)."""
    problem = resolve_model_argument(args)
    if problem is not None:
        print(f"kvserve generate: {problem}", file=sys.stderr)
        return 2
    from kvserve.engine.llm import LLM
    from kvserve.params import SamplingParams

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    config = engine_config_from_args(args)
    with LLM(config=config) as llm:
        if args.raw:
            prompt_ids = llm.encode(args.prompt)
        else:
            messages = [{"role": "user", "content": args.prompt}]
            if args.system:
                messages.insert(0, {"role": "system", "content": args.system})
            prompt_ids = llm.tokenizer.encode_chat(messages)
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
        final = None
        for delta in llm.stream(prompt_ids, params):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            final = delta
        sys.stdout.write("\n")
        if final is not None and final.usage is not None:
            print(
                f"[{final.finish_reason}: {final.usage.prompt_tokens} prompt tokens, "
                f"{final.usage.completion_tokens} generated]",
                file=sys.stderr,
            )
    return 0
