"""A process that builds a model but never compiles never imports the compiler stack
(torch._dynamo, about 0.6 s of CPU at every start): the model's modules, a build on the
meta device and a materialised model all leave it out; compiling still graph-breaks
around the functions marked to run eagerly (tests/unit/test_moe.py,
tests/distributed/test_ring_attention.py)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import torch

from kempnerforge.config.model import ModelConfig
from kempnerforge.model.meta import on_meta
from kempnerforge.model.transformer import Transformer

REPO = pathlib.Path(__file__).parents[2]

PROBE = """
import sys
import kempnerforge.training.loop, kempnerforge.training.build, kempnerforge.commands.train
from kempnerforge.config.model import ModelConfig
from kempnerforge.model.meta import on_meta
from kempnerforge.model.transformer import Transformer
cfg = ModelConfig(dim=32, n_layers=2, n_heads=2, num_experts=4, moe_top_k=2,
                  moe_frequency=2, sliding_window=4, sliding_window_pattern=2)
with on_meta():
    meta = Transformer(cfg)
model = Transformer(cfg)
print(sorted(m for m in sys.modules if m.startswith("torch._dynamo")))
"""


def test_building_a_model_leaves_the_compiler_unimported():
    result = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_a_model_built_on_meta_has_every_shape_and_no_storage():
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=2, vocab_size=64, num_experts=4, moe_top_k=2)
    with on_meta():
        meta = Transformer(cfg)
    real = Transformer(cfg)
    shapes = {name: (p.shape, p.dtype) for name, p in real.state_dict().items()}
    assert {name: (p.shape, p.dtype) for name, p in meta.state_dict().items()} == shapes
    assert all(p.is_meta for p in meta.state_dict().values())
    # Outside on_meta, initialisers run as before.
    weight = torch.empty(4, 4)
    torch.nn.init.ones_(weight)
    assert torch.equal(weight, torch.ones(4, 4))
