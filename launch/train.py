r"""Single-machine entry point: runs the recipe a config file names.

    python -m launch.train --config=configs/tiny_lm.py --workdir=runs/tiny_lm \
        [--config.trainer.steps=200 ...]
"""

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Recipe config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and exports.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = _CONFIG.value
    logging.set_verbosity(logging.INFO)
    if config.recipe == "lm":
        from rl_jax.trainer import lm
        lm.run(config, _WORKDIR.value)
    else:
        raise app.UsageError(f"unknown recipe {config.recipe!r} in {flags.FLAGS['config'].value}")


if __name__ == "__main__":
    app.run(main)
