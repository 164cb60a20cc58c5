"""The web demo's Starlette app: the page, ``POST /api/caption`` and what the page needs.

Every request that the user got wrong is answered 4xx with ``{"error": "<one line>"}``;
the model is shared by all requests (:class:`~captioning.api.CaptionModel` decodes one
batch at a time) and runs in the thread pool, so the event loop keeps answering.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from captioning.api import CaptionModel
from captioning.data.images import load_image_bytes
from captioning.errors import CaptioningError

logger = logging.getLogger("captioning")

HARD_CONTEXTS = ("expectation", "argmax", "sample", "marginal")
# An oversized upload is read and dropped up to this many bytes, so that the client, still
# sending, gets the 413 instead of a reset connection; past it the connection is closed.
_DRAIN_LIMIT = 64 * 2**20


class BadRequest(Exception):
    """A request the client got wrong: answered ``status`` with ``{"error": message}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class ServeSettings:
    """What the demo allows.

    Args:
        max_upload_bytes: the largest request body taken (image and form fields).
        max_beam_size: the largest beam the page and the API offer.
        examples: image files the page offers to caption (test images of the dataset).
    """

    max_upload_bytes: int = 10 * 2**20
    max_beam_size: int = 8
    examples: tuple[str, ...] = ()


def create_app(model: CaptionModel, settings: ServeSettings | None = None) -> Starlette:
    """The demo's ASGI app over ``model`` (serve it with uvicorn)."""
    settings = settings or ServeSettings()
    page = resources.files("captioning.serve").joinpath("page.html").read_text("utf-8")

    async def index(request: Request) -> Response:
        return HTMLResponse(page)

    async def info(request: Request) -> Response:
        return JSONResponse(model_info(model, settings))

    async def example(request: Request) -> Response:
        index = request.path_params["index"]
        if index >= len(settings.examples):
            raise BadRequest(404, f"no example {index}: there are {len(settings.examples)}")
        return FileResponse(settings.examples[index])

    async def caption(request: Request) -> Response:
        form = await read_form(request, settings.max_upload_bytes)
        try:
            upload = form.get("image")
            if not isinstance(upload, UploadFile):
                raise BadRequest(400, "no image: send the file in a multipart field named 'image'")
            decoding = decoding_fields(form, model, settings)
            data = await upload.read()
        finally:
            await form.close()
        picture = await run_in_threadpool(load_image_bytes, data, upload_name(upload),
                                          model.limits)  # fmt: skip
        result = await run_in_threadpool(model.caption, picture, **decoding)
        return JSONResponse(result.to_dict())

    routes = [
        Route("/", index),
        Route("/api/info", info),
        Route("/api/examples/{index:int}", example),
        Route("/api/caption", caption, methods=["POST"]),
    ]
    handlers = {
        BadRequest: _answer_bad_request,
        CaptioningError: _answer_user_error,
        HTTPException: _answer_http_error,
        Exception: _answer_server_error,
    }
    return Starlette(routes=routes, exception_handlers=handlers)


def upload_name(upload: UploadFile) -> str:
    """The upload's file name as the messages show it: no folders, one line, not too long."""
    name = " ".join(Path(upload.filename or "").name.split())
    return (name[:80] + "...") if len(name) > 80 else name or "upload"


def model_info(model: CaptionModel, settings: ServeSettings) -> dict[str, Any]:
    """What the page shows and offers for this model."""
    decode = model.config.decode
    default_beam = decode.beam_size if decode.strategy == "beam" else 1
    return {
        "checkpoint": Path(model.checkpoint or "model").name,
        "attention": "hard" if model.hard_attention else "soft",
        "grid": list(model.grid_shape),
        # the side of the square the whole image is resized to (not cropped) for the encoder
        "image_size": model.config.model.image_size,
        "beam_sizes": list(range(1, settings.max_beam_size + 1)),
        "beam_size": min(default_beam, settings.max_beam_size),
        "hard_contexts": hard_contexts(model) if model.hard_attention else [],
        "hard_context": decode.hard_context if model.hard_attention else None,
        "examples": [
            {"name": Path(path).name, "url": f"/api/examples/{i}"}
            for i, path in enumerate(settings.examples)
        ],
        "max_upload_bytes": settings.max_upload_bytes,
    }


def hard_contexts(model: CaptionModel) -> list[str]:
    """The decode modes this hard-attention model accepts (the exact marginal needs a model
    without the context in the LSTM)."""
    if model.config.model.context_to_lstm:
        return [mode for mode in HARD_CONTEXTS if mode != "marginal"]
    return list(HARD_CONTEXTS)


def decoding_fields(form: FormData, model: CaptionModel, settings: ServeSettings) -> dict[str, Any]:
    """``beam_size`` and ``hard_context`` from the form, checked; absent keeps the model's."""
    decoding: dict[str, Any] = {}
    beam = form.get("beam_size")
    if beam not in (None, ""):
        text = str(beam).strip()
        if not text.isdigit() or not 1 <= int(text) <= settings.max_beam_size:
            raise BadRequest(
                400, f"beam_size must be a whole number from 1 to {settings.max_beam_size}"
            )
        decoding["beam_size"] = int(text)
    mode = form.get("hard_context")
    if mode not in (None, "") and model.hard_attention:
        allowed = hard_contexts(model)
        if mode not in allowed:
            raise BadRequest(400, f"hard_context must be one of {', '.join(allowed)}")
        decoding["hard_context"] = mode
    return decoding


async def read_form(request: Request, limit: int) -> FormData:
    """The request's form, its body read in full only when it is within ``limit`` bytes."""
    too_large = BadRequest(
        413, f"the upload is larger than the limit of {limit / 2**20:g} MB (--max-upload-mb)"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        if int(declared) <= _DRAIN_LIMIT:
            await _drain(request)
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            await _drain(request, already=len(body))  # kept no further than the limit
            raise too_large
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": bytes(body), "more_body": False}

    try:
        return await Request(request.scope, replay).form(max_files=2, max_fields=10)
    except (MultiPartException, HTTPException) as exc:
        detail = getattr(exc, "message", None) or getattr(exc, "detail", "")
        raise BadRequest(400, f"the form cannot be read ({detail})") from exc


async def _drain(request: Request, already: int = 0) -> None:
    """Read and drop the rest of the body, up to ``_DRAIN_LIMIT`` bytes in all."""
    async for chunk in request.stream():
        already += len(chunk)
        if already > _DRAIN_LIMIT:
            return


async def _answer_bad_request(request: Request, exc: BadRequest) -> Response:
    return JSONResponse({"error": exc.message}, status_code=exc.status)


async def _answer_user_error(request: Request, exc: CaptioningError) -> Response:
    # A bad image or a decoding the model cannot do: the message already names the problem.
    return JSONResponse({"error": " ".join(str(exc).split())}, status_code=400)


async def _answer_http_error(request: Request, exc: HTTPException) -> Response:
    return JSONResponse({"error": exc.detail}, status_code=exc.status_code)


async def _answer_server_error(request: Request, exc: Exception) -> Response:
    logger.exception("unexpected error answering %s", request.url.path)
    return JSONResponse({"error": f"internal error ({type(exc).__name__})"}, status_code=500)


def example_images(model: CaptionModel, count: int = 6) -> tuple[str, ...]:
    """Up to ``count`` test images of the checkpoint's dataset, when they are on disk."""
    from captioning.data import load_splits

    try:
        test = load_splits(model.config.data).get("test", [])
    except (CaptioningError, OSError):
        return ()
    return tuple(r.path for r in test[:count] if Path(r.path).is_file())


def settings_for(
    model: CaptionModel, max_upload_mb: float, examples: Sequence[str] | None = None
) -> ServeSettings:
    """Settings with an upload limit in MB and, unless given, the dataset's test images."""
    found = example_images(model) if examples is None else tuple(examples)
    return ServeSettings(max_upload_bytes=int(max_upload_mb * 2**20), examples=found)
