"""The one exception type a user can cause.

The CLI turns a `UserError` into one line on stderr and a non-zero exit; anything else is a
bug and keeps its traceback. Messages name the problem and, after a colon or dash, the fix.
"""


class UserError(Exception):
    """A problem with the user's input (a path, a config key, a checkpoint) rather than a bug."""
