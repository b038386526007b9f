"""Versioned, verified weight transfer from the trainer's shards to generator servers.

Trainer side: :class:`Publisher` (``publish(params, version)``). Generator side: :class:`Puller`
(any target shardings) and :class:`GeneratorPuller` (an engine's layout; what the generator
server calls). Transports, each a class behind one interface, by name in
:mod:`rl_jax.transfer.transports`: ``shm`` and ``socket`` (safetensors-format chunks from the
publisher's staging buffers), ``jax_transfer`` (``jax.experimental.transfer``, device to
device) and ``disk`` (HF checkpoint directories, also what SGLang's ``/update_weights_from_disk``
loads). SGLang's distributed protocol lives in :mod:`rl_jax.transfer.sglang` and
:mod:`rl_jax.transfer.sglang_receiver` (need torch); :mod:`rl_jax.transfer.sglang_sidecar` pulls
versions over these transports beside a real SGLang server and hands them to it.

Modules: ``publisher`` (publish and announce), ``publisher_routes`` (its control channel),
``preparing`` (a version staged for each layout and its manifest), ``staging`` (host staging
slots), ``shard_geometry`` (how each slot shard is filled from the trainer's shards),
``shard_copy`` (the copy-and-hash kernels filling them), ``device_staging`` and
``disk_staging`` (the other copies); ``puller`` and ``generator_puller`` (pulling), ``pulling``
(checks shared by the transports); ``manifest``, ``layout``, ``chunks``, ``checksum``,
``finite``, ``control``, ``config``, ``errors`` below them.
"""

from rl_jax.transfer.config import PublisherConfig, PullerConfig
from rl_jax.transfer.errors import (AuthenticationError, IntegrityError, LayoutError,
                                    NonFiniteWeights, PublisherNotAllowed, PublisherUnavailable,
                                    StagingSpaceError, TransferError, TransferTimeout,
                                    TransportUnavailable, UnknownTransport, VersionGone)
from rl_jax.transfer.generator_puller import GeneratorPuller, pinned_publisher
from rl_jax.transfer.layout import Layout
from rl_jax.transfer.manifest import Manifest, verify
from rl_jax.transfer.publisher import PublishStats, Publisher
from rl_jax.transfer.puller import PullMetrics, Puller, WeightUpdate
from rl_jax.transfer.transports import TRANSPORTS

__all__ = [
    "TRANSPORTS", "PublisherConfig", "PullerConfig", "TransferError", "IntegrityError",
    "NonFiniteWeights", "LayoutError", "PublisherUnavailable", "TransferTimeout",
    "TransportUnavailable", "UnknownTransport", "VersionGone", "AuthenticationError",
    "PublisherNotAllowed", "StagingSpaceError", "Layout", "Manifest", "verify", "Publisher",
    "PublishStats", "Puller", "GeneratorPuller", "PullMetrics", "WeightUpdate",
    "pinned_publisher",
]
