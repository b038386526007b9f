"""The one error type of the systems model: bad input, described in one line."""


from rl_jax.errors import UserError


class SysModelError(UserError, ValueError):
    """An input the systems model cannot use (unknown accelerator, impossible layout, missing
    dtype, malformed measurement file, ...). The message names the problem."""
