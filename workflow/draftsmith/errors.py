"""The base of every error a user can fix: its message names the problem and the fix."""


class DraftsmithError(Exception):
    pass
