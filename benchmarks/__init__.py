"""Benchmarks and studies of the captioning package, kept outside it (not installed).

Each runs as a module from the repository root:

    python -m benchmarks.bench --sizes shapes,coco --out runs/bench/bench.json
    python -m benchmarks.beam_floor --bench runs/bench/bench.json
    python -m benchmarks.profile_epoch --config configs/shapes_soft.yaml
    python -m benchmarks.serve_load --checkpoint C --images DIR
    python -m benchmarks.serve_stress

:mod:`benchmarks.bench` times training steps and decoding (:mod:`benchmarks.workload`,
:mod:`benchmarks.timing`) against the naive reference of :mod:`benchmarks.reference` and
:mod:`benchmarks.reference_decoding`, checked by :mod:`benchmarks.reference_check`;
:mod:`benchmarks.memory` measures peak memory; :mod:`benchmarks.beam_floor` times the
arithmetic beam search cannot avoid. Rows go into ``results/`` only with ``--results FILE``,
stamped and merged by :mod:`lab.provenance`.
"""
