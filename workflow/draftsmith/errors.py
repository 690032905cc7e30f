"""The base of every error a user can fix: its message names the problem and the fix."""


class DraftsmithError(Exception):
    pass


class TrainError(DraftsmithError):
    """The training stage (train.py and the modules it is split into) cannot go on."""
