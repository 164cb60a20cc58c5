"""The lab's library, beneath both its wings (``benchmarks/`` and ``tools/``; not installed):

- :mod:`lab.runner`: the study runner (a study is a list of run specs; the runner trains,
  resumes, evaluates and records rows);
- :mod:`lab.options`: the command-line options every study shares, and their checks;
- :mod:`lab.results`: the one writer of ``results/*.json`` (a row replaces the row of the
  same key only when both were made under the same settings);
- :mod:`lab.provenance`: what stamps a row (the commit, the command in module form with no
  machine's paths, the machine and device).

``ROOT`` is the checkout, ``SHARED`` the shared data and weights beside it.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
