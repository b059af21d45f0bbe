"""lm-evaluation-harness over a kempnerforge checkpoint, without exporting it: the
harness's model class (KempnerForgeLM), its registration as "kempnerforge", and a
command line that registers it before handing over to the harness's own.

Needs the optional lm-eval package (pip install kempnerforge[lm-eval]); nothing imports
this module on `import kempnerforge`. The harness's own `lm_eval` program cannot find
models outside its package, so the command line is

    python -m kempnerforge.interop.lm_eval --model kempnerforge \\
        --model_args config=runs/x/config.toml,checkpoint=runs/x/checkpoints/step_N --tasks ...

and a Python caller runs ``register()`` before ``lm_eval.simple_evaluate(model="kempnerforge",
...)``, or passes a KempnerForgeLM instance as the model.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, Self

from lm_eval.api.model import LM
from lm_eval.api.registry import get_model, register_model
from lm_eval.utils import (
    get_rolling_token_windows,
    make_disjoint_window,
    simple_parse_args_string,
)

from kempnerforge.core.logging import get_logger
from kempnerforge.interop.lm_eval_requests import (
    TextModel,
    generate_until,
    load_text_model,
    loglikelihoods,
    rolling_loglikelihoods,
    split_overrides,
)

logger = get_logger(__name__)

MODEL_NAME = "kempnerforge"
"""The name `--model` takes in the harness."""
DEFAULT_BATCH_ROWS = 8
"""Windows of train.seq_len tokens per forward unless batch_size says otherwise."""
DEFAULT_MAX_GEN_TOKS = 256
"""New tokens at most per generate_until request unless the task says otherwise."""


class KempnerForgeLM(LM):
    """A kempnerforge checkpoint as an lm-evaluation-harness model, in one process.

    Model args (``--model_args key=value,...``): ``config`` the run's TOML (default: the
    run directory's config.toml, else the one the checkpoint records), ``checkpoint`` a
    step_<N> directory, its checkpoints directory or the run directory (the newest
    complete checkpoint), or any of these in a store (s3://bucket/prefix/step_<N>, the
    prefix or its latest), ``overrides`` config overrides as shell words, ``device``
    (default cpu), ``batch_size`` windows per forward (default 8; "auto" takes the
    default), ``max_gen_toks`` (default 256).
    """

    def __init__(
        self,
        checkpoint: str = "",
        config: str = "",
        overrides: str | Sequence[str] | None = None,
        device: str | None = "cpu",
        batch_size: int | str | None = DEFAULT_BATCH_ROWS,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        max_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        del max_batch_size  # the harness passes it for its own batch search; rows are fixed
        if not checkpoint:
            raise ValueError("model_args needs checkpoint=<a checkpoint or run directory>")
        self.lm: TextModel = load_text_model(
            str(config or ""),
            str(checkpoint),
            split_overrides(overrides),
            str(device or "cpu"),
            batch_rows(batch_size),
        )
        self.max_gen_toks = int(max_gen_toks)
        self._device = self.lm.device
        self._greedy_warned = False

    @classmethod
    def create_from_arg_obj(
        cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None
    ) -> Self:
        """The model of ``arg_dict`` (model_args). The harness adds its own --batch_size
        and --device to every model (1 and cuda:0 unless given); a model arg of the same
        name wins over them instead of clashing with them."""
        given = additional_config or {}
        extra = {k: v for k, v in given.items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(
        cls, arg_string: str, additional_config: dict[str, Any] | None = None
    ) -> Self:
        """The model of ``arg_string`` ("key=value,..."), as create_from_arg_obj."""
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        """(log-likelihood of the continuation, greedy?) per (context, continuation)."""
        pairs = [(str(r.args[0]), str(r.args[1])) for r in requests]
        results = loglikelihoods(self.lm, pairs)
        for pair, result in zip(pairs, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", pair, result)
        return results

    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        """The whole text's log-likelihood per (text,), in the harness's disjoint windows
        (harness_windows), as its other models read it."""
        texts = [str(r.args[0]) for r in requests]
        results = rolling_loglikelihoods(self.lm, texts, harness_windows)
        for text, result in zip(texts, results, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), result)
        return results

    def generate_until(self, requests: list[Any]) -> list[str]:
        """The greedy continuation per (context, generation kwargs), cut at a stop string."""
        results = []
        for request in requests:
            context, kwargs = str(request.args[0]), dict(request.args[1] or {})
            until, max_gen_toks = self._generation_limits(kwargs)
            text = generate_until(self.lm, context, until, max_gen_toks)
            self.cache_hook.add_partial("generate_until", request.args, text)
            results.append(text)
        return results

    def _generation_limits(self, kwargs: dict[str, Any]) -> tuple[list[str], int]:
        """The stop strings and the new-token limit of one request's generation kwargs;
        warns once when they ask for sampling, since decoding here is greedy."""
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else [str(s) for s in until]
        limit = kwargs.get("max_gen_toks", kwargs.get("max_new_tokens", self.max_gen_toks))
        sampling = kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0
        if sampling and not self._greedy_warned:
            logger.warning("kempnerforge decodes greedily: do_sample and temperature are ignored")
            self._greedy_warned = True
        return until, int(limit)


def harness_windows(
    tokens: list[int], prefix: int, seq_len: int
) -> list[tuple[list[int], list[int]]]:
    """The (context, continuation) pairs the harness's models score a whole text in: its
    rolling windows of seq_len tokens after ``prefix``, made disjoint (each continuation is
    the next tokens, its context only the token before them but in the last window), as
    its Hugging Face model calls them."""
    rolling = get_rolling_token_windows(
        token_list=tokens, prefix_token=prefix, max_seq_len=seq_len, context_len=1
    )
    return [make_disjoint_window(window) for window in rolling]


def batch_rows(batch_size: int | str | None) -> int:
    """Windows per forward from the harness's batch_size: an integer >= 1, or the default
    for None and "auto" (rows of packed requests need no search for a size that fits)."""
    if batch_size is None or str(batch_size).startswith("auto"):
        return DEFAULT_BATCH_ROWS
    rows = int(batch_size)
    if rows < 1:
        raise ValueError(f"batch_size = {batch_size}: expected an integer >= 1 or 'auto'")
    return rows


def register() -> None:
    """Make "kempnerforge" a model name of the harness (idempotent)."""
    if get_model_or_none(MODEL_NAME) is not KempnerForgeLM:
        register_model(MODEL_NAME)(KempnerForgeLM)


def get_model_or_none(name: str) -> type | None:
    """The harness's model class named ``name``; None when it has none."""
    try:
        return get_model(name)
    except ValueError:
        return None


def main(argv: Sequence[str] | None = None) -> None:
    """The harness's command line with "kempnerforge" registered."""
    from lm_eval.__main__ import cli_evaluate

    register()
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
