"""Multi-process JAX: joining one global mesh across hosts (or processes on one host)."""

from __future__ import annotations

import logging

import jax

log = logging.getLogger(__name__)

_joined: tuple | None = None  # the arguments of the join this process made


AUTO = "auto"  # the coordinator JAX's cluster detection finds (Slurm, Open MPI, Kubernetes, TPU)


def initialize(coordinator_address: str | None, num_processes: int = 1, process_id: int = 0,
               *, local_device_ids: list[int] | None = None, timeout_s: int = 300) -> bool:
    """Joins ``jax.distributed`` when a coordinator is given and more than one process runs.

    ``coordinator_address="auto"`` leaves the coordinator, the process count and this
    process's index to JAX's own cluster detection (``jax.distributed.initialize()`` without
    arguments: Slurm, Open MPI, Kubernetes JobSets, Cloud TPU pods); ``num_processes`` /
    ``process_id`` then only override what it detects when ``num_processes > 1``. Outside any
    cluster it detects, "auto" is an error that says so.

    Must run before any other JAX call. On the CPU backend, cross-process collectives use gloo.
    Returns whether distributed mode was initialised. A second call with the same arguments
    does nothing (and returns True); with others it is an error.
    """
    global _joined
    auto = coordinator_address == AUTO
    if not coordinator_address or (num_processes <= 1 and not auto):
        return False
    arguments = (coordinator_address, num_processes, process_id)
    if _joined is not None:
        if _joined != arguments:
            raise ValueError(f"this process already joined {_joined}, not {arguments}")
        return True
    if not 0 <= process_id < max(num_processes, 1):
        raise ValueError(f"process_id={process_id} is outside [0, {num_processes})")
    if auto:
        found = detected_cluster()
        if found is None:
            raise ValueError(
                "coordinator='auto': JAX detects no cluster here (Slurm, Open MPI, Kubernetes, "
                "Cloud TPU); give the coordinator's host:port with num_processes and process_id")
    if "cpu" in (jax.config.jax_platforms or "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    explicit = not auto or num_processes > 1
    jax.distributed.initialize(None if auto else coordinator_address,
                               num_processes=num_processes if explicit else None,
                               process_id=process_id if explicit else None,
                               local_device_ids=local_device_ids,
                               initialization_timeout=timeout_s)
    _joined = arguments
    log.info("process %d/%d joined %s: %d local, %d global devices", jax.process_index(),
             jax.process_count(), f"the {found} cluster's coordinator" if auto
             else coordinator_address, jax.local_device_count(), jax.device_count())
    return True


def remember(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """Records the join made with ``"auto"`` under what it detected, so that later calls with
    those values (a recipe updated after the join) are the same join."""
    global _joined
    if _joined is not None and _joined[0] == coordinator_address:
        _joined = (coordinator_address, num_processes, process_id)


def detected_cluster() -> str | None:
    """The name of the cluster environment JAX's detection finds here (e.g. "slurm"), or
    None."""
    from jax._src import clusters  # the detection jax.distributed.initialize() runs
    for cluster in clusters.ClusterEnv._cluster_types:
        try:
            if cluster.is_env_present():
                return getattr(cluster, "name", "") or cluster.__name__
        except Exception:  # noqa: BLE001 - a probe that fails means "not this one"
            continue
    return None
