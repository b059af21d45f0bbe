"""`kempnerforge generate`: continue a prompt with a checkpoint's weights.

the checkpoint and its run's config (training/inference/loading.py) -> tokenizer and prompt
(--prompt text, or a --chat conversation rendered by the chat template) -> the model with the
checkpoint's weights on train.device -> sampled continuation (KV cache, temperature / top-k /
top-p) -> on stdout the prompt and continuation, or the assistant's reply (--json: the
conversation with it). Nothing is written anywhere; log lines go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

from kempnerforge.commands.arguments import add_checkpoint_argument, add_config_argument
from kempnerforge.core.errors import ConfigError

DEFAULT_MAX_NEW_TOKENS = 128


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `kempnerforge generate` (overrides are the unknown --section.field=...)."""
    add_checkpoint_argument(parser)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the text to continue")
    prompt.add_argument(
        "--chat",
        metavar="CONVERSATION",
        help='a conversation to answer: a JSON list of {"role", "content"} messages (or '
        '{"messages": [...]}), as text or the path of a JSON file; rendered by the chat '
        "template of data.tokenizer, it prints the assistant's reply",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="with --chat: print the conversation with the reply appended, as JSON",
    )
    add_config_argument(parser)
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help=f"tokens to generate at most (default {DEFAULT_MAX_NEW_TOKENS}; fewer when the "
        "prompt and continuation would pass model.max_seq_len)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="divides the logits before sampling; 0 is greedy (default 1.0)",
    )
    parser.add_argument(
        "--top-k", type=int, default=0, help="sample from the k likeliest tokens; 0: all (default)"
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample from the likeliest tokens holding this much probability; 1: all (default)",
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="seed of the sampling (default: a fresh one)"
    )
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="re-run the whole sequence for every token instead of using the KV cache",
    )
    parser.add_argument(
        "--bos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="start the prompt with BOS (default: when the training data put one before "
        "every document); not with --chat, whose template writes the start",
    )


def run_generate(args: argparse.Namespace, overrides: list[str]) -> int:
    """Print ``args.prompt`` and its continuation, or the reply to the ``args.chat``
    conversation, by the weights of ``args.checkpoint``; 0."""
    check_arguments(args)
    # Heavy imports here, so `kempnerforge --help` stays fast.
    from kempnerforge.core.logging import configure_logging
    from kempnerforge.data.tokenizer import load_tokenizer
    from kempnerforge.model import Transformer, generate
    from kempnerforge.training.inference import (
        chat_prompt,
        generation_prompt,
        load_for_inference,
        open_for_inference,
        read_conversation,
    )

    messages = None if args.chat is None else read_conversation(args.chat)
    configure_logging(0)
    # No data is read, so the run's parallel layout need not fit one process (validate).
    job = open_for_inference(
        "generate", args.checkpoint, config_path=args.config, overrides=overrides, validate=False
    )
    tokenizer = load_tokenizer(job.config.data.tokenizer)
    model_cfg, data_cfg = job.config.model, job.config.data
    if messages is None:
        ids, max_new_tokens = generation_prompt(
            tokenizer,
            model_cfg,
            data_cfg,
            args.prompt,
            bos=args.bos,
            max_new_tokens=args.max_new_tokens,
        )
        stop_ids = {tokenizer.eos_id}
    else:
        chat = chat_prompt(
            tokenizer, model_cfg, data_cfg, messages, max_new_tokens=args.max_new_tokens
        )
        ids, max_new_tokens, stop_ids = chat.ids, chat.max_new_tokens, chat.stop_ids
    model = load_for_inference(job)
    assert isinstance(model, Transformer)  # open_for_inference refused every other family
    new_ids = generate(
        model,
        ids,
        max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        stop_ids=stop_ids,
        seed=args.seed,
        use_cache=not args.no_cache,
    )
    text = tokenizer.decode(new_ids)
    if messages is None:
        text = args.prompt + text
    elif args.json:
        reply = {"role": "assistant", "content": text}
        text = json.dumps([*messages, reply], ensure_ascii=False)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    return 0


def check_arguments(args: argparse.Namespace) -> None:
    """The options' ranges and combinations, before anything is loaded; ConfigError naming
    the flag."""
    if args.chat is not None and args.bos is not None:
        flag = "--bos" if args.bos else "--no-bos"
        raise ConfigError(
            flag,
            args.bos,
            "no BOS option with --chat",
            "the chat template writes the start of the conversation, BOS included when the "
            "model's template has one",
        )
    if args.json and args.chat is None:
        raise ConfigError(
            "--json", True, "--chat CONVERSATION beside it", "--prompt prints plain text"
        )
    if args.max_new_tokens < 0:
        raise ConfigError("--max-new-tokens", args.max_new_tokens, "an integer >= 0")
    if not args.temperature >= 0 or args.temperature == float("inf"):
        raise ConfigError("--temperature", args.temperature, "a number >= 0 (0 is greedy)")
    if args.top_k < 0:
        raise ConfigError("--top-k", args.top_k, "an integer >= 0 (0 keeps every token)")
    if not 0 < args.top_p <= 1:
        raise ConfigError("--top-p", args.top_p, "0 < top-p <= 1 (1 keeps every token)")
    if args.seed is not None and not 0 <= args.seed < 2**63:
        raise ConfigError("--seed", args.seed, "an integer from 0 to 2**63 - 1")
