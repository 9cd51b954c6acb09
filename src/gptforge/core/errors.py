"""The one exception type for mistakes a user can fix.

A leaf module: it imports nothing, so every layer of the package may raise it. The CLI prints the message
without a traceback and exits with status 2; anything else is a bug and keeps its traceback (status 1).
"""


class UserError(Exception):
    """Bad input from the user. The message names the flag or file at fault and says what to change."""
