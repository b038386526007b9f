r"""Serves an HF checkpoint with the JAX engine over SGLang's HTTP API: the server process's entry
point (the pool launcher, :mod:`rl_jax.generator.launcher.pool`, starts it;
``launch.generator_server``
is the same command under the project's launcher directory).

    python -m rl_jax.generator.server.serve --model=DIR --port=30000 \
        [--host=127.0.0.1 --max_slots=32 --max_seq_len=512 --dtype=float32 \
         --tensor_parallel=1 --data_parallel=1 --weight_version=0 \
         --page_size=64 --kv_cache_bytes=0 | --mem_fraction_static=0.8]

API keys, as SGLang's --api-key / --admin-api-key (rl_jax.generator.auth): --api_key_file and
--admin_api_key_file, or the environment variables RL_JAX_API_KEY and RL_JAX_ADMIN_API_KEY
(--api_key / --admin_api_key also work, but a command line is visible to every local user).
The API key guards /generate and the information endpoints, the admin key every endpoint that
changes the server; /health stays open. A server bound beyond loopback without keys warns.

Prints one line starting with "rl_jax generator server ready at http://HOST:PORT" once it
answers requests; stops cleanly on SIGINT/SIGTERM. On CPU, --tensor_parallel=T and
--data_parallel=D force T*D host devices unless XLA_FLAGS already sets a count: D replicas of the
model, each with its own KV cache and max_slots/D of the slots on T devices, decode side by
side (on a CPU host, two replicas of one device each overlap one's matmuls with the other's
cache reads).
"""

import os
import sys

from absl import app, flags

_MODEL = flags.DEFINE_string("model", None, "HF checkpoint directory (config.json, "
                             "*.safetensors, optionally tokenizer.json).")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to bind.")
_PORT = flags.DEFINE_integer("port", 30000, "Port to bind (0: any free port).")
_MAX_SLOTS = flags.DEFINE_integer("max_slots", 32, "Sequences decoded together (KV slots).")
_MAX_SEQ_LEN = flags.DEFINE_integer("max_seq_len", 512, "Prompt + completion tokens per slot.")
_MAX_WAITING = flags.DEFINE_integer("max_waiting", 4096,
                                    "Queued sequences before requests get 503.")
_MAX_PREFILL = flags.DEFINE_integer("max_prefill_tokens", 2048,
                                    "Prompt tokens prefilled per scheduler step.")
_DTYPE = flags.DEFINE_enum("dtype", "auto", ["auto", "float32", "bfloat16", "float16"],
                           "Parameter and computation dtype (auto: bfloat16 on GPUs and TPUs, "
                           "float32 on CPUs).")
_TP = flags.DEFINE_integer("tensor_parallel", 1, "Devices the model is split over.")
_DP = flags.DEFINE_integer("data_parallel", 1, "Replicas of the model (SGLang's --dp-size), "
                           "each on tensor_parallel devices of its own.")
_DECODE_STEPS = flags.DEFINE_integer(
    "num_continuous_decode_steps", 0, "Decode steps run as one program, new requests admitted "
    "between programs (SGLang's --num-continuous-decode-steps): fewer host round trips per "
    "token. 0: 8 on GPUs and TPUs, 1 on CPUs.")
_ATTENTION = flags.DEFINE_enum(
    "attention_backend", "auto", ["auto", "native", "pallas", "xla"], "Decode attention "
    "(SGLang's --attention-backend): the native CPU kernel, compiled on first use, or the "
    "Pallas kernel (GPU; interpreted, slow, on CPU), both of which read each sequence's cache "
    "up to its length only; XLA's; or auto: native on CPU, pallas on GPU, where they run.")
_PREFILL_ATTENTION = flags.DEFINE_enum(
    "prefill_attention_backend", "auto", ["auto", "xla", "cudnn", "splash"], "Prompt attention "
    "(SGLang's --prefill-attention-backend): cuDNN flash attention (NVIDIA GPUs, bf16/fp16), "
    "the splash kernel (TPUs, prompt buckets of multiples of 128 tokens, one device), XLA's, "
    "or auto: cudnn on GPU, splash on TPU, where they take the prompt bucket, else XLA's.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 64, "Tokens per page of the paged KV cache "
                                  "(SGLang's --page-size).")
_KV_BYTES = flags.DEFINE_integer("kv_cache_bytes", 0, "Bytes of KV cache per data-parallel "
                                 "replica (0: max_slots x max_seq_len tokens, unless "
                                 "--mem_fraction_static).")
_MEM_FRACTION = flags.DEFINE_float(
    "mem_fraction_static", 0.0, "Share of a replica's memory (accelerator memory; on CPU the "
    "host's over the replicas) that weights and KV cache take together, the cache getting what "
    "the weights leave (SGLang's --mem-fraction-static); 0: see --kv_cache_bytes.")
_VERSION = flags.DEFINE_integer("weight_version", 0, "Version of the initial weights.")
_STRICT = flags.DEFINE_bool("strict", True, "Refuse sampling controls the engine cannot "
                            "honour (penalties, grammars, ...); --nostrict ignores them.")
_WARMUP = flags.DEFINE_bool("warmup", True, "Compile before reporting ready.")
_WARMUP_SHAPES = flags.DEFINE_bool("warmup_shapes", False, "Also compile every decode batch "
                                   "size and length before reporting ready (no compilation "
                                   "stalls later; a slower start).")
_NAME = flags.DEFINE_string("served_model_name", None, "Model id in /v1/models.")
_PARENT = flags.DEFINE_integer("parent_pid", 0, "Exit when this process (the launcher) is gone.")
_PUBLISHER = flags.DEFINE_string("publisher_url", None, "The trainer's weight publisher "
                                 "(rl_jax.transfer), for /update_weights_from_transfer: the "
                                 "only one this server pulls from, and the only address its "
                                 "transfer token (RL_JAX_TRANSFER_TOKEN) is sent to.")
_PULL_ON_START = flags.DEFINE_bool("pull_on_start", True, "With --publisher_url: pull the "
                                   "newest published version before serving (--nopull_on_start "
                                   "when the publisher starts after the server).")
_CPU_CORES = flags.DEFINE_string("cpu_cores", "", "CPU cores to run on, e.g. '1' or '2-3' "
                                 "(taskset syntax; empty: any).")
_API_KEY = flags.DEFINE_string("api_key", None, "API key for the normal endpoints (SGLang's "
                               "--api-key); prefer --api_key_file or RL_JAX_API_KEY.")
_API_KEY_FILE = flags.DEFINE_string("api_key_file", None, "File holding the API key.")
_ADMIN_KEY = flags.DEFINE_string("admin_api_key", None, "Admin API key for the endpoints that "
                                 "change the server (SGLang's --admin-api-key); prefer "
                                 "--admin_api_key_file or RL_JAX_ADMIN_API_KEY.")
_ADMIN_KEY_FILE = flags.DEFINE_string("admin_api_key_file", None,
                                      "File holding the admin API key.")
flags.mark_flags_as_required(["model"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _CPU_CORES.value:  # before jax starts its thread pools
        try:
            from rl_jax.cpus import pin
            pin(_CPU_CORES.value)
        except (ValueError, OSError) as e:
            print(f"error: --cpu_cores={_CPU_CORES.value}: {e}", file=sys.stderr)
            sys.exit(2)
    devices = _TP.value * _DP.value
    if devices > 1 and "xla_force_host_platform_device_count" not in os.environ.get(
            "XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={devices}")
    from rl_jax.errors import USER_ERRORS
    from rl_jax.generator import auth
    from rl_jax.generator.server import app as server
    from rl_jax.generator.server.config import ServerConfig

    try:
        keys = auth.load_keys(_API_KEY.value, _API_KEY_FILE.value, _ADMIN_KEY.value,
                              _ADMIN_KEY_FILE.value)
    except auth.AuthConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    for name in (auth.API_KEY_ENV, auth.ADMIN_API_KEY_ENV):  # not for this process's children
        os.environ.pop(name, None)

    config = ServerConfig(
        model=_MODEL.value, host=_HOST.value, port=_PORT.value, max_slots=_MAX_SLOTS.value,
        max_seq_len=_MAX_SEQ_LEN.value, max_waiting=_MAX_WAITING.value,
        max_prefill_tokens=_MAX_PREFILL.value, dtype=_DTYPE.value, tensor_parallel=_TP.value,
        data_parallel=_DP.value, decode_steps=_DECODE_STEPS.value,
        attention_backend=_ATTENTION.value,
        prefill_attention_backend=_PREFILL_ATTENTION.value, page_size=_PAGE_SIZE.value,
        kv_cache_bytes=_KV_BYTES.value, mem_fraction_static=_MEM_FRACTION.value,
        weight_version=_VERSION.value, strict=_STRICT.value, warmup=_WARMUP.value,
        warmup_shapes=_WARMUP_SHAPES.value,
        served_model_name=_NAME.value, parent_pid=_PARENT.value,
        publisher_url=_PUBLISHER.value, pull_on_start=_PULL_ON_START.value, keys=keys)
    try:
        server.run(config)
    except USER_ERRORS as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # e.g. the port is taken
        print(f"error: cannot serve on {config.host}:{config.port}: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    app.run(main)
