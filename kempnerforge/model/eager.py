"""``run_eagerly``: a function a compiled block calls around, not through (a graph break).

``torch.compiler.disable`` does this, but applying it imports the whole compiler stack
(about 0.6 s of CPU), which every process importing the model would then pay although
most never compile. ``run_eagerly`` applies it on the first call made while compiling,
so only a compiled run pays, and only once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch

_P = ParamSpec("_P")
_R = TypeVar("_R")


def run_eagerly(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn``, run eagerly when a compiled block calls it: the call is a graph break and
    ``fn``'s body is not traced (point-to-point sends, ops whose compiler rules are
    narrower than their kernels). Outside compilation it is a plain call."""
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if not disabled:  # the compiler runs this line eagerly too (a graph break)
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return call
