"""The lab's scripts (studies and doc generators), run as ``python -m tools.NAME``."""
