"""The web demo's Starlette app: the page, ``POST /api/caption`` and what the page needs.

Every request that the user got wrong is answered 4xx with ``{"error": "<one line>"}``, and
one the server cannot take now 503 with ``Retry-After``. The work a caption request causes
is bounded:

- at most ``max_in_flight`` requests are worked on at once and ``max_queue`` wait for a
  slot (their uploads unread); one more is refused at once (:class:`~.limits.Admission`);
- each has ``timeout`` seconds from its arrival to its answer;
- its upload is parsed as it arrives (a file part past 1 MB goes to a temporary file), then
  decoded and reduced to the model's input size in the thread pool, with the pixels being
  decoded at once bounded by the largest image taken (:class:`~.limits.PixelBudget`; a
  progressive JPEG counts its whole-image buffers, :mod:`~.jpeg`), so that a request
  waiting for the model holds a small tensor;
- concurrent requests are captioned together in one batched decoding
  (:class:`~.batching.Batcher`), and one whose client has gone is dropped before its batch;
- its slot is taken until its work has ended: a decoding runs to its end before the
  request is answered, and a batch that has started holds its requests' slots until it
  ends, even when they were answered 503 at their deadline or their clients have gone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import anyio
import torch
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from captioning.api import Caption, CaptionModel
from captioning.data.images import ImageLimits, load_image_bytes
from captioning.errors import CaptioningError
from captioning.serve.batching import Batcher
from captioning.serve.jpeg import whole_image_jpeg
from captioning.serve.limits import Admission, Busy, PixelBudget, Slot, demo_image_limits
from captioning.serve.origins import (
    GuardMiddleware,
    HostAllowList,
    example_images,
    guarded,
    page_policy,
    read_example,
)

logger = logging.getLogger("captioning")

HARD_CONTEXTS = ("expectation", "argmax", "sample", "marginal")
# An oversized upload is read and dropped up to this many bytes, so that the client, still
# sending, gets the 413 instead of a reset connection; past it the connection is closed.
_DRAIN_LIMIT = 64 * 2**20
# What a 503 tells the client to wait before it tries again, in seconds.
RETRY_AFTER = 1
# What the pixel budget counts a pixel as: Pillow holds an RGB picture in 4 bytes a pixel.
_BYTES_PER_PIXEL = 4
# beam_size as the form sends it: a few ASCII digits.
_WHOLE_NUMBER = re.compile(r"[0-9]{1,4}")
T = TypeVar("T")


class BadRequest(Exception):
    """A request the client got wrong: answered ``status`` with ``{"error": message}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


@dataclass(frozen=True)
class ServeSettings:
    """What the demo allows.

    Args:
        max_upload_bytes: the largest request body taken (image and form fields).
        max_beam_size: the largest beam the page and the API offer.
        examples: image files the page offers to caption (test images of the dataset).
        max_in_flight: caption requests read, decoded or captioned at once.
        max_queue: caption requests that may wait for one of those slots; past it, 503.
        timeout: seconds from a request's arrival to its answer; past it, 503.
        max_batch: the most images captioned together.
        batch_wait: seconds the model waits for more images once one has come, while other
            requests are on their way.
        example_boxes: per example, the boxes of its annotated objects (see
            :class:`~.origins.Example`), which the page outlines for the word that names them.
        category_words: word to object category (:mod:`captioning.metrics.words`).
        hosts: the ``Host`` headers answered (others get 421).
        max_progressive_pixels: the largest JPEG taken that is decoded through whole-image
            buffers (progressive, :mod:`~.jpeg`): 16M pixels hold 96 MB of them in colour.
    """

    max_upload_bytes: int = 10 * 2**20
    max_beam_size: int = 8
    examples: tuple[str, ...] = ()
    example_boxes: tuple[tuple[tuple[str, tuple[float, ...]], ...], ...] = ()
    category_words: dict[str, str] = field(default_factory=dict)
    max_in_flight: int = 32
    max_queue: int = 256
    timeout: float = 30.0
    max_batch: int = 16
    batch_wait: float = 0.005
    hosts: HostAllowList = field(default_factory=HostAllowList)
    max_progressive_pixels: int = 16_000_000


def create_app(model: CaptionModel, settings: ServeSettings | None = None) -> Starlette:
    """The demo's ASGI app over ``model`` (serve it with uvicorn). Its ``state`` holds the
    ``batcher`` (with its stats) and the ``admission``."""
    settings = settings or ServeSettings()
    page = resources.files("captioning.serve").joinpath("page.html").read_text("utf-8")
    policy = {"Content-Security-Policy": page_policy(page)}
    captioning = CaptionEndpoint(model, settings)
    pinned = [os.path.realpath(path) for path in settings.examples]  # where each led at start

    async def index(request: Request) -> Response:
        return HTMLResponse(page, headers=policy)

    async def info(request: Request) -> Response:
        return JSONResponse(model_info(model, settings))

    async def example(request: Request) -> Response:
        # read as text: Starlette's int convertor turns 5,000 digits into a ValueError (a 500)
        name = request.path_params["index"]
        if not (name.isascii() and name.isdigit() and len(name) <= 9):
            raise BadRequest(404, f"no example {name[:20]!r}: examples are numbered from 0")
        index = int(name)
        if index >= len(settings.examples):
            raise BadRequest(404, f"no example {index}: there are {len(settings.examples)}")
        found = await run_in_threadpool(read_example, settings.examples[index], pinned[index])
        if found is None:
            raise BadRequest(404, f"example {index} is no longer an image on disk")
        content, media_type = found
        return Response(content, media_type=media_type)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await run_in_threadpool(captioning.batcher.close)

    routes = [
        Route("/", index),
        Route("/api/info", info),
        Route("/api/examples/{index}", example),
        Route("/api/caption", captioning.answer, methods=["POST"]),
    ]
    middleware = [Middleware(GuardMiddleware, hosts=settings.hosts)]
    app = Starlette(
        routes=routes,
        exception_handlers=EXCEPTION_HANDLERS,
        middleware=middleware,
        lifespan=lifespan,
    )
    app.state.batcher = captioning.batcher
    app.state.admission = captioning.admission
    return app


class CaptionEndpoint:
    """``POST /api/caption`` with its limits: the admission of requests, the pixel budget
    of their decoding and the batcher of their captioning.

    Args:
        model: the loaded model.
        settings: the demo's limits.
    """

    def __init__(self, model: CaptionModel, settings: ServeSettings) -> None:
        self.model = model
        self.settings = settings
        self.limits = demo_image_limits(model)
        self.admission = Admission(in_flight=settings.max_in_flight, queue=settings.max_queue)
        self.batcher = Batcher(model, max_batch=settings.max_batch, wait=settings.batch_wait)
        self.budget = PixelBudget(self.limits.max_pixels)

    async def answer(self, request: Request) -> Response:
        """The caption of the uploaded image, within the limits (else 503)."""
        timeout = self.settings.timeout
        deadline = time.monotonic() + timeout
        async with self.admission.slot(timeout) as slot:
            try:
                with anyio.fail_after(max(deadline - time.monotonic(), 0.0)):
                    result = await self.caption_upload(request, slot, deadline)
            except TimeoutError:
                raise Busy(
                    f"the server could not answer within {timeout:g} s (--timeout); "
                    "try again in a moment"
                ) from None
        return JSONResponse(result.to_dict())

    async def caption_upload(self, request: Request, slot: Slot, deadline: float) -> Caption:
        """Read the form, decode the image in the thread pool, caption it in a batch."""
        with self.batcher.coming() as submit:
            form = await read_form(request, self.settings.max_upload_bytes)
            try:
                upload = form.get("image")
                if not isinstance(upload, UploadFile):
                    raise BadRequest(
                        400, "no image: send the file in a multipart field named 'image'"
                    )
                decoding = decoding_fields(form, self.model, self.settings)
                key = (decoding.get("beam_size"), decoding.get("hard_context"))
                reserve = partial(self.budget.reserve, deadline=deadline)
                prepare = partial(
                    prepare_upload,
                    self.model,
                    upload.file,
                    upload_name(upload),
                    self.limits,
                    reserve,
                    self.settings.max_progressive_pixels,
                )
                # Runs to its end, past the deadline too (the budget's wait stops there): the
                # file it reads is closed only after, and the slot stays taken meanwhile.
                inputs = await run_in_threadpool(prepare)  # (3, S, S)
                captioned = submit(inputs, key)
                slot.hold_until(captioned)  # a batch that has started runs to its end
                return await unless_gone(request.receive, captioned)
            finally:
                with anyio.CancelScope(shield=True):  # past the deadline too: no temp file left
                    await form.close()


def prepare_upload(
    model: CaptionModel,
    file: BinaryIO,
    name: str,
    limits: ImageLimits,
    reserve: Callable[[int], AbstractContextManager],
    max_progressive_pixels: int,
) -> torch.Tensor:
    """An upload as the model's input, uint8 (3, S, S): decoded within the pixels
    ``reserve`` grants (see :func:`~captioning.data.images.load_image_bytes`), a JPEG's
    whole-image buffers counted in them, and reduced on the way.

    Raises:
        BadRequest: a JPEG decoded through whole-image buffers (progressive) declares more
            than ``max_progressive_pixels``.
    """
    whole = whole_image_jpeg(file)
    buffers = 0
    if whole is not None:
        if whole.pixels > max_progressive_pixels:
            raise BadRequest(
                400,
                f"{name}: a progressive JPEG is decoded whole, and this one "
                f"is {whole.width} x {whole.height} = {whole.pixels:,} pixels, "
                f"more than the {max_progressive_pixels:,} the demo decodes "
                "that way; resize it or save it as a baseline JPEG",
            )
        buffers = -(-whole.buffer_bytes // _BYTES_PER_PIXEL)

    def reserve_with_buffers(pixels: int) -> AbstractContextManager:
        return reserve(pixels + buffers)

    picture = load_image_bytes(
        file, name, limits, reduce_to=model.input_size, reserve=reserve_with_buffers
    )
    return model.prepare(picture)


async def unless_gone(receive: Callable[[], Awaitable[dict]], future: Future[T]) -> T:
    """``future``'s result; :class:`ClientGone` as soon as the client disconnects, and then
    ``future`` is cancelled (a batch that has not started drops it). Call it once the
    request body has been read."""

    async def disconnected() -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:  # the connection cannot be read: nobody is there to answer
            return

    answer = asyncio.wrap_future(future)
    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        answer.cancel()  # no-op once done; else also cancels ``future``
    if answer.done() and not answer.cancelled():
        return answer.result()
    raise ClientGone()


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
            {"name": Path(path).name, "url": f"/api/examples/{i}", **_boxes(settings, i)}
            for i, path in enumerate(settings.examples)
        ],
        "category_words": _category_words(model, settings),
        "max_upload_bytes": settings.max_upload_bytes,
    }


def _boxes(settings: ServeSettings, index: int) -> dict[str, Any]:
    """``{"boxes": [{"category", "box"}, ...]}`` of example ``index`` when it has objects."""
    if index >= len(settings.example_boxes) or not settings.example_boxes[index]:
        return {}
    boxes = settings.example_boxes[index]
    return {"boxes": [{"category": c, "box": [round(v, 5) for v in box]} for c, box in boxes]}


def _category_words(model: CaptionModel, settings: ServeSettings) -> dict[str, str]:
    """The words of the model's vocabulary that name a category, when an example has boxes."""
    if not any(settings.example_boxes):
        return {}
    words = settings.category_words
    return {w: words[w] for w in model.vocab.itos if w in words}


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
        if not _WHOLE_NUMBER.fullmatch(text) or not 1 <= int(text) <= settings.max_beam_size:
            raise BadRequest(
                400, f"beam_size must be a whole number from 1 to {settings.max_beam_size}"
            )
        decoding["beam_size"] = int(text)
    else:  # the model's own, within what the page offers
        decode = model.config.decode
        if decode.strategy == "beam" and decode.beam_size > settings.max_beam_size:
            decoding["beam_size"] = settings.max_beam_size
    mode = form.get("hard_context")
    if mode not in (None, "") and model.hard_attention:
        allowed = hard_contexts(model)
        if mode not in allowed:
            raise BadRequest(400, f"hard_context must be one of {', '.join(allowed)}")
        decoding["hard_context"] = mode
    return decoding


async def read_form(request: Request, limit: int) -> FormData:
    """The request's multipart form, parsed as it arrives, the body kept no further than
    ``limit`` bytes (a file part past 1 MB is held in a temporary file, not in memory)."""
    too_large = BadRequest(
        413, f"the upload is larger than the limit of {limit / 2**20:g} MB (--max-upload-mb)"
    )
    body = _Body(request.receive)
    declared = request.headers.get("content-length", "")
    if re.fullmatch(r"[0-9]{1,20}", declared) and int(declared) > limit:
        if int(declared) <= _DRAIN_LIMIT:
            await body.drain()
        raise too_large
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        return FormData()
    parser = MultiPartParser(request.headers, body.chunks(limit), max_files=2, max_fields=10)
    try:
        return await parser.parse()
    except _TooLarge:
        await body.drain()  # kept no further than the limit
        raise too_large from None
    except (MultiPartException, HTTPException, ValueError) as exc:
        # python-multipart's own errors are ValueErrors (FormParserError)
        detail = getattr(exc, "message", None) or getattr(exc, "detail", None) or exc
        raise BadRequest(400, f"the form cannot be read ({' '.join(str(detail).split())})") from exc


class _TooLarge(Exception):
    """The body went past the upload limit while it was read."""


class _Body:
    """A request body read from the ASGI ``receive`` as it arrives, its bytes counted."""

    def __init__(self, receive: Callable[[], Awaitable[dict]]) -> None:
        self.receive = receive
        self.received = 0
        self.ended = False

    async def chunks(self, limit: int | None = None) -> AsyncIterator[bytes]:
        """The body's chunks; :class:`_TooLarge` once more than ``limit`` bytes came."""
        while not self.ended:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            self.ended = not message.get("more_body", False)
            chunk = message.get("body", b"")
            self.received += len(chunk)
            if limit is not None and self.received > limit:
                raise _TooLarge()
            if chunk:
                yield chunk

    async def drain(self) -> None:
        """Read and drop the rest of the body, up to ``_DRAIN_LIMIT`` bytes in all, so that
        a client still sending gets the answer instead of a reset connection."""
        async for _ in self.chunks():
            if self.received > _DRAIN_LIMIT:
                return


async def _answer_bad_request(request: Request, exc: BadRequest) -> Response:
    return JSONResponse({"error": exc.message}, status_code=exc.status)


async def _answer_busy(request: Request, exc: Busy) -> Response:
    return JSONResponse(
        {"error": str(exc)}, status_code=503, headers={"Retry-After": str(RETRY_AFTER)}
    )


async def _answer_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=400)  # nobody is there to read it


async def _answer_user_error(request: Request, exc: CaptioningError) -> Response:
    # A bad image or a decoding the model cannot do: the message already names the problem.
    return JSONResponse({"error": " ".join(str(exc).split())}, status_code=400)


async def _answer_http_error(request: Request, exc: HTTPException) -> Response:
    return JSONResponse({"error": exc.detail}, status_code=exc.status_code)


async def _answer_server_error(request: Request, exc: Exception) -> Response:
    logger.exception("unexpected error answering %s", request.url.path)
    # Answered outside the middleware, so the headers are set here.
    headers = {name.decode(): value.decode() for name, value in guarded([])}
    return JSONResponse(
        {"error": "internal error; the server's log has the details"},
        status_code=500,
        headers=headers,
    )


EXCEPTION_HANDLERS = {
    BadRequest: _answer_bad_request,
    Busy: _answer_busy,
    ClientGone: _answer_gone,
    ClientDisconnect: _answer_gone,
    CaptioningError: _answer_user_error,
    HTTPException: _answer_http_error,
    Exception: _answer_server_error,
}


def settings_for(
    model: CaptionModel,
    max_upload_mb: float,
    examples: Sequence[str] | None = None,
    **limits: Any,
) -> ServeSettings:
    """Settings with an upload limit in MB and, unless given, the dataset's test images;
    ``limits`` are other :class:`ServeSettings` fields."""
    from captioning.metrics.words import shipped_category_words

    found = example_images(model.config.data) if examples is None else None
    paths = tuple(e.path for e in found) if found is not None else tuple(examples or ())
    boxes = tuple(e.boxes for e in found) if found is not None else ()
    return ServeSettings(
        max_upload_bytes=int(max_upload_mb * 2**20),
        examples=paths,
        example_boxes=boxes,
        category_words=shipped_category_words(),
        **limits,
    )
