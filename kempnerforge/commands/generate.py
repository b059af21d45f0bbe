"""`kempnerforge generate`: continue a prompt with a checkpoint's weights.

checkpoint -> its run's config -> tokenizer and model on train.device -> the checkpoint's
weights -> sampled continuation (KV cache, temperature / top-k / top-p) -> prompt and
continuation on stdout. Nothing is written anywhere; log lines go to stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kempnerforge.config.run_config import RUN_CONFIG_FILE, run_config_beside
from kempnerforge.core.errors import ConfigError

if TYPE_CHECKING:
    from kempnerforge.config.data import DataConfig

DEFAULT_MAX_NEW_TOKENS = 128

VLM_REFUSAL = "generate takes text models; a VLM's caption sample is printed at the end of training"


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `kempnerforge generate` (overrides are the unknown --section.field=...)."""
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="a checkpoint directory (runs/<name>/checkpoints/step_<N>), or the checkpoint "
        "directory holding them (its newest complete checkpoint)",
    )
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument(
        "--config",
        default="",
        help=f"the TOML config the checkpoint was trained with (default: the run's "
        f"{RUN_CONFIG_FILE}, two directories above the checkpoint)",
    )
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
    checkpoint = resolve_checkpoint(args.checkpoint)
    config_path = Path(args.config) if args.config else run_config_beside(checkpoint)
    if not config_path.is_file():
        raise ConfigError(
            "--config",
            str(config_path),
            "an existing TOML file",
            "the config the checkpoint was trained with; by default the run directory's "
            f"{RUN_CONFIG_FILE}, two directories above the checkpoint",
        )

    # Heavy imports here, so `kempnerforge --help` stays fast.
    import torch

    from kempnerforge.checkpoint.manager import CheckpointManager
    from kempnerforge.config.loader import load_config
    from kempnerforge.core.logging import configure_logging, get_logger
    from kempnerforge.data.tokenizer import load_tokenizer
    from kempnerforge.distributed.runtime import resolve_device, world_size_from_env
    from kempnerforge.model import build_model, generate
    from kempnerforge.training.sample import prompt_ids

    config = load_config(str(config_path), overrides)
    if config.is_vlm:
        raise refusal(f"{config_path}: {VLM_REFUSAL}")
    world_size = world_size_from_env()
    if world_size > 1:
        raise ConfigError("WORLD_SIZE", world_size, "1: kempnerforge generate runs in one process")
    configure_logging(0)
    logger = get_logger(__name__)
    if config.train.num_threads:
        torch.set_num_threads(config.train.num_threads)
    tokenizer = load_tokenizer(config.data.tokenizer)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ConfigError(
            "model.vocab_size",
            config.model.vocab_size,
            f">= the tokenizer's vocabulary size {tokenizer.vocab_size}",
            f"data.tokenizer = {config.data.tokenizer!r}",
        )
    bos = args.bos
    if bos is None:
        bos = data_starts_with_bos(config.data)
        if bos is None:
            logger.warning(
                "cannot read the training data's meta.json to tell whether its documents "
                "start with BOS; prompting without one (pass --bos to add it)"
            )
            bos = False
    ids = prompt_ids(tokenizer, args.prompt, bos)
    limit = config.model.max_seq_len
    room = limit - len(ids)
    if room < 1:
        raise ConfigError(
            "--prompt",
            f"{len(ids)} tokens",
            f"fewer than model.max_seq_len = {limit} tokens",
            "the prompt and its continuation must fit the model's context",
        )
    max_new_tokens = args.max_new_tokens
    if max_new_tokens > room:
        logger.warning(
            "generating %d tokens, not %d: the prompt (%d tokens) and its continuation must "
            "fit model.max_seq_len = %d",
            room,
            max_new_tokens,
            len(ids),
            limit,
        )
        max_new_tokens = room

    device = resolve_device(config.train.device)
    with torch.device(device):
        model = build_model(config.model)
    checkpointer = CheckpointManager(config.checkpoint, str(checkpoint.parent))
    checkpointer.load_weights(str(checkpoint), model=model)
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


def refusal(message: str) -> ConfigError:
    """A ConfigError whose one line is ``message`` (no field = value form)."""
    error = ConfigError("generate", None, "a text model")
    error.args = (message,)
    return error


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


def resolve_checkpoint(given: str) -> Path:
    """The checkpoint ``given`` names: itself, or for a directory of checkpoints (one with
    ``latest`` or step_<N> entries) its newest complete one. ConfigError when missing."""
    from kempnerforge.checkpoint.layout import LATEST, MARKER, step_dirs
    from kempnerforge.checkpoint.resume import newest_complete

    path = Path(given)
    if not path.is_dir():
        raise ConfigError(
            "--checkpoint",
            given,
            "an existing checkpoint directory",
            "runs/<name>/checkpoints/step_<N>, as a run's checkpoint events name it",
        )
    if (path / MARKER).exists():
        return path
    if (path / LATEST).exists() or step_dirs(path):
        newest = newest_complete(path)
        if newest is not None:
            return Path(newest)
    return path  # loading says what it lacks


def data_starts_with_bos(data: DataConfig) -> bool | None:
    """Whether the training documents started with BOS, as the end-of-run sample decides
    it: every training source prepared with --bos (its meta.json), or data.builtin_bos for
    the built-in corpus. None when a source's meta.json cannot be read. A sharded source
    reads as its shards' common metadata."""
    from kempnerforge.core.errors import DataError
    from kempnerforge.data.shards import read_parts

    paths = [source.path for source in data.datasets] or ([data.path] if data.path else [])
    if not paths:
        return data.builtin_bos
    try:
        return all(bool(read_parts(path)[0]["bos_per_document"]) for path in paths)
    except DataError:
        return None
