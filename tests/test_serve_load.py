"""The demo under 300 hostile clients at once (``python -m benchmarks.serve_stress``), as the
``captioning serve`` process with its default limits: worst-case uploads, slow bodies,
hang-ups and half-sent headers; every request answered (200, 4xx or 503) or closed by the
server's deadline, no 500, peak memory under 2 GiB, and the server up afterwards. Slow (about
a minute): ``pytest -m slow tests/test_serve_load.py``. The report's judgement is tested
here on made-up outcomes too, in the default suite."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from benchmarks.hostile_clients import Outcome, answered, complete, scan_bomb
from benchmarks.serve_stress import SCAN_BOMB, line_up, report, stress
from captioning.data.images import MAX_JPEG_SCANS, jpeg_scans


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_300_hostile_clients(tiny_checkpoint, tmp_path):
    result = stress(tiny_checkpoint, 300, tmp_path)
    print(result)
    assert result["checks"] == dict.fromkeys(result["checks"], True)
    assert result["peak_rss_mib"] < 2048 and result["after"] == {"info": 200, "caption": 200}
    assert result["kinds"][SCAN_BOMB]["outcomes"] == {"400": 3}  # refused before decoding
    served = result["kinds"]["small image"]["outcomes"]
    assert set(served) <= {"200", "503"}
    assert set(result["kinds"]["half the headers"]["outcomes"]) == {"closed by the server"}


def test_the_report_fails_a_500_a_client_left_waiting_and_a_traceback():
    fine = [
        Outcome("small image", 200, False, 0.1),
        Outcome("half the headers", None, True, 10.1),
        Outcome("hang up once sent", None, False, 0.0),
    ]
    up = {"info": 200, "caption": 200}
    assert report(fine, 12.0, 2**30, up, True, "INFO: started")["ok"]
    bad = {
        "no 5xx but 503": [Outcome("a large photo", 500, False, 0.1)],
        "every request answered or closed by the server": [Outcome("a slow body", None, False, 50)],
        "half-sent headers closed at the header deadline": [
            Outcome("half the headers", None, True, 15.0)
        ],
    }
    for check, outcomes in bad.items():
        checks = report(fine + outcomes, 12.0, 2**30, up, True, "")["checks"]
        assert [name for name, ok in checks.items() if not ok] == [check]
    checks = report(
        fine,
        1.0,
        3 * 2**30,
        {"info": 200, "caption": None},
        True,
        "Traceback (most recent call last):",
    )["checks"]
    assert [name for name, ok in checks.items() if not ok] == [
        "peak RSS under 2 GiB",
        "no traceback in the server's log",
        "up afterwards",
    ]


def test_answers_are_read_by_their_length():
    head = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 23\r\n\r\n"
    assert not complete(head + b'{"error":"busy"')
    assert complete(head + b'{"error":"busy; later"}')
    outcome = answered("x", head + b'{"error":"busy; later"}', 1.0)
    assert (outcome.status, outcome.closed, outcome.error) == (503, False, "busy; later")
    assert answered("x", b"", 2.0, closed=True) == Outcome("x", None, True, 2.0)


def test_three_scan_bombs_are_lined_up_among_the_clients():
    bomb = scan_bomb()
    assert len(bomb) < 200_000 and jpeg_scans(io.BytesIO(bomb)) > 10 * MAX_JPEG_SCANS
    kinds = [
        (f"kind {k}", lambda port, k=k: Outcome(f"kind {k}", 200, False, 0.0)) for k in range(12)
    ]
    clients = line_up(kinds, 300, 3, bomb)
    names = [getattr(client, "keywords", {}).get("kind") or client(0).kind for client in clients]
    assert names.count(SCAN_BOMB) == 3 and len(names) == 300
    assert len(set(names) - {SCAN_BOMB}) == 12


def test_the_report_fails_a_scan_bomb_that_was_decoded_and_a_late_small_image():
    up = {"info": 200, "caption": 200}
    decoded = [Outcome(SCAN_BOMB, 200, False, 11.0)]
    late = [Outcome("small image", 200, False, 45.0)]
    for outcomes, check in (
        (decoded, "every scan bomb refused with a 4xx"),
        (late, "every small image answered 200 or 503 within its deadline"),
    ):
        checks = report(outcomes, 12.0, 2**30, up, True, "")["checks"]
        assert [name for name, ok in checks.items() if not ok] == [check]
