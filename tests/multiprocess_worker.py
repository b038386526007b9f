"""One process of a 2-process CPU mesh: takes two sharded train steps and prints the losses.

Usage: python multiprocess_worker.py PORT PROCESS_ID NUM_PROCESSES LOCAL_DEVICES
With NUM_PROCESSES=1 it runs the same computation in one process (the reference).
"""

import json
import os
import sys

port, process_id, num_processes, local_devices = sys.argv[1], *map(int, sys.argv[2:5])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={local_devices}"
os.environ["JAX_PLATFORMS"] = "cpu"

from rl_jax import distributed  # noqa: E402

distributed.initialize(f"127.0.0.1:{port}", num_processes, process_id, timeout_s=120)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from rl_jax.models.config import ModelConfig  # noqa: E402
from rl_jax.sharding import make_mesh  # noqa: E402
from rl_jax.trainer.state import ModelSpec, OptimizerConfig, init_state, make_optimizer  # noqa
from rl_jax.trainer.step import (LMBatch, batch_partition_spec, causal_lm_loss,  # noqa: E402
                                 global_batch, make_train_step)

cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8)
mesh = make_mesh(data=2, fsdp=2, tensor=2)
spec = ModelSpec(cfg, mesh=mesh)
tx = make_optimizer(OptimizerConfig(learning_rate=1e-2, warmup_steps=1, total_steps=10))
state = init_state(tx, spec, spec.init_params(seed=0))
step = make_train_step(spec, tx, causal_lm_loss, num_microbatches=2)
rng = np.random.RandomState(0)
b, t = 8, 16
batch = LMBatch.from_numpy(dict(
    tokens=rng.randint(0, 64, (b, t)), targets=rng.randint(0, 64, (b, t)),
    loss_mask=(rng.rand(b, t) > 0.3), positions=np.tile(np.arange(t), (b, 1)),
    segment_ids=np.ones((b, t))))
batch = global_batch(batch, NamedSharding(mesh, batch_partition_spec(spec)))
losses = []
for _ in range(2):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
if jax.process_index() == 0:
    print(json.dumps({"losses": losses, "devices": jax.device_count(),
                      "processes": jax.process_count()}), flush=True)
