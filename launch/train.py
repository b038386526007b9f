r"""Single-machine entry point: runs the recipe a config file names, every role included.

    python -m launch.train --config=configs/tiny_rl.py --workdir=runs/tiny_rl \
        [--config.mode=sync --config.rollout.max_lag=4 ...]
    python -m launch.train --config=configs/tiny_lm.py --workdir=runs/tiny_lm

Recipe "rl" starts the generator servers (own processes), the weight publisher and the rollout
pipeline, and trains in this process; recipe "lm" is supervised training.

A config that cannot run stops before any work with one line naming the problem.
"""

import logging as std_logging
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Recipe config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and exports.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from rl_jax.errors import USER_ERRORS

    try:
        config = _CONFIG.value
    except OSError as e:
        print(f"error: cannot load --config: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
    logging.set_verbosity(logging.WARNING)
    std_logging.getLogger("rl_jax").setLevel(std_logging.INFO)
    try:
        if config.recipe == "lm":
            from rl_jax.trainer import lm
            lm.run(config, _WORKDIR.value)
        elif config.recipe == "rl":
            from rl_jax.orchestrator import rl
            from rl_jax.recipe.checks import parse
            rl.run(parse(config), _WORKDIR.value)
        else:
            raise app.UsageError(f"unknown recipe {config.recipe!r}")
    except USER_ERRORS as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    from launch.cli import parse_flags
    app.run(main, flags_parser=parse_flags)
