"""The web demo (``captioning serve``): a page and a JSON API over one loaded model.

Needs the ``serve`` extra (``pip install -e .[serve]``: Starlette, uvicorn,
python-multipart); :func:`require` says so in one line when it is missing.
"""

from __future__ import annotations

import importlib.util

from captioning.errors import CaptioningError


def require() -> None:
    """Raise a one-line :class:`CaptioningError` when the ``serve`` extra is not installed."""
    # python-multipart is imported as python_multipart since 0.0.13, as multipart before
    wanted = {
        "starlette": ["starlette"],
        "uvicorn": ["uvicorn"],
        "python-multipart": ["python_multipart", "multipart"],
    }
    for package, modules in wanted.items():
        if not any(_importable(module) for module in modules):
            raise CaptioningError(
                f"the web demo needs the serve extra ({package} is missing): "
                "pip install -e '.[serve]'"
            )


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules
        return False
