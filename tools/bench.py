"""Time training steps and decoding, ours against a naive reference (same as `captioning bench`).

    python tools/bench.py --sizes shapes,coco --device all --out runs/bench/bench.json
    python tools/bench.py --sizes shapes --quick            # a smoke run
    python tools/bench.py --help

Writes the JSON file and a Markdown table beside it, and prints the table. See
captioning/bench.py for what is measured and how.
"""

from __future__ import annotations

import sys

from captioning.bench import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
