"""Show, Attend and Tell: soft and hard visual-attention image captioning in PyTorch."""

__version__ = "0.1.0"
