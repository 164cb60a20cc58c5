"""The web demo's latency under load (``results/serve_latency.json``, rows of
``benchmarks/serve_load.py``)."""

from __future__ import annotations

from typing import Any

from tools.tables.common import Rows, header, line, portable, provenance


def serve_latency(rows: Rows) -> str:
    """The web demo's latency per client count (``benchmarks/serve_load.py``); rows measured
    with several ``--max-batch`` limits get a column for it (1: one image at a time) and the
    requests refused (503); rows of several models (``--name``) a column for the model, and
    each model's own cost per image at batch 1 and at its largest batch."""
    batches = any("max_batch" in r for r in rows)
    names = any("name" in r for r in rows)
    head = ["clients", "requests", "requests/s", "p50 (ms)", "p95 (ms)", "p99 (ms)"]
    if batches:
        head = ["max batch", *head, "refused"]
    if names:
        head = ["model", *head]
    lines = header(head)
    order = list(dict.fromkeys(r.get("name", "") for r in rows))
    key = lambda r: (order.index(r.get("name", "")), r.get("max_batch", 0), r["clients"])  # noqa: E731
    for r in sorted(rows, key=key):
        cells = [
            str(r["clients"]),
            str(r["requests"]),
            f"{r['requests_per_s']:.2f}",
            f"{r['p50_ms']:.0f}",
            f"{r['p95_ms']:.0f}",
            f"{r['p99_ms']:.0f}",
        ]
        if batches:
            cells = [str(r.get("max_batch", 1)), *cells, str(r.get("refused", 0))]
        if names:
            cells = [r.get("name", ""), *cells]
        lines.append(line(cells))
    lines.append("")
    for name in order:
        group = [r for r in rows if r.get("name", "") == name]
        first = group[0]
        notes = _batch_gain(group)
        notes += _model_cost(first)
        label = f"**{name}**: " if names else ""
        lines.append(
            f"{label}`{portable(first['command'])}`, beam {first['beam_size']}, "
            f"{first['images']} images sent in turn; {provenance(group)}"
            + "".join(f"; {n}" for n in notes)
            + "."
        )
        lines.append("")
    return "\n".join(lines[:-1]) + "\n"


def _model_cost(row: dict[str, Any]) -> list[str]:
    """The model's own ms per image by batch size (encoder; encoder and beam search) and
    the requests/s its encoder allows at best, from ``benchmarks/serve_load.py``'s row."""

    def by_batch(kind: str) -> dict[int, float]:
        prefix = f"model_{kind}_ms_batch"
        return {int(k[len(prefix) :]): v for k, v in row.items() if k.startswith(prefix)}

    encode, caption = by_batch("encode"), by_batch("caption")
    if not encode:
        return []

    def listing(values: dict[int, float]) -> str:
        sizes = sorted(values)
        ms = " / ".join(f"{values[b]:.1f}" for b in sizes)
        return f"{ms} at batch {' / '.join(str(b) for b in sizes)}"

    precision = f" in {row['precision']}" if row.get("precision") else ""
    notes = [f"the encoder alone{precision} {listing(encode)} ms per image"]
    if caption:
        notes.append(f"encoder and beam search {listing(caption)}")
    fixed = row.get("prepare_ms", 0.0) + row.get("answer_ms", 0.0)
    if "answer_ms" in row:
        notes.append(
            f"preparing an upload {row['prepare_ms']:.1f} ms and its answer's JSON "
            f"{row['answer_ms']:.1f} ms"
        )
    notes.append(
        f"so at most {1000 / (min(encode.values()) + fixed):.0f} requests/s whatever the "
        "server does"
    )
    batched = {b: v for b, v in caption.items() if b > 1}
    if "answer_ms" in row and batched:
        best = min(batched, key=batched.get)
        notes.append(
            f"at most {1000 / (batched[best] + fixed):.0f} with the whole "
            f"captioning at its cheapest batch size ({best})"
        )
    return notes


def _batch_gain(rows: Rows) -> list[str]:
    """The requests/s with the largest batch limit over one image at a time, per client
    count above one (an empty list without both)."""
    gains = []
    for clients in sorted({r["clients"] for r in rows}):
        rates = {
            r.get("max_batch", 1): r["requests_per_s"] for r in rows if r["clients"] == clients
        }
        largest = max(rates)
        if largest > 1 and 1 in rates and clients > 1:
            gains.append(f"{rates[largest] / rates[1]:.2f}x at {clients}")
    if not gains:
        return []
    return ["batches against one image at a time: " + ", ".join(gains) + " clients"]
