"""End to end: `kempnerforge check-parallel` trains each published family's decoder options
(the tiny debug model with them set) under FSDP, tensor, pipeline and context parallelism,
and an MoE family also under expert parallelism, one invocation per family, and compares
them with one process."""

from __future__ import annotations

import pytest

from tests.e2e.test_check_parallel import assert_every_layout_passes, check_parallel
from tests.support.family_options import FAMILY_OPTIONS

pytestmark = pytest.mark.slow

WORLDS = {"dp_shard=2": "2", "tp=2": "2", "pp=2": "2", "cp=2": "2"}
MOE_WORLDS = {"dp_shard=2": "2", "tp=2": "2", "pp=2": "2", "cp=2": "2", "dp_shard=2,ep=2": "2"}
"""An MoE model's layouts: tp splits each expert's hidden features (and the attention's
heads, latent attention's included), ep the experts over data-parallel ranks."""


OWN_WORLDS = {"deepseek_v3": {"cp=2,ring=2": "2"}}
"""Layouts a family adds: latent attention's keys and values (a latent and a shared RoPE
key, expanded per head) passed around a ring of context-parallel ranks."""

FAMILIES = {
    name: (
        options.args,
        options.config,
        {**(MOE_WORLDS if options.is_moe else WORLDS), **OWN_WORLDS.get(name, {})},
    )
    for name, options in FAMILY_OPTIONS.items()
}
"""Each family's decoder options (tests/support/family_options.py), the debug run they
shrink and the layouts it is checked under."""


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_layouts_match_one_process(family, tmp_path, builtin_cache):
    args, config, worlds = FAMILIES[family]
    proc = check_parallel(
        "--layouts",
        *worlds,
        "--steps",
        "3",
        *args,
        cwd=tmp_path,
        cache=builtin_cache,
        config=config,
    )
    assert_every_layout_passes(proc, worlds)
