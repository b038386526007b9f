"""One process of the transfer tests: a trainer (publisher) or a generator (engine + puller).

Usage:
  python transfer_worker.py trainer DEVICES TRANSPORTS DISK_DIR|- CHUNK_BYTES
  python transfer_worker.py generator DEVICES TENSOR_PARALLEL URL TIMEOUT_S CONNECTIONS [TRANSPORTS]

Driven over stdin/stdout: one JSON command per input line, one ``@@ {json}`` reply per command
(other output is noise). Parameters of version ``v`` are random with seed ``v``,
so every process can tell which version it holds from the SHA-256 of each full tensor.
"""

import hashlib
import json
import os
import signal
import sys
import time
import traceback

role = sys.argv[1]
devices = int(sys.argv[2])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from rl_jax.sharding import make_mesh  # noqa: E402
from rl_jax.trainer.state import ModelSpec  # noqa: E402
from rl_jax.transfer.puller.generator import GeneratorPuller  # noqa: E402
from rl_jax.transfer.publisher.core import Publisher  # noqa: E402
from rl_jax.transfer.config import PublisherConfig, PullerConfig  # noqa: E402
from rl_jax.transfer.errors import TransferError  # noqa: E402
from rl_jax.transfer.layout import flatten  # noqa: E402
from transfer_fixtures import CONFIG, make_params  # noqa: E402

ALL = ["shm", "socket", "jax_transfer", "disk"]


def reply(**data):
    print("@@ " + json.dumps(data), flush=True)


def hashes(params) -> dict:
    return {n: hashlib.sha256(np.asarray(jax.device_get(v)).tobytes()).hexdigest()
            for n, v in sorted(flatten(params).items())}


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def trainer():
    transports = sys.argv[3].split(",")
    disk_dir = None if sys.argv[4] == "-" else sys.argv[4]
    spec = ModelSpec(CONFIG, mesh=make_mesh(data=1, fsdp=devices, tensor=1))
    publisher = Publisher(PublisherConfig(transports=tuple(transports), disk_dir=disk_dir,
                                          chunk_bytes=int(sys.argv[5])), spec=spec)
    reply(url=publisher.url, devices=jax.device_count())
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "wait_layouts":
                reply(ok=publisher.wait_for_layouts(cmd["n"], 120), layouts=publisher.layouts())
            elif cmd["cmd"] == "publish":
                version = cmd["version"]
                params = make_params(spec, version)
                if cmd.get("corrupt"):
                    publisher.faults["corrupt"] = {"version": version, "tensor": cmd["corrupt"]}
                if cmd.get("die_before_announce"):
                    publisher.hooks["before_announce"] = lambda v: die()
                if cmd.get("die_after_announce"):  # once waiting pullers got the manifest
                    publisher.hooks["after_announce"] = lambda v: (time.sleep(1.0), die())
                stats = publisher.publish(params, version)
                sharded = {n: str(v.sharding.spec) for n, v in flatten(params).items()}
                reply(version=version, hashes=hashes(params), seconds=stats.seconds,
                      bytes=stats.bytes, errors=stats.errors, trainer_specs=sharded)
            elif cmd["cmd"] == "reports":
                reply(reports=list(publisher.reports))
            elif cmd["cmd"] == "quit":
                publisher.close()
                reply(ok=True)
                return
        except Exception as e:
            reply(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])


def generator():
    from rl_jax.generator.engine.core import Engine
    from rl_jax.generator.engine.weights import generator_rules

    tp, url = int(sys.argv[3]), sys.argv[4]
    timeout, connections = float(sys.argv[5]), int(sys.argv[6])
    transports = sys.argv[7].split(",") if len(sys.argv) > 7 else ALL
    mesh = make_mesh(data=1, fsdp=1, tensor=tp, devices=jax.devices()[:tp]) if tp > 1 else None
    spec = ModelSpec(CONFIG, mesh=mesh, rules=generator_rules())
    engine = Engine(CONFIG, make_params(spec, 0), version=0, mesh=mesh,
                    rules=generator_rules())
    puller = GeneratorPuller(url, config=PullerConfig(timeout_s=timeout,
                                                      socket_connections=connections),
                             transports=transports)
    puller.puller(engine.params).register()
    reply(ready=True, layout=puller.puller(engine.params).layout_key)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            reply(ok=True)
            break
        if cmd["cmd"] == "hashes":
            reply(version=engine.version, hashes=hashes(engine.params))
            continue
        low = puller.puller(engine.params)
        if cmd.get("die_mid_pull"):
            low.hooks["mid_pull"] = die
        elif cmd.get("block_mid_pull"):
            def block():
                reply(mid_pull=True)
                sys.stdin.readline()  # the test kills the publisher, then says go on
            low.hooks["mid_pull"] = block
        else:
            low.hooks.pop("mid_pull", None)
        try:
            if cmd.get("again"):  # pull the current version again (through another transport)
                update = low.pull(engine.version - 1, current=engine.version,
                                  transport=cmd.get("transport"))
            else:
                update = puller.pull_latest(engine, wait_s=cmd.get("wait", 0.0),
                                            transport=cmd.get("transport"))
        except TransferError as e:
            reply(version=engine.version, error=f"{type(e).__name__}: {e}")
            continue
        if update is not None:
            engine.update_weights(update.params, update.version)
            assert engine.wait_for_version(update.version, 60)
            specs = {n: str(v.sharding.spec) if hasattr(v.sharding, "spec") else "single"
                     for n, v in flatten(update.params).items()}
            reply(version=engine.version, pulled=update.version,
                  metrics=update.metrics.to_json(), hashes=hashes(engine.params), specs=specs,
                  devices=sorted({d.id for v in flatten(update.params).values()
                                  for d in v.sharding.device_set}))
        else:
            reply(version=engine.version, pulled=None)
    engine.shutdown()


if __name__ == "__main__":
    trainer() if role == "trainer" else generator()
