r"""A multi-host RL run on a Ray cluster, from one command: the trainer processes (one per node,
joined by ``jax.distributed`` with the coordinator on the first), the generator servers (this
project's or SGLang's) and optionally SGLang's router, each placed by the resources it asks for;
dead servers restarted, every process's output in ``<workdir>/logs/<role>-<i>.log``, everything
stopped on Ctrl-C or when the trainers finish (``rl_jax.cluster.ray_cluster``).

    ray start --head ...; ray start --address=HEAD:6379 ...     # the cluster (each node)
    python -m launch.ray_launch --workdir=/shared/runs/x --num_trainers=2 \
        --trainer_resources='{"GPU": 8}' --num_generators=4 --generator_resources='{"GPU": 2}' \
        --generator_model=/shared/base --router \
        -- --config=configs/tiny_rl.py --config.base.checkpoint=/shared/base

Flags after ``--`` go to every ``launch.trainer`` process (the recipe and its overrides); the
launcher adds ``--workdir``, ``--coordinator``, ``--num_processes``, ``--process_id``,
``--generator_urls``, ``--publisher_host`` and the publisher's port. The servers' API keys come
from ``--api_key_file`` / ``--admin_api_key_file`` (or ``RL_JAX_API_KEY`` /
``RL_JAX_ADMIN_API_KEY``), else fresh ones for the run; the weight publisher's token from
``RL_JAX_TRANSFER_TOKEN``, else a fresh one. Needs ``pip install 'rl_jax[ray]'`` on every node,
and this checkout (or the installed package) at the same path on every node.
"""

import os
import secrets
import shlex
import sys

from absl import app, flags

_RAY_ADDRESS = flags.DEFINE_string("ray_address", "auto", "The Ray cluster (ray.init's "
                                   "address: auto, HOST:PORT or ray://HOST:PORT).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (shared by the trainer nodes); "
                               "logs go to WORKDIR/logs.")
_NUM_TRAINERS = flags.DEFINE_integer("num_trainers", 1, "Trainer processes, one per node.")
_TRAINER_RESOURCES = flags.DEFINE_string(
    "trainer_resources", '{"CPU": 1}', "What each trainer process holds, as JSON: CPU, GPU, "
    "memory (bytes), TPU and custom resources, e.g. '{\"GPU\": 8}'.")
_TRAINER_STRATEGY = flags.DEFINE_enum(
    "trainer_strategy", "STRICT_SPREAD", ["STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK"],
    "Placement-group strategy of the trainers (STRICT_SPREAD: one per node).")
_TRAINER_ENV = flags.DEFINE_multi_string("trainer_env", [], "KEY=VALUE set in every trainer "
                                         "process's environment (repeatable).")
_COORDINATOR_PORT = flags.DEFINE_integer("coordinator_port", 0, "jax.distributed's port on "
                                         "the first trainer's node (0: a free one).")
_PUBLISHER_PORT = flags.DEFINE_integer("publisher_port", 0, "The weight publisher's port on "
                                       "the first trainer's node (0: a free one).")
_NUM_GENERATORS = flags.DEFINE_integer("num_generators", 1, "Generator servers.")
_GENERATOR_KIND = flags.DEFINE_enum("generator_kind", "rl_jax", ["rl_jax", "sglang"],
                                    "rl_jax: launch.generator_server; sglang: "
                                    "python -m sglang.launch_server.")
_GENERATOR_PYTHON = flags.DEFINE_string(
    "generator_python", "", "The Python that runs the generator servers on their nodes (\"\": "
    "the node's own). SGLang runs in an environment of its own: its venv's or container's "
    "python, at the same path on every generator node.")
_GENERATOR_MODEL = flags.DEFINE_string("generator_model", None, "The checkpoint the servers "
                                       "load (a path every generator node sees).")
_GENERATOR_RESOURCES = flags.DEFINE_string(
    "generator_resources", '{"CPU": 1}', "What each server holds, as JSON (see "
    "--trainer_resources); e.g. '{\"GPU\": 2}' with --generator_args='--tp-size 2'.")
_GENERATOR_ARGS = flags.DEFINE_string("generator_args", "", "Further server flags, one "
                                      "shell-quoted string, e.g. '--max_slots=64'.")
_GENERATOR_ENV = flags.DEFINE_multi_string("generator_env", [], "KEY=VALUE set in every "
                                           "server's environment (repeatable).")
_GENERATOR_PORT = flags.DEFINE_integer("generator_port", 0, "Every server's port (0: a free "
                                       "port of its node).")
_MAX_RESTARTS = flags.DEFINE_integer("max_restarts", 3, "Restarts of each generator server "
                                     "(and the router) after it dies.")
_STARTUP_TIMEOUT = flags.DEFINE_float("startup_timeout_s", 900.0, "Seconds servers may take "
                                      "to answer /health.")
_STOP_TIMEOUT = flags.DEFINE_float("stop_timeout_s", 30.0, "Seconds a process gets to exit "
                                   "after SIGINT (trainers) or SIGTERM (servers, router) "
                                   "before SIGKILL.")
_PLACEMENT_TIMEOUT = flags.DEFINE_float("placement_timeout_s", 300.0, "Seconds a role may "
                                        "wait for its resources before the launch fails.")
_ROUTER = flags.DEFINE_bool("router", False, "Start SGLang's router (sglang-router) in front "
                            "of the servers.")
_ROUTER_PORT = flags.DEFINE_integer("router_port", 0, "The router's port (0: a free one).")
_ROUTER_RESOURCES = flags.DEFINE_string("router_resources", '{"CPU": 0}', "What the router "
                                        "holds, as JSON (a custom resource pins its node).")
_ROUTER_ARGS = flags.DEFINE_string("router_args", "", "Further router flags, one "
                                   "shell-quoted string, e.g. '--policy round_robin'.")
_API_KEY_FILE = flags.DEFINE_string("api_key_file", None, "File holding the servers' API key "
                                    "(default: RL_JAX_API_KEY, else a fresh key).")
_ADMIN_KEY_FILE = flags.DEFINE_string("admin_api_key_file", None, "File holding the servers' "
                                      "admin API key (default: RL_JAX_ADMIN_API_KEY, else a "
                                      "fresh key).")
flags.mark_flags_as_required(["workdir", "generator_model"])


def _keys() -> tuple[str, str]:
    from rl_jax.generator.auth import AuthConfigError, load_keys
    try:
        keys = load_keys(api_key_file=_API_KEY_FILE.value,
                         admin_api_key_file=_ADMIN_KEY_FILE.value)
    except AuthConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    return (keys.api_key or secrets.token_urlsafe(32),
            keys.admin_api_key or secrets.token_urlsafe(32))


def _split(flag) -> tuple[str, ...]:
    try:
        return tuple(shlex.split(flag.value))
    except ValueError as e:
        print(f"error: --{flag.name}: {e}", file=sys.stderr)
        sys.exit(2)


def main(argv):
    from rl_jax.cluster.ray_cluster import run
    from rl_jax.cluster.spec import LaunchSpec, Resources, RoleSpec, parse_env
    from rl_jax.errors import USER_ERRORS

    try:
        spec = LaunchSpec(
            workdir=_WORKDIR.value,
            trainers=RoleSpec(_NUM_TRAINERS.value,
                              Resources.parse(_TRAINER_RESOURCES.value, "--trainer_resources"),
                              tuple(argv[1:]), parse_env(_TRAINER_ENV.value, "--trainer_env")),
            generators=RoleSpec(_NUM_GENERATORS.value,
                                Resources.parse(_GENERATOR_RESOURCES.value,
                                                "--generator_resources"),
                                _split(_GENERATOR_ARGS),
                                parse_env(_GENERATOR_ENV.value, "--generator_env")),
            generator_kind=_GENERATOR_KIND.value, generator_model=_GENERATOR_MODEL.value,
            generator_python=_GENERATOR_PYTHON.value,
            router=RoleSpec(int(_ROUTER.value),
                            Resources.parse(_ROUTER_RESOURCES.value, "--router_resources"),
                            _split(_ROUTER_ARGS)),
            trainer_strategy=_TRAINER_STRATEGY.value, coordinator_port=_COORDINATOR_PORT.value,
            publisher_port=_PUBLISHER_PORT.value, generator_port=_GENERATOR_PORT.value,
            router_port=_ROUTER_PORT.value, max_restarts=_MAX_RESTARTS.value,
            startup_timeout_s=_STARTUP_TIMEOUT.value, stop_timeout_s=_STOP_TIMEOUT.value)
        code = run(spec, ray_address=_RAY_ADDRESS.value, keys=_keys(),
                   transfer_token=os.environ.get("RL_JAX_TRANSFER_TOKEN") or None,
                   placement_timeout_s=_PLACEMENT_TIMEOUT.value)
    except USER_ERRORS as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(code)


if __name__ == "__main__":
    from launch.cli import parse_flags
    app.run(main, flags_parser=parse_flags)
