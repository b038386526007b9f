r"""Layout planner: how many accelerators should train and how many generate, at which batch
sizes, and what throughput and staleness to expect.

    python -m launch.plan --config=configs/<recipe>.py --accelerator=h100 \
        --num_accelerators=64 --max_lag=8 [--outdir=DIR]

Prints the best layouts as tables and writes ``plan.json``, ``latency.png``, ``split.png`` and
``utilisation.png`` to ``--outdir``. Bad input stops with one line naming the problem (exit 2).
"""

import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Recipe config file.",
                                          lock_config=False)
_ACCELERATOR = flags.DEFINE_string(
    "accelerator", None, "h100, h200, b200, tpu_v5e, tpu_v5p, tpu_v6e, cpu (measured here), or "
    "a .json accelerator description.")
_NUM = flags.DEFINE_integer("num_accelerators", None, "Accelerators to split between pools.")
_MAX_LAG = flags.DEFINE_integer("max_lag", None, "Staleness bound (default: the config's "
                                "rollout.max_lag).")
_OUTDIR = flags.DEFINE_string("outdir", None, "Output directory (default runs/plan/<config>-"
                              "<accelerator>-<n>).")
_MODES = flags.DEFINE_list("modes", ["sync", "one_step_off", "async", "colocated"],
                           "Modes to consider (colocated: one pool generates, then trains).")
_DTYPE = flags.DEFINE_string("dtype", None, "Compute/weight dtype (default: the config's, "
                             "else bfloat16).")
_MFU = flags.DEFINE_float("mfu", 0.4, "Trainer model-FLOPs utilisation.")
_DECODE_EFF = flags.DEFINE_float("decode_efficiency", 0.6, "Share of the decode roofline the "
                                 "generator engine reaches.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", None, "Prompt tokens per sample.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", None, "Response length limit.")
_MEDIAN = flags.DEFINE_float("median_length", None, "Median response length (log-normal; "
                             "default max_new_tokens / 4).")
_SIGMA = flags.DEFINE_float("length_sigma", 0.8, "Log-normal sigma of response lengths.")
_LENGTHS = flags.DEFINE_string("lengths_file", "", "JSON file of measured response lengths.")
_LATENCY = flags.DEFINE_string("latency_file", "", "Measured decode latency "
                               "(benchmarks/results/generator_throughput.json).")
_LATENCY_MODEL = flags.DEFINE_string("latency_model", None, "Model name in --latency_file.")
_TRAIN_TPS = flags.DEFINE_float("trainer_tokens_per_s", None, "Measured trainer tokens/s per "
                                "accelerator (instead of FLOPs x MFU).")
_TRANSFER = flags.DEFINE_float("transfer_gbps", None, "Measured weight-transfer GB/s per chip, "
                               "one way (default: the within-host link when a layout fits on "
                               "one host, else the across-host network, at 0.8 of line rate).")
_TRANSFER_PATH = flags.DEFINE_string("transfer_path", "direct", "Weight updates device to device "
                                     "('direct') or staged through host memory ('host').")
_TP = flags.DEFINE_list("tp", ["1", "2", "4", "8"], "Tensor-parallel degrees per server.")
_BATCHES = flags.DEFINE_list("batches", ["8", "16", "32", "64", "128", "256", "512"],
                             "Decode batch sizes (slots per server).")
_KV_BYTES = flags.DEFINE_integer("kv_cache_bytes", 0, "A generator server's KV-cache budget in "
                                 "bytes, as the server's --kv_cache_bytes (0: enough pages for "
                                 "every slot to reach the longest sequence).")
_PAGE = flags.DEFINE_integer("page_size", 64, "Positions per page of the generators' KV cache "
                             "(the server's --page_size).")
_STEPS = flags.DEFINE_integer("steps", 12, "Optimizer steps per simulation.")
_SIM_TOP = flags.DEFINE_integer("simulate_top", 2, "Best estimates simulated per mode.")
_SPLITS = flags.DEFINE_integer("split_points", 8, "Train/generate splits simulated per mode.")
_TOP = flags.DEFINE_integer("top", 10, "Rows of the best-layout table.")


def fail(message: str):
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
    sys.exit(2)


def main(argv):
    if len(argv) > 1:
        fail(f"unexpected arguments: {argv[1:]}")
    from rl_jax.sysmodel.errors import SysModelError
    from rl_jax.sysmodel.plan import PlanRequest, run_plan

    try:
        config = _CONFIG.value
        if config is None:
            fail("--config is required")
        config.get("mode")  # a config file that failed to load raises here
    except OSError as e:
        fail(f"cannot load --config: {e}")
    if not _ACCELERATOR.value:
        fail("--accelerator is required")
    if _NUM.value is None:
        fail("--num_accelerators is required")
    try:
        request = PlanRequest(
            accelerator=_ACCELERATOR.value, num_accelerators=_NUM.value, max_lag=_MAX_LAG.value,
            modes=tuple(_MODES.value), dtype=_DTYPE.value, mfu=_MFU.value,
            decode_efficiency=_DECODE_EFF.value, prompt_len=_PROMPT_LEN.value,
            max_new_tokens=_MAX_NEW.value, median_length=_MEDIAN.value,
            length_sigma=_SIGMA.value, lengths_file=_LENGTHS.value,
            latency_file=_LATENCY.value, latency_model=_LATENCY_MODEL.value,
            trainer_tokens_per_s=_TRAIN_TPS.value, transfer_gbps=_TRANSFER.value,
            transfer_path=_TRANSFER_PATH.value,
            tensor_parallel=tuple(int(t) for t in _TP.value),
            batches=tuple(int(b) for b in _BATCHES.value), steps=_STEPS.value,
            simulate_top=_SIM_TOP.value, split_points=_SPLITS.value, top=_TOP.value,
            kv_cache_bytes=_KV_BYTES.value, page_size=_PAGE.value)
    except ValueError as e:
        fail(f"bad flag value: {e}")
    stem = config_flags.get_config_filename(flags.FLAGS["config"]).rsplit("/", 1)[-1]
    stem = stem.split(":")[0].removesuffix(".py")
    outdir = _OUTDIR.value or f"runs/plan/{stem}-{request.accelerator}-{request.num_accelerators}"
    try:
        report = run_plan(config, request, outdir)
    except SysModelError as e:
        fail(e)
    print(report.text)


def parse_flags(argv):
    """absl's parsing, with a bad command line or config file reported in one line."""
    try:
        return flags.FLAGS(argv)
    except Exception as e:  # every failure here is a bad command line or config file
        cause = e.__cause__ or e
        message = str(cause.args[0] if cause.args else cause)
        fail(f"bad flag: {message}")


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
