"""Versioned, verified weight transfer from the trainer's shards to generator servers.

Trainer side: :class:`Publisher` (``publish(params, version)``). Generator side: :class:`Puller`
(any target shardings) and :class:`GeneratorPuller` (an engine's layout; what the generator
server calls). Transports: ``shm`` and ``socket`` (safetensors-format chunks from the
publisher's staging buffers), ``jax_transfer`` (``jax.experimental.transfer``, device to
device) and ``disk`` (HF checkpoint directories, also what SGLang's ``/update_weights_from_disk``
loads). SGLang's distributed protocol lives in :mod:`rl_jax.transfer.sglang` (needs torch).
"""

from rl_jax.transfer.config import TRANSPORTS, PublisherConfig, PullerConfig
from rl_jax.transfer.errors import (AuthenticationError, IntegrityError, LayoutError,
                                    NonFiniteWeights, PublisherNotAllowed, PublisherUnavailable,
                                    StagingSpaceError, TransferError, TransferTimeout,
                                    TransportUnavailable, VersionGone)
from rl_jax.transfer.layout import Layout
from rl_jax.transfer.manifest import Manifest, verify
from rl_jax.transfer.publisher import PublishStats, Publisher
from rl_jax.transfer.puller import (GeneratorPuller, PullMetrics, Puller, WeightUpdate,
                                    pinned_publisher)

__all__ = [
    "TRANSPORTS", "PublisherConfig", "PullerConfig", "TransferError", "IntegrityError",
    "NonFiniteWeights", "LayoutError", "PublisherUnavailable", "TransferTimeout", "TransportUnavailable",
    "VersionGone", "AuthenticationError", "PublisherNotAllowed", "StagingSpaceError",
    "Layout", "Manifest", "verify", "Publisher", "PublishStats", "Puller", "GeneratorPuller",
    "PullMetrics", "WeightUpdate", "pinned_publisher",
]
