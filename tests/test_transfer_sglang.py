"""SGLang's distributed weight protocol on CPU: the trainer (this process, 8-device FSDP mesh)
joins a gloo group with a generator process (2-device tensor parallel engine) through
``/init_weights_update_group`` and broadcasts bucketed HF tensors with
``/update_weights_from_distributed``; the engine must end up with the trainer's weights bit for
bit."""

import hashlib
import json
import socket
import urllib.request

import jax
import numpy as np
import pytest

pytest.importorskip("torch")

from rl_jax.sharding import make_mesh  # noqa: E402
from rl_jax.trainer.state import ModelSpec  # noqa: E402
from rl_jax.transfer.layout import flatten  # noqa: E402
from rl_jax.transfer.sglang import SGLangWeightSender  # noqa: E402
from transfer_procs import Worker  # noqa: E402
from transfer_fixtures import CONFIG, make_params  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_distributed_update_reaches_a_tensor_parallel_engine_bit_exact():
    receiver = Worker(2, name="sglang-receiver", script="sglang_receiver_worker.py")
    try:
        url = receiver.reply()["url"]
        spec = ModelSpec(CONFIG, mesh=make_mesh(data=1, fsdp=8, tensor=1))
        sender = SGLangWeightSender([url], CONFIG, master_address="127.0.0.1",
                                    master_port=_free_port(), bucket_bytes=256 << 10,
                                    timeout_s=120)
        sender.init_group()
        for version in (1, 2):
            params = make_params(spec, version)
            stats = sender.send(params, version)
            assert stats.buckets > 1 and stats.bytes > 1_000_000
            with urllib.request.urlopen(f"{url}/hashes", timeout=60) as resp:
                got = json.loads(resp.read())
            want = {n: hashlib.sha256(np.asarray(jax.device_get(v)).tobytes()).hexdigest()
                    for n, v in sorted(flatten(params).items())}
            assert got["version"] == version and got["hashes"] == want
        sender.close()
    finally:
        receiver.kill()
