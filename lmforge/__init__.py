"""lmforge: from raw text to a trained, served language model on plain PyTorch."""

__version__ = "0.1.0"
