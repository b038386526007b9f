"""Errors of the weight-transfer service.

Every failure of a pull leaves the generator on the weights it had: callers catch
:class:`TransferError` (or a subclass), log it, and keep serving.
"""

from __future__ import annotations


class TransferError(RuntimeError):
    """A pull or publish failed; the generator keeps its current version."""


class IntegrityError(TransferError):
    """Pulled weights do not match their manifest: a checksum, a missing or extra tensor or
    shard, or a shape/dtype mismatch. The version is refused."""


class NonFiniteWeights(IntegrityError):
    """Pulled weights hold a non-finite value (NaN or infinity): the version is refused."""


class TransferTimeout(TransferError):
    """A pull did not finish within its deadline (the pulling thread was abandoned)."""


class VersionGone(TransferError):
    """The version being pulled was superseded on the publisher before the pull finished."""


class PublisherUnavailable(TransferError):
    """The publisher's control channel cannot be reached (or answered with a server error)."""


class TransportUnavailable(TransferError):
    """The requested transport is not offered by the publisher or cannot run here (for
    example shared memory across hosts, or torch missing for SGLang's distributed protocol)."""


class UnknownTransport(TransportUnavailable):
    """A transport name that no module registers (:mod:`rl_jax.transfer.transports`)."""


class LayoutError(TransferError):
    """A generator's layout cannot be produced (unknown tensors, mesh that does not fit)."""


class AuthenticationError(TransferError):
    """The publisher refused this puller's token (HTTP 401)."""


class PublisherNotAllowed(TransferError):
    """A pull names a publisher other than the one this generator was started with (its
    transfer token is bound to that one)."""


class StagingSpaceError(TransferError):
    """The staging directory (shared memory or disk) has no room for a version: it is refused
    with this error instead of the process dying of SIGBUS on a write into a sparse mapping."""
