r"""Serves an HF checkpoint with the JAX engine over SGLang's HTTP API.

    python -m launch.generator_server --model=DIR --port=30000 \
        [--host=127.0.0.1 --max_slots=32 --max_seq_len=512 --dtype=float32 \
         --tensor_parallel=1 --data_parallel=1 --weight_version=0]

The same command as ``python -m rl_jax.generator.server.serve`` (its flags, keys, ready line and
exit
codes: see that module), which the pool launcher runs.
"""

from absl import app

from rl_jax.generator.server.serve import main

if __name__ == "__main__":
    app.run(main)
