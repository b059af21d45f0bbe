"""`kempnerforge generate`: continue a prompt with a checkpoint's weights.

the checkpoint and its run's config (training/inference/loading.py) -> tokenizer and prompt ->
the model with the checkpoint's weights on train.device -> sampled continuation (KV cache,
temperature / top-k / top-p) -> prompt and continuation on stdout. Nothing is written
anywhere; log lines go to stderr.
"""

from __future__ import annotations

import argparse
import sys

from kempnerforge.commands.arguments import add_checkpoint_argument, add_config_argument
from kempnerforge.core.errors import ConfigError

DEFAULT_MAX_NEW_TOKENS = 128


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `kempnerforge generate` (overrides are the unknown --section.field=...)."""
    add_checkpoint_argument(parser)
    parser.add_argument("--prompt", required=True, help="the text to continue")
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
        "every document)",
    )


def run_generate(args: argparse.Namespace, overrides: list[str]) -> int:
    """Print ``args.prompt`` and its continuation by the weights of ``args.checkpoint``; 0."""
    check_arguments(args)
    # Heavy imports here, so `kempnerforge --help` stays fast.
    from kempnerforge.core.logging import configure_logging
    from kempnerforge.data.tokenizer import load_tokenizer
    from kempnerforge.model import Transformer, generate
    from kempnerforge.training.inference.loading import load_for_inference, open_for_inference
    from kempnerforge.training.inference.prompt import generation_prompt

    configure_logging(0)
    # No data is read, so the run's parallel layout need not fit one process (validate).
    job = open_for_inference(
        "generate", args.checkpoint, config_path=args.config, overrides=overrides, validate=False
    )
    tokenizer = load_tokenizer(job.config.data.tokenizer)
    ids, max_new_tokens = generation_prompt(
        tokenizer,
        job.config.model,
        job.config.data,
        args.prompt,
        bos=args.bos,
        max_new_tokens=args.max_new_tokens,
    )
    model = load_for_inference(job)
    assert isinstance(model, Transformer)  # open_for_inference refused every other family
    new_ids = generate(
        model,
        ids,
        max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        stop_id=tokenizer.eos_id,
        seed=args.seed,
        use_cache=not args.no_cache,
    )
    sys.stdout.write(args.prompt + tokenizer.decode(new_ids) + "\n")
    sys.stdout.flush()
    return 0


def check_arguments(args: argparse.Namespace) -> None:
    """The sampling options' ranges, before anything is loaded; ConfigError naming the flag."""
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
