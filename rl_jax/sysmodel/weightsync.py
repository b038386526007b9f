"""How long a weight update takes from the trainer to every generator server.

The placement of the layout picks the link: a layout of ``num_train + num_servers · tp`` chips
that one host holds (``Accelerator.chips_per_host``; every layout when that is ``None``) sends over
the within-host link (NVLink, ICI), a larger one places the trainer and the generator pools on
different hosts and sends over the across-host network per chip (``network_bandwidth``).

Seconds, with ``W`` the weight bytes, ``n`` trainer chips, ``S`` servers of ``tp`` chips, ``B`` the
chosen link per chip (one direction) and ``e`` the share of it a bulk transfer reaches::

    T = fixed_s + wire + host

    wire = max(R / (e·B), C · W / (n · e·B))        slowest receiving chip, or the trainer's sends
      R = W / tp, C = S                             point to point, each chip pulls its shard
      R = W,      C = 1                             broadcast: every chip receives all weights
                                                    through a pipelined relay from the trainer

    host = (W / n + R) · (1 / (h·H) + 1 / s)        path "host" only: each trainer chip copies
                                                    its W / n to host memory and serialises it;
                                                    each receiving chip deserialises and copies
                                                    its R back, at PCIe rate H (share h) and
                                                    serialisation rate s per chip

On the host path within one host the copies go through host memory, not the chip-to-chip link,
so ``wire`` is 0 there. ``fixed_s`` is the per-update cost that does not scale with bytes
(pausing the servers, the control messages, the barrier). The defaults of :class:`WeightSync`
and where they come from are documented on its fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rl_jax.sysmodel.accelerators import Accelerator
from rl_jax.sysmodel.errors import SysModelError

PATHS = ("direct", "host")


@dataclasses.dataclass(frozen=True)
class WeightSync:
    """How a weight update travels and what it costs beyond the bytes on the wire.

    Attributes:
      path: ``"direct"`` (device to device: NCCL, RDMA, jax transfers over ICI/DCN) or
        ``"host"`` (staged through host memory: device→host copy, serialisation and checksums,
        the wire, deserialisation, host→device; this project's shared-memory and socket
        transports).
      broadcast: every generator chip receives all weights through a relay (NCCL broadcast from
        one trainer rank, as most engines do) instead of its own shard point to point.
      link_efficiency: share of the link's line rate a bulk transfer reaches. 0.8: NCCL's
        maintainers expect 46-48 GB/s per 400 Gb/s NDR NIC (0.92-0.96,
        https://github.com/NVIDIA/nccl-tests/issues/290), RDMA pulls of 82.5 GB per H200 reached
        44.26 GB/s (0.89) in prime-rl (https://github.com/PrimeIntellect-ai/prime-rl/pull/3341),
        and bucketed updates with a barrier per bucket reach less.
      host_link_efficiency: share of the PCIe rate a pinned device↔host copy reaches (0.8; PCIe
        Gen5 x16 moves 50-55 GB/s of its 64 GB/s each way in practice).
      serialise_bytes_per_s: host-side staging rate per chip (copy + checksum on the sending
        side, verification on the receiving one), bytes/s. 10 GB/s: this project's shared-memory
        publisher stages 1 GB (copy + XXH3 digests) in 0.09-0.10 s with two threads on a 2-vCPU
        host (``benchmarks/results/transfer_throughput.json``).
      fixed_s: per-update seconds that do not scale with bytes. 0.05 s: whole updates of models
        whose bytes take milliseconds take 0.02-0.18 s in published runs (verl's checkpoint
        engine, Qwen2.5-Math-7B within one H20 host: 0.02 s,
        https://github.com/volcengine/verl/blob/main/recipe/fully_async_policy/README.md;
        NeMo-RL, a 4B model: 0.07-0.08 s, https://github.com/NVIDIA-NeMo/RL/pull/2808; TRL,
        Qwen3-0.6B: ~0.18 s, https://github.com/huggingface/trl/pull/5892).
      host_link_bandwidth: overrides the accelerator's chip↔host bandwidth (one direction,
        bytes/s), e.g. where the datasheet does not give it.
    """

    path: str = "direct"
    broadcast: bool = False
    link_efficiency: float = 0.8
    host_link_efficiency: float = 0.8
    serialise_bytes_per_s: float = 10e9
    fixed_s: float = 0.05
    host_link_bandwidth: float | None = None

    def __post_init__(self):
        if self.path not in PATHS:
            raise SysModelError(f"weight sync path must be one of {PATHS}, got {self.path!r}")
        for name in ("link_efficiency", "host_link_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise SysModelError(f"weight sync {name} must be in (0, 1], got {value}")
        if self.serialise_bytes_per_s <= 0:
            raise SysModelError(f"weight sync serialise_bytes_per_s must be > 0, got "
                                f"{self.serialise_bytes_per_s}")
        if self.fixed_s < 0:
            raise SysModelError(f"weight sync fixed_s must be >= 0, got {self.fixed_s}")
        if self.host_link_bandwidth is not None and self.host_link_bandwidth <= 0:
            raise SysModelError(f"weight sync host_link_bandwidth must be > 0, got "
                                f"{self.host_link_bandwidth}")

    @classmethod
    def wire_only(cls, **changes: Any) -> "WeightSync":
        """The bare link: full line rate, no fixed cost, device to device."""
        return cls(**{"link_efficiency": 1.0, "fixed_s": 0.0, **changes})


def shares_host(accelerator: Accelerator, num_chips: int) -> bool:
    """Whether a layout of ``num_chips`` chips fits on one host, so that the trainer and the
    generators share the within-host link."""
    return accelerator.chips_per_host is None or num_chips <= accelerator.chips_per_host


def transfer_breakdown(weight_bytes: float, *, num_train: int, num_servers: int,
                       tensor_parallel: int, accelerator: Accelerator | None = None,
                       link_bandwidth: float | None = None,
                       sync: WeightSync | None = None) -> dict[str, Any]:
    """The terms of the module docstring's formula for one weight update.

    ``accelerator`` picks the link by placement (and gives the host link); ``link_bandwidth``
    (bytes/s per chip, one direction) replaces that choice, e.g. with a measured rate. At least
    one of the two is needed. Returns ``total_s``, ``wire_s``, ``host_s``, ``fixed_s``,
    ``same_host``, ``link`` (its name) and ``link_bandwidth``.
    """
    sync = sync or WeightSync()
    if min(num_train, num_servers, tensor_parallel) < 1:
        raise SysModelError(f"weight transfer needs >= 1 trainer chip, server and TP chip, got "
                            f"num_train={num_train}, num_servers={num_servers}, "
                            f"tensor_parallel={tensor_parallel}")
    if weight_bytes < 0:
        raise SysModelError(f"weight_bytes must be >= 0, got {weight_bytes}")
    if accelerator is None and link_bandwidth is None:
        raise SysModelError("weight transfer needs an accelerator (to pick the link by "
                            "placement) or a link_bandwidth")
    chips = num_train + num_servers * tensor_parallel
    same = accelerator is None or shares_host(accelerator, chips)
    if link_bandwidth is not None:
        link, name = float(link_bandwidth), "given"
    elif same:
        link, name = accelerator.link_bandwidth, accelerator.interconnect
    else:
        if accelerator.network_bandwidth is None:
            raise SysModelError(f"{accelerator.name} lists no network_bandwidth, so a layout of "
                                f"{chips} chips (more than {accelerator.chips_per_host} per host)"
                                " cannot be priced; add it to the description")
        link, name = accelerator.network_bandwidth, accelerator.network or "network"
    if link <= 0:
        raise SysModelError(f"link bandwidth must be > 0, got {link}")
    received = weight_bytes if sync.broadcast else weight_bytes / tensor_parallel
    copies = 1 if sync.broadcast else num_servers
    rate = sync.link_efficiency * link
    wire = max(received / rate, copies * weight_bytes / (num_train * rate))
    host = 0.0
    if sync.path == "host":
        host_link = sync.host_link_bandwidth or (accelerator.host_link_bandwidth
                                                 if accelerator is not None else None)
        if host_link is None:
            who = accelerator.name if accelerator is not None else "the given link"
            raise SysModelError(f"the host path needs a chip-to-host bandwidth: {who} lists no "
                                "host_link_bandwidth; give WeightSync(host_link_bandwidth=...)")
        per_byte = 1 / (sync.host_link_efficiency * host_link) + 1 / sync.serialise_bytes_per_s
        host = (weight_bytes / num_train + received) * per_byte
        if same and link_bandwidth is None:
            wire, name = 0.0, "host memory"
    return {"total_s": sync.fixed_s + wire + host, "wire_s": wire, "host_s": host,
            "fixed_s": sync.fixed_s, "same_host": same, "link": name, "link_bandwidth": link}


def weight_transfer_seconds(weight_bytes: float, *, num_train: int, num_servers: int,
                            tensor_parallel: int, accelerator: Accelerator | None = None,
                            link_bandwidth: float | None = None,
                            sync: WeightSync | None = None) -> float:
    """Seconds until every server holds new weights (see the module docstring for the formula):
    ``fixed_s + wire + host``, where the wire is the slower of a server chip receiving its bytes
    and the trainer's chips sending every copy, over the within-host link when the layout fits on
    one host and the across-host network otherwise."""
    return transfer_breakdown(weight_bytes, num_train=num_train, num_servers=num_servers,
                              tensor_parallel=tensor_parallel, accelerator=accelerator,
                              link_bandwidth=link_bandwidth, sync=sync)["total_s"]
