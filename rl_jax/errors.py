"""The root of the error types that describe bad user input (configs, checkpoints, meshes).

A leaf module: each package defines its own errors where they belong and derives the
user-facing ones from :class:`UserError`, so entry points catch ``USER_ERRORS`` and print one
line instead of a traceback without this module importing any package.
"""


class RLJaxError(Exception):
    """Base of the errors this library raises on purpose."""


class UserError(RLJaxError):
    """Bad user input (a config, a checkpoint, a mesh, a file): the message names the problem
    and an entry point prints it as one line."""


USER_ERRORS: tuple[type[BaseException], ...] = (UserError,)
