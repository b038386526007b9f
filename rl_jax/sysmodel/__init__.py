"""Systems model and layout planner for asynchronous RL (NumPy and the standard library only;
nothing here imports JAX at module level).

Given a model shape, an accelerator, a budget of accelerators, the RL batch (prompts × samples),
a response-length distribution and ``max_lag``, it answers: how many accelerators should train and
how many generate, with which tensor-parallel degree and decode batch, and what throughput and
staleness follow — from first principles (datasheets, rooflines, FLOP counts) or from measured
curves.

Modules:
  accelerators  catalogue (H100, H200, B200, TPU v5e/v5p/v6e from datasheets; CPU measured)
  shape         ModelShape: parameters, FLOPs per token (train 6·N + attention, decode 2·N +
                attention), KV bytes per token
  memory        memory per device of the trainer's step (state, gradients, saved activations
                per remat policy, the largest transient) and of a generator server (weights,
                decode layout, KV cache, weight-update copy, prefill)
  latency       decode step latency vs batch (roofline capped by KV capacity, or measured) and
                the trainer's step time (FLOPs and MFU, or measured tokens/s)
  lengths       response-length distributions (measured, log-normal with a long tail, constant)
  invariants    closed-form balance, staleness bound, steady state
  weightsync    weight-transfer time: the link by placement (within a host or across hosts),
                host staging, fixed cost per update
  simulator     discrete-event simulation of ``sync``, ``one_step_off``, ``async`` and
                ``colocated``
  cluster       an RL job as other systems lay it out (colocated or split, paged generators):
                trainer work per token (log-prob, reference and remat passes), data-parallel
                collectives, the decode step's fixed cost, phase switches; ``predict_step``
  sweep         layouts over a budget under a staleness limit: best layout and frontier
  predict       ``predict_run``: a measured run's prediction, for validation
  recipe        model shape and rollout settings from a recipe config
  plots         PNG plots (matplotlib, imported when called)

Validation hook (``rl_jax.sysmodel.predict.predict_run``)::

    predict_run(*, decode_latency, trainer_tokens_per_s, response_lengths, prompt_len,
                group_size, groups_per_batch, max_lag, mode, num_servers, slots_per_server,
                num_steps=20, weight_transfer_s=0.0, trainer_step_overhead_s=0.0,
                prefill_s_per_token=0.0, swap_pause_s=0.0, warmup_steps=None, seed=0)
        -> RunPrediction

- ``decode_latency``: ``{batch: seconds}`` or ``[(batch, seconds)]``, one server's measured
  decode step time by batch size;
- ``trainer_tokens_per_s``: measured trainer throughput on batch tokens (prompt + completion);
- ``response_lengths``: measured completion lengths (tokens);
- ``prompt_len`` tokens per sample; ``group_size`` samples per prompt; ``groups_per_batch``
  prompts per optimizer step; ``max_lag`` versions; ``mode`` in ``sync | one_step_off | async``;
- ``num_servers`` generator servers of ``slots_per_server`` concurrent sequences each;
- ``num_steps`` optimizer steps in the run; ``weight_transfer_s`` from step end to weights usable
  on the servers; ``trainer_step_overhead_s`` fixed per step; ``prefill_s_per_token`` per prompt
  token of a starting sample; ``swap_pause_s`` per in-flight weight swap.

``RunPrediction`` has ``tokens_per_s`` (trained tokens/s over the whole run),
``steady_tokens_per_s`` (after warm-up), ``completion_tokens_per_s``, ``trainer_idle_fraction``,
``generator_idle_fraction``, ``generator_slot_utilisation``, ``staleness_max``,
``staleness_mean``, ``staleness_histogram`` (per group: trainer version at consumption minus the
oldest token version), ``wall_s``, ``estimate`` (the closed form) and ``sim`` (the full
``SimResult`` with utilisation timelines); ``to_dict()`` gives JSON-ready values.
"""


