"""``python -m tools.tables``: regenerate (or ``--check``) the docs' result tables."""

from tools.tables import main

raise SystemExit(main())
