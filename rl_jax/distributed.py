"""Multi-process JAX: joining one global mesh across hosts (or processes on one host)."""

from __future__ import annotations

import logging

import jax

log = logging.getLogger(__name__)

_joined: tuple | None = None  # the arguments of the join this process made


def initialize(coordinator_address: str | None, num_processes: int = 1, process_id: int = 0,
               *, local_device_ids: list[int] | None = None, timeout_s: int = 300) -> bool:
    """Joins ``jax.distributed`` when a coordinator is given and more than one process runs.

    Must run before any other JAX call. On the CPU backend, cross-process collectives use gloo.
    Returns whether distributed mode was initialised. A second call with the same arguments
    does nothing (and returns True); with others it is an error.
    """
    global _joined
    if not coordinator_address or num_processes <= 1:
        return False
    arguments = (coordinator_address, num_processes, process_id)
    if _joined is not None:
        if _joined != arguments:
            raise ValueError(f"this process already joined {_joined}, not {arguments}")
        return True
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} is outside [0, {num_processes})")
    if "cpu" in (jax.config.jax_platforms or "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes=num_processes,
                               process_id=process_id, local_device_ids=local_device_ids,
                               initialization_timeout=timeout_s)
    _joined = arguments
    log.info("process %d/%d joined %s: %d local, %d global devices", process_id, num_processes,
             coordinator_address, jax.local_device_count(), jax.device_count())
    return True
