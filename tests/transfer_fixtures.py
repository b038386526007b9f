"""The model shape and parameters shared by the transfer tests and their worker processes."""

import socket
import threading

import jax
import numpy as np

from rl_jax.models.config import ModelConfig

# ~1.4 MB of float32 parameters: every dimension with an "embed" axis divides by 8.
CONFIG = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=32)


def make_params(spec, seed: int):
    """Random parameters drawn in NumPy and placed in ``spec``'s shardings (nothing compiles)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda a, s: jax.device_put(rng.standard_normal(a.shape).astype(a.dtype), s),
        spec.abstract_params, spec.param_shardings)


class LoopbackPeer:
    """A raw TCP listener on loopback for hostile-peer tests: each connection is handed to
    :meth:`serve` in a thread of its own; ``url`` is its HTTP address. A subclass sets its own
    attributes before calling ``super().__init__()`` (connections may arrive at once)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, conn: socket.socket):
        raise NotImplementedError  # each peer answers in its own (hostile) way

    def close(self):
        self._stop.set()
        self.sock.close()
