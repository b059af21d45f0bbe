"""``on_meta``: build modules on the meta device without running their initialisers.

A module built under ``torch.device("meta")`` still runs its constructor's initialisers
(``reset_parameters``: ``nn.init.normal_`` and the like) on tensors that hold no values.
That computes nothing, yet the meta kernels of the random initialisers import the whole
compiler stack on first use (about 0.6 s of CPU in every process that builds a model).
The weights are filled later anyway, from the seed (``init_weights``) or from a
checkpoint, so ``on_meta`` makes those calls return their tensor untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_INITIALISERS = frozenset(
    [
        *(
            getattr(torch.nn.init, name)
            for name in dir(torch.nn.init)
            if name.endswith("_") and not name.startswith("_")
        ),
        torch.Tensor.normal_,
        torch.Tensor.uniform_,
        torch.Tensor.zero_,
        torch.Tensor.fill_,
    ]
)
"""In-place initialisers: torch.nn.init's public ones and the tensor methods they call."""


class _SkipMetaInitialisers(TorchFunctionMode):
    """An initialiser called on a meta tensor returns that tensor; every other call runs."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _INITIALISERS:
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """``torch.device("meta")`` for building modules: their tensors have shapes and dtypes
    but no storage, and their constructors' initialisers are skipped (see the module
    docstring). Fill the weights afterwards (``to_empty`` then ``init_weights``, or a
    checkpoint)."""
    with torch.device("meta"), _SkipMetaInitialisers():
        yield
