"""Decoding: greedy samples during training, and sampled generation with a KV cache.

generate_greedy re-runs a window of the sequence per token through the model's own
forward, so it works on any model (sharded, vision-language with a custom forward); the
end-of-run sample uses it. generate decodes a whole Transformer on one device with a key/
value cache (model/generation/kv_cache.py) and samples with temperature, top-k and top-p from its
own seeded generator. Neither changes the routers' training statistics of an MoE model.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Collection, Iterator

import torch
from torch import nn

from kempnerforge.model.generation.kv_cache import KVCache, check_whole_model, forward_cached
from kempnerforge.model.moe import MoEFeedForward
from kempnerforge.model.transformer import Transformer


def generate_greedy(
    model: nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    max_seq_len: int,
    stop_id: int | None = None,
    forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[int]:
    """Append the argmax token max_new_tokens times; return only the new tokens.

    There is no KV cache: each step re-runs the last max_seq_len tokens, which is fine for a
    few hundred tokens on a small model. Decoding stops early after producing stop_id, which
    is not included in the result. The model runs in eval mode under no_grad, and its
    training mode is restored afterwards, also on error. One host sync per new token.
    ``forward`` maps a window of ids (1, seq) to logits (1, seq, vocab); by default
    ``model(window)``, a vision-language model passes one that also feeds its image.
    MoE layers keep the router statistics of their last training forward.
    """
    if not prompt_ids:
        raise ValueError("generate_greedy needs a non-empty prompt")
    device = next(model.parameters()).device
    logits_of = forward or model
    tokens = list(prompt_ids)
    new_tokens: list[int] = []
    with eval_mode(model), torch.no_grad():
        for _ in range(max_new_tokens):
            window = torch.tensor([tokens[-max_seq_len:]], dtype=torch.long, device=device)
            next_id = int(logits_of(window)[0, -1].argmax())
            if next_id == stop_id:
                break
            tokens.append(next_id)
            new_tokens.append(next_id)
    return new_tokens


def generate(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_id: int | None = None,
    seed: int | None = None,
    use_cache: bool = True,
    stop_when: Callable[[list[int]], bool] | None = None,
    stop_ids: Collection[int] = (),
) -> list[int]:
    """Continue ``prompt_ids`` by up to max_new_tokens sampled tokens; return the new ones.

    Each token is drawn by sample_token (temperature, top_k, top_p; temperature 0 is
    greedy) from a CPU torch.Generator seeded with ``seed``, so a seed repeats its tokens
    whatever the device (None draws a fresh seed). Decoding stops early after producing
    stop_id or any of ``stop_ids`` (a chat's end-of-turn tokens and EOS), which is not
    included, or once ``stop_when(new tokens so far)`` is true (the
    token that made it true is kept: a stop string may end inside it). The prompt and the
    new tokens must fit in model.cfg.max_seq_len together (a ValueError says how many new
    tokens fit).

    With ``use_cache`` the prompt runs through the model once and every new token once
    more, attending to the cached keys and values (forward_cached); the model must be
    whole on one device. Without it each step re-runs the whole sequence through the
    model's forward: slower, for checking the cache. Both give the same logits, to fp32
    rounding, unless MoE blocks have a capacity limit (the cached path never drops an
    assignment). The model runs in eval mode under no_grad and gets its training mode
    back afterwards; MoE layers keep the router statistics of their last training
    forward. One host sync per new token.
    """
    check_sampling(temperature, top_k, top_p)
    check_length(prompt_ids, max_new_tokens, model.cfg.max_seq_len)
    if max_new_tokens == 0:
        return []
    generator = seeded_generator(seed)
    device = next(model.parameters()).device
    cache = None
    if use_cache:
        check_whole_model(model)
        cache = KVCache.for_model(model, len(prompt_ids) + max_new_tokens)
    stops = {*stop_ids, *([] if stop_id is None else [stop_id])}
    tokens = list(prompt_ids)
    pending = list(prompt_ids)  # not yet in the cache
    new_tokens: list[int] = []
    with eval_mode(model), torch.no_grad():
        for _ in range(max_new_tokens):
            if cache is not None:
                ids = torch.tensor([pending], dtype=torch.long, device=device)
                logits = forward_cached(model, ids, cache, last_only=True)[0, -1]
            else:
                output = model(torch.tensor([tokens], dtype=torch.long, device=device))
                assert isinstance(output, torch.Tensor)
                logits = output[0, -1]
            next_id = sample_token(
                logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
            )
            if next_id in stops:
                break
            tokens.append(next_id)
            new_tokens.append(next_id)
            pending = [next_id]
            if stop_when is not None and stop_when(new_tokens):
                break
    return new_tokens


def check_length(prompt_ids: list[int], max_new_tokens: int, limit: int) -> None:
    """Refuse an empty prompt, a negative count, or a prompt and new tokens that do not fit in
    ``limit`` (model.max_seq_len) together; the ValueError says how many new tokens fit."""
    if not prompt_ids:
        raise ValueError("generate needs a non-empty prompt")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens = {max_new_tokens}: expected >= 0")
    if len(prompt_ids) + max_new_tokens > limit:
        room = limit - len(prompt_ids)
        fits = f"at most {room} new tokens fit" if room > 0 else "no new token fits"
        raise ValueError(
            f"a prompt of {len(prompt_ids)} tokens plus {max_new_tokens} new tokens exceeds "
            f"model.max_seq_len = {limit}: {fits}"
        )


def seeded_generator(seed: int | None) -> torch.Generator:
    """A CPU generator seeded with ``seed``, or with a fresh seed when it is None."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Raise ValueError unless temperature >= 0, top_k >= 0 and 0 < top_p <= 1."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature = {temperature}: expected a number >= 0 (0 is greedy)")
    if top_k < 0:
        raise ValueError(f"top_k = {top_k}: expected >= 0 (0 keeps every token)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p = {top_p}: expected 0 < top_p <= 1 (1 keeps every token)")


def sample_token(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> int:
    """One token id drawn from the logits (vocab,) of the next position.

    temperature 0 (or top_k 1) takes the argmax, the first one on a tie. Otherwise the
    logits are divided by temperature; top_k > 0 keeps the k highest; top_p < 1 keeps the
    smallest set of the highest-probability tokens whose probability sums to at least
    top_p (nucleus sampling; the most likely token is always kept); the token is drawn
    from the softmax of what is kept, by ``generator`` (a CPU generator). Computed in fp32
    on the CPU, so a generator's seed gives the same draw whatever the model's device.
    """
    scores = logits.detach().float().cpu().reshape(-1)
    if temperature == 0 or top_k == 1:
        return int(scores.argmax())
    # Shifted so the largest is 0: a small temperature cannot overflow it to infinity.
    scores = (scores - scores.max()) / temperature
    if 0 < top_k < scores.numel():
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if top_p < 1:
        ranked, order = torch.sort(scores, descending=True, stable=True)
        probs = torch.softmax(ranked, dim=0)
        mass_before = probs.cumsum(0) - probs
        scores = scores.index_fill(0, order[mass_before >= top_p], -math.inf)
    probs = torch.softmax(scores, dim=0)
    return int(torch.multinomial(probs, 1, generator=generator))


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode for the block, the training mode restored after it (also on error); the
    MoE layers' last router statistics (``last``) are put back as well, so a forward run
    for decoding adds nothing to a training step's router bookkeeping."""
    was_training = model.training
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    saved = [layer.last for layer in layers]
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
        for layer, last in zip(layers, saved, strict=True):
            layer.last = last
