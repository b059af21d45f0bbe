"""End to end: `kempnerforge check-parallel` trains each published family's decoder options
(the tiny debug model with them set) under FSDP, tensor, pipeline and context parallelism,
one invocation per family, and compares them with one process."""

from __future__ import annotations

import pytest

from tests.e2e.test_check_parallel import assert_every_layout_passes, check_parallel

pytestmark = pytest.mark.slow

FAMILIES = {
    # Per-head query and key norms, 4 heads of 32 (twice dim 64). Untied, as Qwen3 4B and
    # up are: pipeline stages refuse a tied head (the embedding and the head live on
    # different stages), so the small sizes' tied head trains on the other layouts only.
    "qwen3": ["--model.qk_norm=per_head", "--model.head_size=32", "--model.n_kv_heads=2"],
    # A window of 8 of the 32 positions on every layer, over packed documents.
    "mistral": ["--model.sliding_window=8", "--model.n_kv_heads=2"],
    # Norms after each sublayer; query and key norms whose mean square spans the tp shards.
    "olmo2": ["--model.qk_norm=projection", "--model.norm_placement=post", "--model.n_kv_heads=2"],
}
WORLDS = {"dp_shard=2": "2", "tp=2": "2", "pp=2": "2", "cp=2": "2"}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_layouts_match_one_process(family, tmp_path, builtin_cache):
    args = ["--layouts", *WORLDS, "--steps", "3", *FAMILIES[family]]
    proc = check_parallel(*args, cwd=tmp_path, cache=builtin_cache)
    assert_every_layout_passes(proc, WORLDS)
