"""The generator pool of a run: servers started here (this project's or SGLang's) or servers
already running at given URLs, with a watchdog that restarts servers that die.

A restarted server of this project pulls the newest published weights before it reports ready
(``--publisher_url``), and the client re-applies the last weight update to any server it sees
come back, so a restart never serves old weights for long; requests in flight on the dead server
are retried on the others (or once it is back) by the client and the rollout.

API keys (:func:`generator_keys`): from the files ``generator.auth.api_key_file`` /
``admin_api_key_file``, else the environment (``RL_JAX_API_KEY``, ``RL_JAX_ADMIN_API_KEY``);
servers started here without either get fresh random keys for the run
(``generator.auth.generate_keys``), so that no run's servers answer unauthenticated requests.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import threading
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rl_jax import compile_cache
from rl_jax.generator.auth import ADMIN_API_KEY_ENV, API_KEY_ENV, AuthConfigError, Keys, load_keys
from rl_jax.generator.client.control import GeneratorRequestError
from rl_jax.generator.client.core import GeneratorClient
from rl_jax.generator.launcher.pool import LaunchError, PoolConfig, ServerPool
from rl_jax.orchestrator.sidecars import SidecarPool
from rl_jax.recipe.schema import Generator, RLConfigError

log = logging.getLogger(__name__)


class BackgroundLoop:
    """An asyncio event loop in a daemon thread, for calling coroutines from synchronous code."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float | None = None) -> Any:
        """Runs ``coro`` on the loop and waits for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro):
        """Schedules ``coro``; returns a ``concurrent.futures.Future``."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self):
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        if not self.loop.is_running():
            self.loop.close()


def generator_keys(block: Generator, *, environ: Mapping[str, str] | None = None) -> Keys:
    """The API keys of a run's generator servers (see the module docstring); raises
    :class:`RLConfigError` naming the setting whose key cannot be used."""
    auth = block.auth
    files = {"api_key_file": auth.api_key_file or None,
             "admin_api_key_file": auth.admin_api_key_file or None}
    try:
        keys = load_keys(api_key_file=files["api_key_file"],
                         admin_api_key_file=files["admin_api_key_file"], environ=environ)
    except AuthConfigError as e:
        raise RLConfigError(f"generator.auth: {e}") from None
    if keys or block.urls or not auth.generate_keys:
        return keys
    # hex: SGLang reads its keys from a --config file as command-line values, where a key that
    # starts with "-" (1 in 32 url-safe keys) is taken for an option and the server exits
    return Keys(secrets.token_hex(32), secrets.token_hex(32))


async def check_keys(client: GeneratorClient) -> None:
    """Raises :class:`RLConfigError` unless every server up takes the client's keys: the API
    key at ``/model_info``, the admin key at ``/abort_request`` of an unknown request
    (which changes nothing), so that wrong keys stop a run at start with one clear line."""
    for method, path, body, which in (
            ("GET", "/model_info", None, "API key"),
            ("POST", "/abort_request", {"rid": f"auth-check-{uuid.uuid4().hex}"}, "admin key")):
        try:
            await client.broadcast(method, path, body)
        except GeneratorRequestError as e:
            if e.status not in (401, 403):
                raise
            raise RLConfigError(
                f"generator server {e.url} refused this run's {which} (HTTP {e.status}) at "
                f"{path}: give the servers' keys in generator.auth.api_key_file / "
                f"admin_api_key_file or in {API_KEY_ENV} / {ADMIN_API_KEY_ENV}") from None


class GeneratorPool:
    """Servers for one run.

    Args:
      block: the recipe's ``generator`` config block.
      model_dir: the HF checkpoint the servers start from.
      publisher_url: the weight publisher servers pull from.
      cpu_cores: cores the servers run on ("" = any).
      nice: the servers' CPU priority (``PoolConfig.nice``).
      log_dir: where server logs go.
      keys: the servers' API keys (default: :func:`generator_keys` of ``block``).
      compilation_cache_dir: JAX's persistent compilation cache of the servers
        (:mod:`rl_jax.compile_cache`; "" = none).
      sidecar_transport: the pull transport of the SGLang servers' weight sidecars
        (``block.sglang_weights = "sidecar"``: :mod:`rl_jax.orchestrator.sidecars`).
    """

    def __init__(self, block: Generator, *, model_dir: str | Path, publisher_url: str,
                 cpu_cores: str = "", nice: int = 0, log_dir: str | Path,
                 keys: Keys | None = None, compilation_cache_dir: str = "",
                 sidecar_transport: str = "auto"):
        self.block = block
        self.keys = generator_keys(block) if keys is None else keys
        self.external = tuple(block.urls)
        self.restarts: collections.Counter = collections.Counter()
        self.released: set[str] = set()  # servers that left the fleet: not restarted
        self._servers: ServerPool | None = None
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self.sidecars: SidecarPool | None = None
        if not self.external and int(block.num_servers):  # (0: a router's workers only)
            self._servers = ServerPool(PoolConfig(
                model=str(model_dir), kind=block.kind, ports=(0,) * int(block.num_servers),
                max_slots=int(block.max_slots), max_seq_len=int(block.max_seq_len),
                dtype=block.dtype, tensor_parallel=int(block.tensor_parallel),
                data_parallel=int(block.data_parallel), decode_steps=int(block.decode_steps),
                startup_timeout=float(block.startup_timeout_s), log_dir=str(log_dir),
                cpu_cores=cpu_cores, nice=nice,
                env=tuple(tuple(kv) for kv in block.env) + tuple(
                    compile_cache.environment(compilation_cache_dir).items()),
                extra_args=tuple(block.extra_args) + (
                    ("--warmup_shapes",) if block.kind == "rl_jax" and block.warmup_shapes
                    else ()),
                publisher_url=publisher_url if block.kind == "rl_jax" else "",
                keys=self.keys, python=block.python))
            if block.kind == "sglang" and block.sglang_weights == "sidecar":
                self.sidecars = SidecarPool(
                    self._servers.urls, publisher_url=publisher_url, model_dir=model_dir,
                    keys=self.keys, handoff=block.sidecar_handoff, log_dir=log_dir,
                    transport=sidecar_transport)

    @property
    def urls(self) -> list[str]:
        """The servers given by URL, else those started here (none: a router's workers)."""
        if self.external or self._servers is None:
            return [url.rstrip("/") for url in self.external]
        return self._servers.urls

    @property
    def weight_urls(self) -> list[str]:
        """Where weight updates go: the servers' sidecars where they have them, else
        :attr:`urls`."""
        return self.sidecars.urls if self.sidecars is not None else self.urls

    @property
    def priority(self) -> str:
        """How the servers' CPU priority applies (:func:`rl_jax.cpus.lower_priority`)."""
        return "external" if self._servers is None else self._servers.priority

    @property
    def log_dir(self) -> Path | None:
        return None if self._servers is None else self._servers.log_dir

    def start(self, wait: bool = True) -> "GeneratorPool":
        """Starts the servers; with ``wait``, also :meth:`wait_started`."""
        if self._servers is not None:
            self._servers.start(wait=False)
        if wait:
            self.wait_started()
        return self

    def wait_started(self) -> "GeneratorPool":
        """Waits until every server answers /health (raises ``LaunchError`` naming the one
        that exited or timed out, with its log's tail), then starts the watchdog."""
        if self._servers is not None and self._watchdog is None:
            # a server that dies while it starts is started again, as the watchdog would later
            self._servers.wait_healthy(restarts=2 * len(self._servers.ports)
                                       if self.block.restart_dead else 0)
            if self.sidecars is not None:  # the servers' ports are known now
                self.sidecars.server_urls = self._servers.urls
                try:
                    self.sidecars.start()
                except LaunchError:
                    self.stop()
                    raise
            if self.block.restart_dead:
                self._watchdog = threading.Thread(target=self._watch, name="generator-watchdog",
                                                  daemon=True)
                self._watchdog.start()
        return self

    def _watch(self, interval: float = 1.0):
        servers = self._servers
        while not self._stop.wait(interval):
            if self.sidecars is not None:
                self.sidecars.restart_dead()
            for i, process in enumerate(servers.processes):
                if process is None or process.poll() is None or self._stop.is_set() \
                        or servers.urls[i] in self.released:
                    continue
                log.warning("generator server %s exited with code %s; restarting it:\n%s",
                            servers.urls[i], process.returncode, servers.log_tail(i, 5))
                self.restarts[servers.urls[i]] += 1
                try:
                    servers.start_server(i, wait=False)
                except (OSError, LaunchError) as e:
                    log.error("cannot restart generator server %s: %s", servers.urls[i], e)

    def release(self, url: str):
        """The server ``url`` left the run's fleet (:mod:`rl_jax.orchestrator.fleet`): the
        watchdog no longer restarts it; one started here keeps running until :meth:`stop`."""
        self.released.add(url)

    def kill(self, index: int):
        """Kills server ``index`` (the watchdog restarts it)."""
        if self._servers is None:
            raise LaunchError("servers given by URL are not managed here")
        self._servers.kill(index)

    def stop(self):
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout=5)
        if self.sidecars is not None:
            self.sidecars.stop()
        if self._servers is not None:
            self._servers.stop()
