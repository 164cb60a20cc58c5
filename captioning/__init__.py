"""Show, Attend and Tell: soft and hard visual-attention image captioning in PyTorch.

``captioning.load(checkpoint)`` gives a :class:`~captioning.api.CaptionModel`; see
:mod:`captioning.api`. Importing the package itself stays cheap: torch is imported on first
use of the API.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Caption", "CaptionModel", "Failed", "load"]

if TYPE_CHECKING:
    from captioning.api import Caption, CaptionModel, Failed, load


def __getattr__(name: str) -> Any:
    if name in __all__:
        from captioning import api

        return getattr(api, name)
    raise AttributeError(f"module 'captioning' has no attribute {name!r}")
