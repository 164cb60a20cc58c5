"""How much work the demo takes on: requests in flight and waiting (:class:`Admission`, on
the event loop), pixels being decoded at once (:class:`PixelBudget`, across threads), and
what it takes from a checkpoint's config (:func:`demo_image_limits`)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING

from captioning.data.images import ImageLimits
from captioning.errors import CaptioningError

if TYPE_CHECKING:
    from captioning.api import CaptionModel

logger = logging.getLogger("captioning")

# The most the demo takes from a checkpoint's config, whatever it says: its memory bound
# (under 2 GiB with 300 clients, benchmarks/serve_stress.py) holds up to these.
MAX_IMAGE_PIXELS = 64_000_000  # data.max_image_pixels: larger pictures are refused
MAX_TEXT_BYTES = 1 << 20  # data.max_image_text_bytes
MAX_INPUT_SIZE = 1024  # model.image_size: each request holds a (3, S, S) input
MAX_CAPTION_LENGTH = 100  # decode.max_length: the decoding steps of each caption


class Busy(Exception):
    """The server cannot take the request now: answered 503 with ``Retry-After``."""


class Admission:
    """Requests in flight (their upload read, decoded, captioned) and waiting for a slot.

    A request past ``in_flight + queue`` is refused at once; one that waits longer than its
    timeout is refused then. Waiting requests are let in first come, first served, and hold
    no upload: their bodies are read only once they are in flight.

    Args:
        in_flight: requests worked on at once.
        queue: requests that may wait for a slot.
    """

    def __init__(self, *, in_flight: int, queue: int) -> None:
        if in_flight < 1 or queue < 0:
            raise ValueError(
                f"in_flight must be at least 1 and queue at least 0, got {in_flight} and {queue}"
            )
        self.in_flight = in_flight
        self.queue = queue
        self.running = 0
        self._waiting: deque[asyncio.Future] = deque()

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot now."""
        return len(self._waiting)

    @asynccontextmanager
    async def slot(self, timeout: float) -> AsyncIterator[Slot]:
        """Hold one slot for the block, waiting up to ``timeout`` seconds for it; the slot
        is given back once the block has ended and so has the work it handed to other
        threads (:meth:`Slot.hold_until`).

        Raises:
            Busy: every slot is taken and the queue is full, or the wait timed out.
        """
        if self.running < self.in_flight and not self._waiting:
            self.running += 1
        elif len(self._waiting) >= self.queue:
            raise Busy(
                f"the server is busy ({self.running} requests in flight, "
                f"{len(self._waiting)} waiting); try again in a moment"
            )
        else:
            waiter = asyncio.get_running_loop().create_future()
            self._waiting.append(waiter)
            try:
                await asyncio.wait_for(waiter, max(timeout, 0.0))
            except BaseException as exc:
                if waiter in self._waiting:
                    self._waiting.remove(waiter)
                elif waiter.done() and not waiter.cancelled():
                    self._release()  # the slot was handed over as the wait ended
                if isinstance(exc, asyncio.TimeoutError):
                    raise Busy(
                        f"the server is busy: no slot came free within {timeout:g} s; "
                        "try again in a moment"
                    ) from None
                raise
        slot = Slot(self._release)
        try:
            yield slot
        finally:
            slot.drop()

    def _release(self) -> None:
        """Hand the slot to the first waiter still waiting, or free it."""
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.running -= 1


class Slot:
    """One admitted request's place in flight, given back when every hold on it has been
    dropped: the request handler's own, and one per piece of work it handed to another
    thread (a batch that has started runs on after its client has gone or its deadline
    has passed, and its place stays taken until it ends).

    Args:
        give_back: called on the event loop once the last hold is dropped.
    """

    def __init__(self, give_back: Callable[[], None]) -> None:
        self._give_back = give_back
        self._holds = 1
        self._loop = asyncio.get_running_loop()

    def hold_until(self, future: Future) -> None:
        """Keep the slot until ``future`` is done (with a result, an error, or cancelled)."""
        self._holds += 1
        future.add_done_callback(self._done_elsewhere)

    def drop(self) -> None:
        """Drop one hold (on the event loop)."""
        self._holds -= 1
        if self._holds == 0:
            self._give_back()

    def _done_elsewhere(self, future: Future) -> None:
        try:
            self._loop.call_soon_threadsafe(self.drop)
        except RuntimeError:  # the loop has closed: the server has stopped, nothing to free
            pass


class PixelBudget:
    """The pixels being decoded at once, across threads: a reservation waits until its
    pixels fit beside the others (one larger than the whole budget waits to run alone).

    Args:
        pixels: the budget; the web demo uses the largest image it takes
            (``data.max_image_pixels``), so that a worst-case picture is decoded alone.
    """

    def __init__(self, pixels: int) -> None:
        self.pixels = pixels
        self.used = 0
        self._free = threading.Condition()

    @contextmanager
    def reserve(self, pixels: int, deadline: float | None = None) -> Iterator[None]:
        """Hold ``pixels`` of the budget for the block.

        Args:
            pixels: what the decoding about to run holds.
            deadline: a ``time.monotonic()`` time after which waiting gives up.

        Raises:
            TimeoutError: the pixels did not fit before ``deadline``.
        """
        share = min(max(pixels, 0), self.pixels)
        with self._free:
            fits = self._free.wait_for(
                lambda: self.used + share <= self.pixels,
                timeout=None if deadline is None else max(deadline - time.monotonic(), 0.0),
            )
            if not fits:
                raise TimeoutError("no room to decode the image before the deadline")
            self.used += share
        try:
            yield
        finally:
            with self._free:
                self.used -= share
                self._free.notify_all()


def demo_image_limits(model: CaptionModel) -> ImageLimits:
    """The image limits of ``model``'s config (``data.max_image_pixels``,
    ``data.max_image_text_bytes``) lowered to the demo's most.

    Raises:
        CaptioningError: its input size (``model.image_size``) or caption length
            (``decode.max_length``) is past what the demo serves.
    """
    sizes = [
        ("model.image_size", model.input_size, MAX_INPUT_SIZE),
        ("decode.max_length", model.config.decode.max_length, MAX_CAPTION_LENGTH),
    ]
    for key, value, most in sizes:
        if value > most:
            raise CaptioningError(
                f"the checkpoint's {key}={value:,} is more than the web demo serves "
                f"({most:,}); caption with `captioning caption` instead"
            )
    limits = model.limits
    bounded = ImageLimits(
        min(limits.max_pixels, MAX_IMAGE_PIXELS), min(limits.max_text_bytes, MAX_TEXT_BYTES)
    )
    if bounded != limits:
        logger.info(
            "the demo takes images of up to %s pixels and %s bytes of text, less "
            "than the checkpoint's data config allows",
            f"{bounded.max_pixels:,}",
            f"{bounded.max_text_bytes:,}",
        )
    return bounded
