"""Command-line plumbing shared by the launchers."""

import sys

from absl import flags


def parse_flags(argv):
    """absl's parsing, with config overrides that name unknown keys or wrong types reported
    in one line."""
    try:
        return flags.FLAGS(argv)
    except Exception as e:  # every failure here is a bad command line or config file
        cause = e.__cause__ or e
        message = str(cause.args[0] if cause.args else cause)
        message = message.encode().decode("unicode_escape").replace("'", "")
        message = " ".join(message.split())
        print(f"error: bad flag: {message}", file=sys.stderr)
        sys.exit(2)
