"""Progress bars on a terminal; one summary line per loop everywhere else.

A tqdm bar redraws its line with carriage returns several times a second. On a terminal that
is what one wants; in a log file, in CI or in ``make demo > log`` every redraw stays, and the
log fills with fragments. So a bar is drawn only when stderr is a terminal. Otherwise the loop
runs with :class:`QuietProgress`, a stand-in with the same methods, which draws nothing and,
when the loop ends, logs one line with the figures the bar would have shown (count, time, rate
and its last postfix). ``enabled=False`` (``--quiet``) hides both.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

from tqdm import tqdm

logger = logging.getLogger("captioning")


def stderr_is_terminal() -> bool:
    """Whether ``sys.stderr`` is a terminal (False for a file, a pipe or a closed stream)."""
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError):
        return False


def format_count(count: float, unit: str) -> str:
    """``count`` with its unit; bytes in KB, MB, GB as tqdm shows them."""
    if unit == "B":
        return f"{tqdm.format_sizeof(count, divisor=1000)}B"
    whole = count >= 100 or float(count).is_integer()
    return f"{count:.0f} {unit}" if whole else f"{count:.1f} {unit}"


class QuietProgress:
    """What :func:`progress_bar` gives when no bar is drawn: iterates, counts, keeps the last
    postfix, and logs one summary line when the loop ends (when ``summary`` is set).

    Args:
        iterable: the items to pass through (None when the caller calls :meth:`update`).
        desc: the loop's name, the start of the summary line.
        total: the expected count (not needed for the line).
        unit: what one count is (``it``, ``img``, ``B``).
        summary: log the summary line when the loop ends or :meth:`close` is called.
        initial: the count already done before this call (a resumed download).
    """

    def __init__(
        self,
        iterable: Iterable[Any] | None = None,
        *,
        desc: str = "",
        total: float | None = None,
        unit: str = "it",
        summary: bool = True,
        initial: float = 0,
    ) -> None:
        self.iterable = iterable
        self.desc = desc
        self.total = total
        self.unit = unit
        self.summary = summary
        self.n = initial
        self.initial = initial
        self.postfix: dict[str, Any] = {}
        self.started = time.monotonic()
        self.closed = False

    def __iter__(self) -> Iterator[Any]:
        if self.iterable is None:
            raise TypeError("QuietProgress without an iterable cannot be iterated")
        for item in self.iterable:
            yield item
            self.n += 1
        self.close()

    def __len__(self) -> int:
        return int(self.total) if self.total is not None else len(self.iterable)  # type: ignore[arg-type]

    def __enter__(self) -> QuietProgress:
        return self

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        if kind is None:
            self.close()
        self.closed = True

    def update(self, n: float = 1) -> None:
        self.n += n

    def set_postfix(self, **values: Any) -> None:
        self.postfix = values

    def line(self) -> str:
        """The summary: ``desc: count in time (rate)[, postfix]``."""
        seconds = time.monotonic() - self.started
        done = self.n - self.initial
        rate = format_count(done / seconds, self.unit) + "/s" if seconds > 0 else "-"
        took = f"{seconds:.1f}s" if seconds < 10 else f"{seconds:.0f}s"
        text = f"{self.desc}: {format_count(self.n, self.unit)} in {took} ({rate})"
        extra = ", ".join(f"{key} {value}" for key, value in self.postfix.items())
        return f"{text}, {extra}" if extra else text

    def close(self) -> None:
        if not self.closed and self.summary:
            logger.info("%s", self.line())
        self.closed = True


def progress_bar(
    iterable: Iterable[Any] | None = None,
    *,
    desc: str = "",
    total: float | None = None,
    unit: str = "it",
    enabled: bool = True,
    summary: bool = True,
    leave: bool = True,
    initial: float = 0,
    **tqdm_options: Any,
) -> tqdm | QuietProgress:
    """A tqdm bar when ``enabled`` and stderr is a terminal, else a :class:`QuietProgress`.

    Args:
        iterable: the items (None to drive the count with ``update``).
        desc: the bar's label and the summary line's start.
        total: the expected count.
        unit: what one count is; ``B`` shows bytes in KB, MB, GB.
        enabled: False (``--quiet``) draws nothing and logs nothing.
        summary: without a terminal, log one line when the loop ends. Loops that log their own
            line (a training epoch) turn it off.
        leave: keep the finished bar on the terminal.
        initial: the count already done (a resumed download).
        tqdm_options: passed to tqdm (``ncols``, ``unit_scale``, ...).
    """
    if enabled and stderr_is_terminal():
        return tqdm(
            iterable,
            desc=desc,
            total=total,
            unit=unit,
            leave=leave,
            initial=initial,
            **tqdm_options,
        )
    return QuietProgress(
        iterable, desc=desc, total=total, unit=unit, summary=enabled and summary, initial=initial
    )
