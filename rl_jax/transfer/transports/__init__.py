"""The weight transports by name: the one list of their names, and their classes.

Built in, fastest first on one host (see ``benchmarks/transfer_throughput.py``); the order is
the pullers' preference under ``PullerConfig.transport="auto"``:

================  =============================================================================
``shm``           the publisher's staging slot in shared memory, aliased by pullers on its host
                  (:class:`rl_jax.transfer.transports.shm.ShmTransport`)
``socket``        the same safetensors-format chunks streamed over HTTP (``sendfile``)
                  (:class:`rl_jax.transfer.transports.sockets.SocketTransport`)
``jax_transfer``  device to device through ``jax.experimental.transfer``
                  (:class:`rl_jax.transfer.transports.jax_transfer.JaxTransferTransport`)
``disk``          an HF safetensors directory (the fallback; also what SGLang servers load)
                  (:class:`rl_jax.transfer.transports.disk.DiskTransport`)
``delta``         the staging chunks as compressed XORs against the version the puller holds,
                  for slow links; never chosen by ``"auto"`` before the others
                  (:class:`rl_jax.transfer.transports.delta.DeltaTransport`)
================  =============================================================================

A transport is one module here with a :class:`~rl_jax.transfer.transports.base.Transport`
subclass, and one entry in ``_REGISTRY``. Modules are imported when their transport is first
asked for, so this module (read by the configs) imports nothing heavy. SGLang's distributed
protocol (:mod:`rl_jax.transfer.sglang.broadcast`) is not one of them: the trainer pushes whole HF
tensors
into the servers over ``torch.distributed``, with no manifest and no puller. Real SGLang servers
get these transports through a sidecar beside them (:mod:`rl_jax.transfer.sglang.sidecar`).
"""

from __future__ import annotations

import importlib

from rl_jax.transfer.errors import UnknownTransport
from rl_jax.transfer.transports.base import Transport

_REGISTRY: dict[str, str] = {
    "shm": "rl_jax.transfer.transports.shm:ShmTransport",
    "socket": "rl_jax.transfer.transports.sockets:SocketTransport",
    "jax_transfer": "rl_jax.transfer.transports.jax_transfer:JaxTransferTransport",
    "disk": "rl_jax.transfer.transports.disk:DiskTransport",
    "delta": "rl_jax.transfer.transports.delta:DeltaTransport",
}
TRANSPORTS: tuple[str, ...] = tuple(_REGISTRY)


def names() -> tuple[str, ...]:
    """Registered transport names, in the pullers' order of preference."""
    return TRANSPORTS


def get(name: str) -> type[Transport]:
    """The class of transport ``name``.

    Raises:
      UnknownTransport: naming the known transports, for a name nobody registered.
    """
    path = _REGISTRY.get(name) if isinstance(name, str) else None
    if path is None:
        raise UnknownTransport(f"unknown transport {str(name)[:80]!r}; known transports: "
                               f"{', '.join(TRANSPORTS)}")
    module, attr = path.split(":")
    cls = getattr(importlib.import_module(module), attr)
    if cls.name != name:
        raise AssertionError(f"{path} names itself {cls.name!r}, registered as {name!r}")
    return cls


def staged_on(staging: str) -> tuple[str, ...]:
    """The transports that read the publisher's ``staging`` copy (one of ``STAGINGS``)."""
    return tuple(name for name in TRANSPORTS if get(name).staging == staging)


