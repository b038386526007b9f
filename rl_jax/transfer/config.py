"""Configuration of the publisher (trainer side) and of pullers (generator side)."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import secrets
import shutil
import tempfile

from rl_jax.procs import process_alive

STAGING_PREFIX = "rl_jax-transfer-"  # the name of a publisher's staging directory

# The shared secret of a publisher and its pullers when their configs name none.
TOKEN_ENV = "RL_JAX_TRANSFER_TOKEN"
# The default deadline of one whole pull (seconds), for pullers built without a config (as the
# generator server builds them).
TIMEOUT_ENV = "RL_JAX_TRANSFER_TIMEOUT_S"
MAX_WAIT_S = 600.0  # the longest a manifest long-poll may wait
# The largest control answer a puller reads (PullerConfig.max_answer_bytes). The largest
# legitimate one is a manifest: about 0.1 MB for llama-3.1-70b in bfloat16 over 8 devices (12
# stacked tensors, 75 shards, 2,100 staging chunks of 64 MiB), growing by ~50 bytes per chunk
# and ~150 per shard; 16 MiB leaves two orders of magnitude.
MAX_ANSWER_BYTES = 16 << 20


def env_token() -> str | None:
    """The token in ``$RL_JAX_TRANSFER_TOKEN`` (None when unset or empty)."""
    return os.environ.get(TOKEN_ENV) or None


def publisher_token(configured: str | None) -> str:
    """The token a publisher requires: ``configured``, else ``$RL_JAX_TRANSFER_TOKEN``, else a
    fresh random one, which is then exported to this process's environment so that the
    generator servers it starts (which inherit it) can pull."""
    token = configured or env_token()
    if token is None:
        token = os.environ[TOKEN_ENV] = secrets.token_urlsafe(32)
    return token


def _env_timeout() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if not raw:
        return 120.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}")
    return value


def remove_dead_owners_dirs(root: str | os.PathLike, prefix: str) -> None:
    """Removes the directories ``<root>/<prefix><pid>-<hex>`` whose process ``pid`` is gone
    (left by a publisher or a sidecar that was killed)."""
    from pathlib import Path
    for path in Path(root).glob(f"{prefix}*"):
        m = re.fullmatch(rf"{re.escape(prefix)}(\d+)-[0-9a-f]+", path.name)
        if not m:
            continue
        if not process_alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)


def default_staging_dir() -> str:
    """Shared memory when the host has it (``/dev/shm``), else the temp directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) \
        else tempfile.gettempdir()


@dataclasses.dataclass(frozen=True)
class PublisherConfig:
    """Trainer side.

    Attributes:
      host, port: where the HTTP control channel (and the socket transport) listens; port 0
        picks a free port (``Publisher.url`` tells which).
      transports: what the publisher prepares for each version (a subset of ``TRANSPORTS``,
        the names in :mod:`rl_jax.transfer.transports`).
        Each layout is prepared only for the transports its pullers asked for.
      staging_dir: parent directory of the host staging buffers (shm/socket). Shared memory
        by default.
      disk_dir: where ``disk`` versions are written (``<disk_dir>/v<version>``, only the
        newest kept); required when ``disk`` is enabled.
      chunk_bytes: target size of one safetensors chunk (a tensor shard larger than this is a
        chunk of its own).
      num_transport_addresses: parallel streams of the jax transfer server; pullers must use
        the same number (the manifest carries it, and a mismatch is refused, not aborted).
      ticket_ttl_s: how long a jax-transfer pull ticket stays valid on the publisher (an
        unused ticket of a dead generator expires then and frees its hold on the arrays).
      layout_ttl_s: a registered layout whose generators have not asked for a manifest for
        this long is no longer prepared.
      staging_threads: threads that stage in parallel, each copying a few checksum blocks of a
        shard into place and hashing them right after, while they are in cache (0: the
        publishing thread does it all; the faster choice when no core is idle).
      max_host_slots: staging slots (each the size of one version in that layout) a layout
        may use: ``shm`` pullers hold the slot their live weights alias, so a slot is free for
        the next version only once its pullers moved on; past this many, publishing that
        layout fails with an error its pullers see.
      stream: announce a version to layouts pulled only over ``shm`` before staging it, and
        mark each checksum block in the slot's progress table once it is copied and hashed:
        pullers verify the version while it is written (reading it from cache), so a pull
        ends about when the publish does instead of starting after it.
      check_finite: every staging copy also finds whether the values it copies are finite
        (``rl_jax.transfer.finite.copy_finite``, at no measurable cost); the findings travel
        with the digests and pullers refuse a version holding a NaN or infinity without
        reading it again. False stages with plain copies and leaves the check to the pullers.
      auth_token: the secret every control request must carry (``Authorization: Bearer``);
        None: ``$RL_JAX_TRANSFER_TOKEN``, else a random one exported to this process's
        environment (see :func:`publisher_token`). Never logged.
      max_layouts: layouts registered at once (each costs a copy of the model per staging
        slot); a new one past this is refused (409) unless an idle one can be dropped.
      max_body_bytes: the largest control request body accepted (a layout description).
    """

    host: str = "127.0.0.1"
    port: int = 0
    transports: tuple[str, ...] = ("shm", "socket", "jax_transfer")
    staging_dir: str | None = None
    disk_dir: str | None = None
    chunk_bytes: int = 64 << 20
    num_transport_addresses: int = 1
    ticket_ttl_s: float = 120.0
    layout_ttl_s: float = 600.0
    staging_threads: int = 0
    max_host_slots: int = 8
    stream: bool = True
    check_finite: bool = True
    auth_token: str | None = dataclasses.field(default=None, repr=False)
    max_layouts: int = 8
    max_body_bytes: int = 4 << 20

    def __post_init__(self):
        if self.max_layouts < 1:
            raise ValueError(f"max_layouts must be >= 1, got {self.max_layouts}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")


@dataclasses.dataclass(frozen=True)
class PullerConfig:
    """Generator side.

    Attributes:
      transport: one of ``TRANSPORTS`` or ``"auto"`` (the first the publisher offers, in the
        order of ``TRANSPORTS``, skipping those usable only on the publisher's host, ``shm``,
        when the publisher is on another host).
      timeout_s: deadline of one whole pull (registration, manifest, data, verification; a
        long-poll's ``wait_s`` comes on top); past it the pull is abandoned with
        :class:`TransferTimeout` and the generator keeps its weights. Default:
        ``$RL_JAX_TRANSFER_TIMEOUT_S``, else 120.
      http_timeout_s: the longest one control request may take, whole (a manifest long-poll
        gets its wait on top), and the longest a chunk read may wait.
      max_answer_bytes: the largest control answer read (:data:`MAX_ANSWER_BYTES`); a bigger
        one is refused unread.
      socket_connections: parallel HTTP connections of the socket transport.
      num_transport_addresses: streams of this process's jax transfer server (must equal the
        publisher's).
      retries: how many times a pull restarts on the newest version when the one it was
        pulling is superseded meanwhile.
      digest_threads: threads verifying ``shm`` shards (0: the pulling thread; N: the pulling
        thread and N - 1 others hash blocks of the shards at once, on otherwise idle cores).
      host_buffers: model-sized host buffers the ``socket`` transport keeps for reuse (pulled
        weights alias them on CPU, so one is in use per live version; reusing the others
        avoids page faults). ``shm`` pulls need none: their weights alias the publisher's
        staging slot, which stays locked for as long as they live.
      auth_token: the publisher's token; None: ``$RL_JAX_TRANSFER_TOKEN`` at the time of each
        request. Never logged.
      check_finite: refuse a version pulled over a host transport that holds a non-finite
        value (:class:`~rl_jax.transfer.errors.NonFiniteWeights`), as the publisher found
        while staging it (or, for ``disk``, read here: ``rl_jax.transfer.finite``); the engine
        then skips its own check. False leaves the check to the engine.
    """

    transport: str = "auto"
    timeout_s: float = dataclasses.field(default_factory=_env_timeout)
    http_timeout_s: float = 30.0
    socket_connections: int = 4
    num_transport_addresses: int = 1
    retries: int = 2
    digest_threads: int = 0
    host_buffers: int = 3
    auth_token: str | None = dataclasses.field(default=None, repr=False)
    check_finite: bool = True
    max_answer_bytes: int = MAX_ANSWER_BYTES

    def __post_init__(self):
        if not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got "
                             f"{self.timeout_s!r}")
        if self.max_answer_bytes < 1024:
            raise ValueError(f"max_answer_bytes must be >= 1024, got {self.max_answer_bytes}")
