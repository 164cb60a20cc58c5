"""The web demo under hundreds of hostile clients at once, as the ``captioning serve`` process
with its default limits, on 127.0.0.1.

    python -m benchmarks.serve_stress                    # a tiny shapes model trained first
    python -m benchmarks.serve_stress --checkpoint C --clients 300 --results report.json

Each client opens a connection of its own, all at once, and does one thing (the kinds taken in
turn): uploads a worst-case file (a PNG at the pixel cap, 8000 x 8000; the same cut short; a
decompression bomb past the cap; 10 MB of nothing; a large photo; a progressive JPEG at the
demo's progressive bound, 4000 x 4000, and one past it), uploads a small image, sends its
body a few bytes at a time, hangs up half-way through its upload or once it is sent, or sends
half its headers and nothing more (slowloris); three of them (``--scan-bombs``) upload a JPEG
whose one scan is repeated a thousand times. Checks, each in the report: no answer is a 500
(or another 5xx but 503); every small image is answered 200 or 503 within its deadline; every
scan bomb is refused with a 4xx; every request is answered 200, 4xx or 503, or closed by the server
within its deadline (half-sent headers within the header deadline); the server's peak
resident memory stays under 2 GiB; its log holds no traceback; and it still answers
afterwards. Prints the report as JSON (and, with ``--results FILE``, writes it there with the
command, the commit, the machine and whether it was timed alone); exit 1 when a check fails.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.hostile_clients import (
    HEADER_TIMEOUT,
    REQUEST_TIMEOUT,
    Outcome,
    clients,
    form,
    request_head,
    scan_bomb,
    talk,
    uploads,
)
from captioning.errors import CaptioningError
from lab import ROOT
from lab.options import fail, parser_for
from lab.provenance import device_name, git_commit, machine, module_command
from lab.results import write_results

RSS_LIMIT = 2 * 2**30
# --- the run ----------------------------------------------------------------------------------


def tiny_checkpoint(folder: Path) -> Path:
    """A shapes model trained for one epoch on a few dozen 48 px images (seconds)."""
    from captioning.config import load_config
    from captioning.data.shapes import generate_shapes
    from captioning.training.train import fit

    data = folder / "shapes"
    generate_shapes(data, num_train=24, num_val=6, num_test=6, seed=0, image_size=48)
    settings = [f"data.root={data}", "train.epochs=1"]
    config = load_config(ROOT / "configs" / "test_tiny.yaml", settings)
    fit(config, out_dir=folder / "run")
    return folder / "run" / "best.pt"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(checkpoint: Path, port: int, log: Path) -> subprocess.Popen:
    """``captioning serve`` on ``port`` with its default limits, once it answers."""
    command = [
        sys.executable,
        "-m",
        "captioning",
        "serve",
        "--checkpoint",
        str(checkpoint),
        "--port",
        str(port),
        "--quiet",
        "--device",
        "cpu",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "w") as out:
        server = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    until = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/info", timeout=5).read()
            return server
        except OSError:
            if server.poll() is not None or time.monotonic() > until:
                server.kill()
                raise SystemExit(f"error: the server did not start; see {log}") from None
            time.sleep(0.2)


def peak_rss(pid: int) -> int:
    """The process's peak resident memory in bytes (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("error: no VmHWM in /proc: this benchmark needs Linux")


def still_up(port: int, small: bytes) -> dict[str, int | None]:
    """The statuses of a page info request and a small caption request."""
    info = talk(port, "after", b"GET /api/info HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", limit=60)
    body, content_type = form(small)
    caption = talk(port, "after", request_head(content_type, len(body)) + body, limit=60)
    return {"info": info.status, "caption": caption.status}


SCAN_BOMB = "a JPEG scan bomb"


def line_up(
    kinds: list[tuple[str, Callable[[int], Outcome]]], count: int, bombs: int, bomb: bytes
) -> list[Callable[[int], Outcome]]:
    """``count`` clients, the kinds taken in turn, with ``bombs`` of them (spread evenly)
    uploading the scan bomb ``bomb`` instead."""
    body, content_type = form(bomb)
    bomber = partial(talk, kind=SCAN_BOMB, data=request_head(content_type, len(body)), rest=body)
    places = {count * k // bombs for k in range(bombs)} if bombs else set()
    return [bomber if i in places else kinds[i % len(kinds)][1] for i in range(count)]


def stress(checkpoint: Path, count: int, folder: Path, bombs: int = 3) -> dict[str, Any]:
    """Run ``count`` clients against a server of ``checkpoint``, ``bombs`` of them JPEG
    scan bombs; the report."""
    bodies = uploads()
    lined_up = line_up(clients(bodies), count, bombs, scan_bomb())
    port = free_port()
    log = folder / "server.log"
    server = start_server(checkpoint, port, log)
    try:
        started = time.monotonic()
        with ThreadPoolExecutor(count) as pool:
            outcomes = list(pool.map(lambda client: client(port), lined_up))
        seconds = time.monotonic() - started
        peak = peak_rss(server.pid)
        after = still_up(port, bodies["small image"])
        alive = server.poll() is None
    finally:
        server.terminate()
        server.wait(timeout=30)
    return report(outcomes, seconds, peak, after, alive, log.read_text(errors="replace"))


def report(
    outcomes: list[Outcome],
    seconds: float,
    peak: int,
    after: dict[str, int | None],
    alive: bool,
    log: str,
) -> dict[str, Any]:
    """The run's numbers and its checks."""
    by_kind: dict[str, Any] = {}
    for outcome in outcomes:
        row = by_kind.setdefault(
            outcome.kind, {"outcomes": Counter(), "max_seconds": 0.0, "errors": set()}
        )
        shown = (
            "hung up"
            if outcome.kind.startswith("hang up")
            else "closed by the server"
            if outcome.closed
            else str(outcome.status)
            if outcome.status
            else "no answer"
        )
        row["outcomes"][shown] += 1
        row["max_seconds"] = max(row["max_seconds"], round(outcome.seconds, 1))
        if outcome.error:
            row["errors"].add(outcome.error[:160])
    for row in by_kind.values():
        row["outcomes"] = dict(row["outcomes"])
        row["errors"] = sorted(row["errors"])
    statuses = [o.status for o in outcomes if o.status is not None]
    unanswered = [
        o
        for o in outcomes
        if o.status is None and not o.closed and not o.kind.startswith("hang up")
    ]
    slowloris = [o for o in outcomes if o.kind == "half the headers"]
    tracebacks = [line for line in log.splitlines() if "Traceback" in line or "ERROR" in line]
    normal = [o for o in outcomes if o.kind == "small image"]
    bombs = [o for o in outcomes if o.kind == SCAN_BOMB]
    checks = {
        "no 5xx but 503": all(s < 500 or s == 503 for s in statuses),
        "every small image answered 200 or 503 within its deadline": all(
            o.status in (200, 503) and o.seconds <= REQUEST_TIMEOUT for o in normal
        ),
        "every scan bomb refused with a 4xx": all(
            o.status is not None and 400 <= o.status < 500 for o in bombs
        ),
        "every request answered or closed by the server": not unanswered,
        "half-sent headers closed at the header deadline": all(
            o.closed and o.seconds <= HEADER_TIMEOUT + 2 for o in slowloris
        ),
        "peak RSS under 2 GiB": peak < RSS_LIMIT,
        "no traceback in the server's log": not tracebacks,
        "up afterwards": alive and after == {"info": 200, "caption": 200},
    }
    return {
        "clients": len(outcomes),
        "seconds": round(seconds, 1),
        "peak_rss_mib": round(peak / 2**20),
        "after": after,
        "kinds": by_kind,
        "server_log_errors": tracebacks[:5],
        "checks": checks,
        "ok": all(checks.values()),
    }


def served_as(checkpoint: Path) -> dict[str, Any]:
    """The precision and threads the demo ran ``checkpoint`` with (its ``runtime`` section;
    threads left to torch are this machine's default)."""
    import torch

    from captioning.checkpoint import load_checkpoint
    from captioning.runtime import resolve_precision

    runtime = load_checkpoint(checkpoint)["config"].get("runtime", {})
    precision = resolve_precision(runtime.get("precision") or "auto", torch.device("cpu"))
    return {"precision": precision, "threads": runtime.get("threads") or torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    """Run the stress test from the command line (None: ``sys.argv[1:]``); 0 when every
    check passes, else 1."""
    parser = parser_for("benchmarks.serve_stress", __doc__)
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="the model (default: a tiny one, trained first)",
    )
    parser.add_argument("--clients", type=int, default=300, help="clients at once (default 300)")
    parser.add_argument(
        "--scan-bombs",
        type=int,
        default=3,
        help="of them, how many upload a JPEG scan bomb (default 3)",
    )
    parser.add_argument(
        "--results",
        "--out",
        type=Path,
        default=None,
        help="also write the report here (results/serve_stress.json)",
    )
    parser.add_argument(
        "--machine-busy",
        action="store_true",
        help="other work ran beside this one: the report says so",
    )
    args = parser.parse_args(argv)
    if args.clients < 1:
        parser.error(f"--clients must be at least 1, got {args.clients}")
    if not 0 <= args.scan_bombs <= args.clients:
        parser.error(f"--scan-bombs must be from 0 to --clients, got {args.scan_bombs}")
    if args.checkpoint is not None and not args.checkpoint.is_file():
        parser.error(f"--checkpoint {args.checkpoint}: no such file")
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = args.checkpoint or tiny_checkpoint(Path(scratch))
        result = stress(checkpoint, args.clients, Path(scratch), args.scan_bombs)
        result.update(served_as(checkpoint))
    result.update(
        command=module_command("benchmarks.serve_stress", argv),
        commit=git_commit(),
        **machine(),
        device=device_name("cpu"),
        timed_alone=not args.machine_busy,
    )
    text = json.dumps(result, indent=1)
    print(text)
    if args.results:
        try:
            # the file holds one row, the latest run's
            write_results(args.results, [result], key=lambda row: "serve_stress", replace=True)
        except CaptioningError as exc:
            return fail(exc)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
