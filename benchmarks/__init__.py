"""Speed benchmarks of the captioning package, kept outside it (not installed).

Run them from the repository root:

    python benchmarks/bench.py --sizes shapes,coco --out runs/bench/bench.json
    python benchmarks/beam_floor.py --bench runs/bench/bench.json

:mod:`benchmarks.bench` times training steps and decoding against the naive reference of
:mod:`benchmarks.reference`; :mod:`benchmarks.memory` measures peak memory;
:mod:`benchmarks.beam_floor` times the arithmetic beam search cannot avoid.
"""
