"""Latency and throughput of the web demo's JSON API under N clients, on 127.0.0.1.

    python -m benchmarks.serve_load --checkpoint runs/photos/best.pt \
        --images data/photos/images/test --results results/serve_latency.json
    python -m benchmarks.serve_load --checkpoint C --images DIR --clients 1,8 --requests 100 \
        --max-batch 16

Starts the demo (``captioning serve``'s app) on a free port of 127.0.0.1, in this process on a
thread of its own, once per ``--max-batch`` value (default ``1,16``: one image captioned at a
time, then concurrent requests captioned together), then for each client count of
``--clients`` (default ``1,8,32,128``) sends ``--requests`` POSTs to ``/api/caption``, each
client one request at a time on its own connection, the images taken in turn from
``--images``. Every answer must be 200 (a 503 of a busy server is counted as ``refused``; any
other status stops the run, exit 1). After a warm-up of ``--warmup`` requests, reports
requests/s and the p50, p95 and p99 latency (from sending the request to reading the whole
answer) of the answered requests, prints a table and, with ``--results FILE``, writes the rows
there (JSON, with the command, the commit, the machine and whether it was timed alone; rows
of other ``--name`` values already in the file stay, so one file holds several models; rows
of the same name made with another beam size, precision or threads are replaced only with
``--replace``). Nothing leaves the machine: the server and the clients are on the loopback
address.

Each row also carries the model's own cost per image outside the server (``encode_ms`` for
the encoder alone at 1, 2, 4, 8 and the largest ``--max-batch`` images at once, in the run's
precision as captioning runs it (the row's ``precision``), ``caption_ms`` for
encoder and beam search at 1 and the largest): whatever the server does, its requests/s
cannot pass 1000 / (the encoder's cheapest ms per image + ``prepare_ms``, the cost of turning
an upload into the model's input) on one core's worth of work per image.
"""

from __future__ import annotations

import http.client
import json
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

import captioning
from benchmarks.timing import median_seconds
from captioning.data.images import load_image_bytes
from captioning.runtime import autocast, in_passing_thread, resolve_precision
from captioning.serve.app import settings_for
from captioning.serve.server import BackgroundServer
from lab.options import errors_in_one_line, parser_for
from lab.provenance import device_name, git_commit, machine, module_command, portable
from lab.results import write_results

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")


def multipart(image: bytes, name: str, fields: dict[str, str]) -> tuple[bytes, str]:
    """A ``multipart/form-data`` body with the image in field ``image``, and its type."""
    boundary = uuid.uuid4().hex
    parts = []
    for key, value in fields.items():
        parts.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{key}"\r\n\r\n'
            f"{value}\r\n".encode()
        )
    parts.append(
        f'--{boundary}\r\nContent-Disposition: form-data; name="image"; '
        f'filename="{name}"\r\nContent-Type: application/octet-stream\r\n\r\n'.encode()
        + image
        + b"\r\n"
    )
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation between ranks."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def run_clients(
    url: str, bodies: list[tuple[bytes, str]], clients: int, requests: int
) -> tuple[list[float], float, int]:
    """Send ``requests`` requests from ``clients`` threads, each on its own connection and
    one request at a time; returns each answered request's latency, the wall-clock
    seconds, and how many were refused (503)."""
    address = urlsplit(url)
    latencies: list[float] = []
    refused: list[int] = []
    failures: list[str] = []
    counter = iter(range(requests))
    lock = threading.Lock()

    def client() -> None:
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=120)
        try:
            while not failures:
                with lock:
                    index = next(counter, None)
                if index is None:
                    return
                body, content_type = bodies[index % len(bodies)]
                started = time.perf_counter()
                connection.request(
                    "POST", "/api/caption", body=body, headers={"Content-Type": content_type}
                )
                answer = connection.getresponse()
                payload = answer.read()
                elapsed = time.perf_counter() - started
                if answer.status == 503:
                    refused.append(index)
                    continue
                if answer.status != 200:
                    failures.append(f"HTTP {answer.status}: {payload[:200]!r}")
                    return
                with lock:
                    latencies.append(elapsed)
        finally:
            connection.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise SystemExit(f"error: a request failed: {failures[0]}")
    if not latencies:
        raise SystemExit(f"error: all {requests} requests were refused (503)")
    return latencies, time.perf_counter() - started, len(refused)


def counts(text: str, option: str) -> list[int]:
    """``1,8,32`` -> [1, 8, 32]; an error naming ``option`` for anything else."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        message = f"error: {option} must be comma-separated whole numbers, got {text!r}"
        raise SystemExit(message) from None
    if min(values) < 1:
        raise SystemExit(f"error: every {option} value must be at least 1, got {text!r}")
    return values


def speedups(rows: list[dict[str, Any]]) -> list[str]:
    """Per client count, the requests/s of the largest batch limit over one at a time."""
    lines = []
    for clients in sorted({row["clients"] for row in rows}):
        rates = {
            row["max_batch"]: row["requests_per_s"] for row in rows if row["clients"] == clients
        }
        largest = max(rates)
        if 1 in rates and largest > 1:
            lines.append(
                f"{clients} clients: {rates[largest] / rates[1]:.2f}x the requests/s "
                f"with --max-batch {largest} as with 1"
            )
    return lines


def model_cost(
    model: Any, files: list[Path], largest: int, beam_size: int, repeats: int = 15
) -> dict[str, float]:
    """Median milliseconds per image, outside the server: of turning an upload into the
    model's input as the server does (decode, reduce, resize; ``prepare_ms``), of the encoder
    alone for 1, 2, 4, 8 and ``largest`` images at once, and of a whole captioning (encoder
    and beam search, encoding two images at a time on a CPU as the server does) for 1,
    ``largest``, 2 x ``largest`` and 4 x ``largest`` images at once.

    ``answer_ms`` is the cost of the answer's JSON (the caption with its per-word maps).

    ``model_encode_ms_best`` is the encoder's cheapest batch size's cost per image: no server
    batching this model can answer more than 1000 / (that + ``prepare_ms`` + ``answer_ms``)
    requests/s, however cheap its beam search, and ``batching_ceiling`` in each row divides
    that by the one-at-a-time rate. ``model_caption_ms_best`` is the whole captioning's
    cheapest batch size's cost per image, and ``model_ceiling`` the same ratio with it in
    place of the encoder alone: what a server with no cost of its own would reach at the
    best batch size measured (larger batches cost more per image once their activations
    leave the caches)."""
    images, prepare = [], []
    for path in files[: max(4 * largest, 20)]:
        data = path.read_bytes()
        started = time.perf_counter()
        picture = load_image_bytes(data, path.name, model.limits, reduce_to=model.input_size)
        images.append(model.prepare(picture))
        prepare.append(time.perf_counter() - started)
    cost: dict[str, float] = {"prepare_ms": round(1000 * statistics.median(prepare), 1)}
    encode_batch = 2 if model.device.type == "cpu" else None
    precision = model.config.runtime.precision

    def median_ms(work: Callable[[], object], per: int = 1, warmup: int = 2) -> float:
        """The median ms of ``work`` over ``repeats`` calls, per item of ``per``, after
        ``warmup`` calls (the first calls of a shape build its kernels)."""
        return round(1000 * median_seconds(work, repeats, warmup) / per, 1)

    def batch_of(size: int) -> torch.Tensor:
        return torch.stack([images[i % len(images)] for i in range(size)])

    for batch in sorted({1, 2, 4, 8, largest}):
        inputs = batch_of(batch)
        # the encoder as captioning runs it: Captioner.encode, in the run's precision
        with torch.no_grad(), autocast(model.device, precision):
            cost[f"model_encode_ms_batch{batch}"] = median_ms(
                partial(model.model.encode, inputs), per=batch
            )
    captioning: dict[int, float] = {}  # ms per image by batch size
    for batch in (1, largest, 2 * largest, 4 * largest):
        work = partial(
            model.caption_inputs, batch_of(batch), beam_size=beam_size, encode_batch=encode_batch
        )
        captioning[batch] = cost[f"model_caption_ms_batch{batch}"] = median_ms(work, per=batch)
    cost["model_encode_ms_best"] = min(v for k, v in cost.items() if k.startswith("model_encode"))
    cost["model_caption_ms_best"] = min(v for b, v in captioning.items() if b > 1)
    answer = model.caption_inputs(images[0][None], beam_size=beam_size)[0].to_dict
    cost["answer_ms"] = median_ms(lambda: json.dumps(answer()), warmup=0)
    return cost


def ceilings(cost: dict[str, float], largest: int, rate: float) -> dict[str, float]:
    """How many times the one-at-a-time ``rate`` (requests/s) batching could reach at best:
    with the encoder alone per image (``batching_ceiling``), and with the whole captioning
    at its cheapest batch size (``model_caption_ms_best``; else the ``largest`` batch's) per
    image (``model_ceiling``), each plus the upload's preparation and the answer's JSON."""
    fixed = cost["prepare_ms"] + cost.get("answer_ms", 0.0)
    out = {"batching_ceiling": round(1000 / (cost["model_encode_ms_best"] + fixed) / rate, 2)}
    caption = cost.get("model_caption_ms_best", cost.get(f"model_caption_ms_batch{largest}"))
    if caption is not None:
        out["model_ceiling"] = round(1000 / (caption + fixed) / rate, 2)
    return out


SETTINGS = ("beam_size", "precision", "threads")  # what rows of one name must share


def merge(path: Path, rows: list[dict[str, Any]], replace: bool = False) -> list[dict[str, Any]]:
    """Merge one model's ``rows`` into the results file ``path`` and return what it holds:
    the rows of other models (another ``name``) stay, the file's rows of this one are
    replaced (:func:`lab.results.write_results`, keyed by ``name``).

    Raises:
        lab.results.ResultsError: unless ``replace``, when the file's rows of this
            name were made with another beam size, precision or threads (one line; the file
            is untouched).
    """
    return write_results(
        path,
        rows,
        lambda r: r.get("name"),
        replace=replace,
        settings=lambda r: {k: r[k] for k in SETTINGS if k in r},
    )


@errors_in_one_line
def main(argv: list[str] | None = None) -> int:
    """Run the load test from the command line (None: ``sys.argv[1:]``); 0, 1 when the
    server answers other than 200 or 503, 2 when ``--results`` holds rows of other
    settings."""
    parser = parser_for("benchmarks.serve_load", __doc__)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--images", required=True, type=Path, help="a folder of images to send")
    parser.add_argument("--clients", default="1,8,32,128", help="comma-separated client counts")
    parser.add_argument("--requests", type=int, default=100, help="timed requests per count")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--beam-size", type=int, default=3)
    parser.add_argument(
        "--max-batch",
        default="1,16",
        help="comma-separated server batch limits, one server each (1: one "
        "image captioned at a time)",
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="the server's deadline per request, seconds"
    )
    parser.add_argument(
        "--results",
        "--out",
        type=Path,
        default=None,
        help="merge the rows into this file (results/serve_latency.json)",
    )
    parser.add_argument(
        "--replace", action="store_true", help="with --results: also replace rows of other settings"
    )
    parser.add_argument(
        "--machine-busy",
        action="store_true",
        help="other work ran beside this one: the rows say so",
    )
    parser.add_argument(
        "--name", default="model", help="what the rows call this model (other names' rows stay)"
    )
    args = parser.parse_args(argv)
    files = sorted(p for p in args.images.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        parser.error(f"{args.images}: no .jpg, .png or .webp images found")
    client_counts = counts(args.clients, "--clients")
    batch_limits = counts(args.max_batch, "--max-batch")
    if args.requests < 1:
        parser.error("--requests must be at least 1")
    fields = {"beam_size": str(args.beam_size)}
    bodies = [multipart(p.read_bytes(), p.name, fields) for p in files]

    # Loaded and timed on passing threads, as `captioning serve` loads: the server's batcher
    # must be the one thread with an OpenMP team (see captioning.runtime.in_passing_thread)
    model = in_passing_thread(captioning.load, args.checkpoint, device="cpu")
    cost = in_passing_thread(model_cost, model, files, max(batch_limits), args.beam_size)
    rows: list[dict[str, Any]] = []
    for max_batch in batch_limits:
        settings = settings_for(
            model,
            max_upload_mb=10,
            examples=(),
            max_batch=max_batch,
            timeout=args.timeout,
            max_queue=max(client_counts),
        )
        with BackgroundServer(model, settings) as url:
            run_clients(url, bodies, 1, args.warmup)
            for clients in client_counts:
                latencies, seconds, refused = run_clients(url, bodies, clients, args.requests)
                rows.append(
                    {
                        "clients": clients,
                        "max_batch": max_batch,
                        "requests": len(latencies),
                        "refused": refused,
                        "requests_per_s": round(len(latencies) / seconds, 3),
                        **{
                            f"p{q}_ms": round(1000 * percentile(latencies, q), 1)
                            for q in (50, 95, 99)
                        },
                        "mean_ms": round(1000 * statistics.mean(latencies), 1),
                    }
                )
    context = {
        "name": args.name,
        **cost,
        "checkpoint": portable(str(args.checkpoint)),
        "images": len(files),
        "beam_size": args.beam_size,
        "precision": resolve_precision(model.config.runtime.precision, model.device),
        "commit": git_commit(),
        "command": module_command("benchmarks.serve_load", argv),
        **machine(),
        "device": device_name("cpu"),
        "timed_alone": not args.machine_busy,
    }
    print("| max batch | clients | requests/s | p50 ms | p95 ms | p99 ms | refused |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        row.update(context)
        print(
            f"| {row['max_batch']} | {row['clients']} | {row['requests_per_s']:.2f} | "
            f"{row['p50_ms']:.0f} | {row['p95_ms']:.0f} | {row['p99_ms']:.0f} | "
            f"{row['refused']} |"
        )
    one_at_a_time = {row["clients"]: row["requests_per_s"] for row in rows if row["max_batch"] == 1}
    largest = max(batch_limits)
    for row in rows:
        if row["clients"] in one_at_a_time:
            row.update(ceilings(cost, largest, one_at_a_time[row["clients"]]))
    for line in speedups(rows):
        print(line)
    for clients, rate in sorted(one_at_a_time.items()):
        bounds = ceilings(cost, largest, rate)
        print(
            f"{clients} clients: at most {bounds['batching_ceiling']:.2f}x the one-at-a-time "
            f"requests/s with the encoder alone, {bounds.get('model_ceiling', 0):.2f}x with "
            f"the whole captioning at its best batch size"
        )
    print("model alone, ms per image: " + ", ".join(f"{k} {v}" for k, v in cost.items()))
    if args.results:
        merge(args.results, rows, args.replace)
        print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
