"""How much work the demo takes on: requests in flight and waiting (:class:`Admission`, on
the event loop), and pixels being decoded at once (:class:`PixelBudget`, across threads)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager


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
            raise ValueError(f"in_flight must be at least 1 and queue at least 0, got "
                             f"{in_flight} and {queue}")  # fmt: skip
        self.in_flight = in_flight
        self.queue = queue
        self.running = 0
        self._waiting: deque[asyncio.Future] = deque()

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot now."""
        return len(self._waiting)

    @asynccontextmanager
    async def slot(self, timeout: float) -> AsyncIterator[None]:
        """Hold one slot for the block, waiting up to ``timeout`` seconds for it.

        Raises:
            Busy: every slot is taken and the queue is full, or the wait timed out.
        """
        if self.running < self.in_flight and not self._waiting:
            self.running += 1
        elif len(self._waiting) >= self.queue:
            raise Busy(f"the server is busy ({self.running} requests in flight, "
                       f"{len(self._waiting)} waiting); try again in a moment")  # fmt: skip
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
                    raise Busy(f"the server is busy: no slot came free within {timeout:g} s; "
                               "try again in a moment") from None  # fmt: skip
                raise
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        """Hand the slot to the first waiter still waiting, or free it."""
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.running -= 1


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
