"""kempnerforge: fault-tolerant distributed training of foundation models in plain PyTorch."""

__version__ = "0.1.0"
