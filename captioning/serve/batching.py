"""Concurrent requests captioned together: one thread gathers what the requests submit
into batches and runs one batched decoding (beam search) per batch.

A request submits its image already decoded, reduced and resized (a uint8 ``(3, S, S)``
tensor, see :meth:`CaptionModel.prepare`), so a waiting request holds a small tensor, never
a full picture. Once an image has come, the thread waits up to ``wait`` seconds for more,
but only while other admitted requests are still on their way (:meth:`Batcher.coming`):
a lone client is captioned at once. Requests that ask for other decoding settings
(``beam_size``, ``hard_context``) are decoded in a batch of their own. A request that was
cancelled before its batch runs (its client has gone, its deadline has passed) is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from captioning.api import Caption, CaptionModel

logger = logging.getLogger("captioning")

# The decoding a request asks for: (beam_size, hard_context), None keeping the checkpoint's.
DecodingKey = tuple[int | None, str | None]


@dataclass
class _Job:
    inputs: torch.Tensor  # (3, S, S) uint8
    key: DecodingKey
    future: Future = field(default_factory=Future)


@dataclass
class BatchStats:
    """What the batcher has done: ``batches`` decodings of ``captioned`` images in all (the
    largest of ``largest`` images), and ``dropped`` requests cancelled before their batch."""

    batches: int = 0
    captioned: int = 0
    largest: int = 0
    dropped: int = 0


class Batcher:
    """One thread that captions submitted inputs in batches.

    Args:
        model: the loaded model (its lock is held during each decoding, so the Python API
            may share it).
        max_batch: the most images decoded together.
        wait: seconds to wait for more images once one has come, while requests are on
            their way (0: only what has already come is batched).
    """

    def __init__(self, model: CaptionModel, *, max_batch: int = 16, wait: float = 0.005) -> None:
        if max_batch < 1 or wait < 0:
            raise ValueError(
                f"max_batch must be at least 1 and wait at least 0, got {max_batch} and {wait}"
            )
        self.model = model
        self.max_batch = max_batch
        self.wait = wait
        # On a CPU a convolutional backbone costs no less per image in a batch, and more
        # once its activations outgrow the caches (a MobileNetV2 at 320 px: 22 ms an image
        # one or two at a time, 40 ms in 16s); the decoder's steps are what batching saves.
        self.encode_batch = 2 if model.device.type == "cpu" else None
        self.stats = BatchStats()
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._coming = 0  # requests admitted that have not submitted yet
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def queued(self) -> int:
        """Images submitted and not yet taken into a batch."""
        return self._jobs.qsize()

    @contextmanager
    def coming(self) -> Iterator[Callable[[torch.Tensor, DecodingKey], Future]]:
        """Count a request as on its way while it reads and decodes its image (the thread
        waits for such requests, up to ``wait``). Gives :meth:`submit`, which also ends the
        count: ``with batcher.coming() as submit: ... future = submit(inputs, key)``."""
        counted = True

        def stop_counting() -> None:
            nonlocal counted
            with self._lock:
                if counted:
                    self._coming -= 1
                    counted = False

        def submit(inputs: torch.Tensor, key: DecodingKey = (None, None)) -> Future:
            future = self.submit(inputs, key)  # queued before the count ends
            stop_counting()
            return future

        with self._lock:
            self._coming += 1
        try:
            yield submit
        finally:
            stop_counting()

    def submit(self, inputs: torch.Tensor, key: DecodingKey = (None, None)) -> Future:
        """Queue one image's ``inputs`` (3, S, S) for captioning with the decoding ``key``;
        the future holds its :class:`Caption` (cancel it to drop the request)."""
        self._start()
        job = _Job(inputs, key)
        self._jobs.put(job)
        return job.future

    async def caption(self, inputs: torch.Tensor, key: DecodingKey = (None, None)) -> Caption:
        """:meth:`submit` and wait for the caption; cancelling the wait drops the request
        unless its batch has started."""
        return await asyncio.wrap_future(self.submit(inputs, key))

    def close(self) -> None:
        """Stop the thread once the batches already queued are done."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout=60)

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="caption-batches", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        while True:
            first = self._jobs.get()
            if first is None:
                return
            jobs, closing = self._gather(first)
            live = [job for job in jobs if job.future.set_running_or_notify_cancel()]
            self.stats.dropped += len(jobs) - len(live)
            groups: dict[DecodingKey, list[_Job]] = {}
            for job in live:
                groups.setdefault(job.key, []).append(job)
            for key, group in groups.items():
                self._caption(key, group)
            if closing:
                return

    def _gather(self, first: _Job) -> tuple[list[_Job], bool]:
        """``first`` and the jobs that come within ``wait`` while requests are on their way,
        up to ``max_batch``; and whether :meth:`close` was asked for meanwhile."""
        jobs = [first]
        until = time.monotonic() + self.wait
        while len(jobs) < self.max_batch:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                remaining = until - time.monotonic()
                if remaining <= 0 or self._coming == 0:
                    break
                try:
                    job = self._jobs.get(timeout=remaining)
                except queue.Empty:
                    break
            if job is None:
                return jobs, True
            jobs.append(job)
        return jobs, False

    def _caption(self, key: DecodingKey, group: list[_Job]) -> None:
        beam_size, hard_context = key
        try:
            inputs = torch.stack([job.inputs for job in group])  # (B, 3, S, S)
            captions = self.model.caption_inputs(
                inputs,
                beam_size=beam_size,
                hard_context=hard_context,
                encode_batch=self.encode_batch,
            )
        except Exception as exc:  # every request of the batch gets the error
            for job in group:
                job.future.set_exception(exc)
            return
        self.stats.batches += 1
        self.stats.captioned += len(group)
        self.stats.largest = max(self.stats.largest, len(group))
        for job, caption in zip(group, captions):
            job.future.set_result(caption)
