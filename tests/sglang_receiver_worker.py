"""A generator process speaking SGLang's distributed weight-update endpoints (reference wiring
for the generator server): ``/init_weights_update_group`` and
``/update_weights_from_distributed`` over :class:`DistributedWeightReceiver` into a live engine.

Usage: python sglang_receiver_worker.py TENSOR_PARALLEL   (prints ``@@ {"url": ...}``)
"""

import asyncio
import hashlib
import json
import os
import sys

tp = int(sys.argv[1])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={tp}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from aiohttp import web  # noqa: E402

from rl_jax.generator.engine import Engine  # noqa: E402
from rl_jax.generator.weights import generator_rules  # noqa: E402
from rl_jax.sharding import make_mesh  # noqa: E402
from rl_jax.trainer.state import ModelSpec  # noqa: E402
from rl_jax.transfer import TransferError  # noqa: E402
from rl_jax.transfer.layout import flatten  # noqa: E402
from rl_jax.transfer.sglang import DistributedWeightReceiver  # noqa: E402
from transfer_fixtures import CONFIG, make_params  # noqa: E402

mesh = make_mesh(data=1, fsdp=1, tensor=tp) if tp > 1 else None
spec = ModelSpec(CONFIG, mesh=mesh, rules=generator_rules())
engine = Engine(CONFIG, make_params(spec, 0), version=0, mesh=mesh, rules=generator_rules())
receiver = DistributedWeightReceiver(CONFIG, engine.params)


async def init_group(request):
    body = await request.json()
    try:
        await asyncio.to_thread(receiver.init_group, body["master_address"],
                                body["master_port"], body["rank_offset"], body["world_size"],
                                body.get("group_name", "rl_jax_weights"),
                                body.get("backend", "gloo"))
    except TransferError as e:
        return web.json_response({"success": False, "message": str(e)}, status=400)
    return web.json_response({"success": True, "message": "joined"})


async def update_distributed(request):
    body = await request.json()
    try:
        done = await asyncio.to_thread(receiver.receive, body["names"], body["dtypes"],
                                       body["shapes"], body.get("group_name"),
                                       body.get("weight_version"))
    except TransferError as e:
        return web.json_response({"success": False, "message": str(e)}, status=400)
    if done is not None:
        params, version = done
        engine.update_weights(params, int(version))
        await asyncio.to_thread(engine.wait_for_version, int(version), 60)
    return web.json_response({"success": True, "message": "ok", "complete": done is not None,
                              "weight_version": engine.version})


async def hashes(request):
    return web.json_response({"version": engine.version, "hashes": {
        n: hashlib.sha256(np.asarray(jax.device_get(v)).tobytes()).hexdigest()
        for n, v in sorted(flatten(engine.params).items())}})


async def main():
    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/init_weights_update_group", init_group)
    app.router.add_post("/update_weights_from_distributed", update_distributed)
    app.router.add_get("/hashes", hashes)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print("@@ " + json.dumps({"url": f"http://127.0.0.1:{runner.addresses[0][1]}"}), flush=True)
    await asyncio.Event().wait()


asyncio.run(main())
