r"""The trainer of a multi-host RL run: one process per trainer host, all joining one JAX mesh
through ``jax.distributed``; generator servers (this project's or SGLang's) run elsewhere and are
given by URL. Process 0 drives the rollout, publishes weights and evaluates; every process trains.

    # on each trainer host i of N (coordinator = host 0):
    python -m launch.trainer --config=configs/tiny_rl.py --workdir=/shared/runs/x \
        --coordinator=host0:12355 --num_processes=N --process_id=i \
        --generator_urls=http://gen0:30000,http://gen1:30000 --publisher_host=host0 \
        --config.base.checkpoint=/shared/base

``--publisher_host`` is the address generator servers use to reach process 0's weight
publisher. The same run on one machine: ``python -m launch.train``.
"""

import logging as std_logging
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Recipe config file (recipe 'rl').",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (shared by the trainer hosts).")
_COORDINATOR = flags.DEFINE_string("coordinator", "", "host:port of process 0 for "
                                   "jax.distributed, or 'auto' (JAX's cluster detection: "
                                   "Slurm, Open MPI, Kubernetes, Cloud TPU, which also give "
                                   "the process count and index); empty: a single trainer "
                                   "process.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 1, "Trainer processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", 0, "This process's index.")
_URLS = flags.DEFINE_list("generator_urls", [], "Generator servers (default: the config's "
                          "generator.urls, or servers started on this host).")
_PUBLISHER_HOST = flags.DEFINE_string("publisher_host", "", "Address the generator servers "
                                      "reach the weight publisher at (default: the config's).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from rl_jax.errors import USER_ERRORS
    from rl_jax.orchestrator import rl
    from rl_jax.recipe.checks import parse, replace_fields

    config = _CONFIG.value
    if config.recipe != "rl":
        print(f"error: launch.trainer runs recipe 'rl', the config has {config.recipe!r}",
              file=sys.stderr)
        sys.exit(2)
    logging.set_verbosity(logging.WARNING)
    std_logging.getLogger("rl_jax").setLevel(std_logging.INFO)
    try:
        changes = {"distributed.coordinator": _COORDINATOR.value,
                   "distributed.num_processes": _NUM_PROCESSES.value,
                   "distributed.process_id": _PROCESS_ID.value}
        if _URLS.value:
            changes["generator.urls"] = tuple(_URLS.value)
        if _PUBLISHER_HOST.value:
            changes["transfer.host"] = _PUBLISHER_HOST.value
        rl.run(replace_fields(parse(config), changes), _WORKDIR.value)
    except USER_ERRORS as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    from launch.cli import parse_flags
    app.run(main, flags_parser=parse_flags)
