"""The web demo (``captioning serve``): a page and a JSON API over one loaded model.

Needs the ``serve`` extra (``pip install -e .[serve]``: Starlette, uvicorn,
python-multipart); :func:`require` says so in one line when it is missing.
"""

from __future__ import annotations

from captioning.errors import CaptioningError


def require() -> None:
    """Raise a one-line :class:`CaptioningError` when the ``serve`` extra is not installed."""
    try:
        import multipart  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise CaptioningError(
            f"the web demo needs the serve extra ({exc.name} is missing): pip install -e '.[serve]'"
        ) from exc
