"""Errors a user can cause. The CLI prints their message on one line and exits with code 2."""


class CaptioningError(Exception):
    """Base class for problems the user can fix (bad path, bad config, bad checkpoint)."""


class ConfigError(CaptioningError):
    """A config file or override is invalid."""


class DataError(CaptioningError):
    """A dataset file, image or annotation is missing or unreadable."""


class CheckpointError(CaptioningError):
    """A checkpoint is missing, unsafe, or of another format."""


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived during training: the run unwinds as on Ctrl-C, and the CLI prints
    ``terminated`` and exits with code 143 (128 + SIGTERM), as a killed process would."""
