"""SGLang's router (``sglang_router.launch_router``, its flags unchanged) with the workers' API
key taken from ``RL_JAX_API_KEY`` instead of its ``--api-key`` flag, which every local user could
read on the command line. The router uses the key for its requests to the workers (the probes
that register them); clients' own keys pass through with their requests.

    RL_JAX_API_KEY=... python -m rl_jax.cluster.router --host 0.0.0.0 --port 30000 \
        --worker-urls http://gen0:30000 http://gen1:30000 [--policy round_robin ...]
"""

import os
import sys


def main(argv: list[str]) -> None:
    if any(a == "--api-key" or a.startswith("--api-key=") for a in argv):
        print("error: give the workers' API key in RL_JAX_API_KEY, not --api-key",
              file=sys.stderr)
        sys.exit(2)
    from sglang_router.launch_router import launch_router, parse_router_args

    args = parse_router_args(argv)
    args.api_key = os.environ.pop("RL_JAX_API_KEY", None) or None
    os.environ.pop("RL_JAX_ADMIN_API_KEY", None)
    launch_router(args)


if __name__ == "__main__":
    main(sys.argv[1:])
