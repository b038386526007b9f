"""What every weight transport implements, and what it declares about itself.

A transport moves one version of the weights, prepared by the publisher in one generator layout,
into a puller's arrays in that layout. One :class:`Transport` subclass per transport says:

* ``name``: what configs, manifests (``Manifest.transports[name]``) and pull requests call it;
* ``staging``: which copy of the version the publisher makes for it, one of :data:`STAGINGS`
  and shared by every transport naming the same one: ``"host"`` (a staging slot of
  safetensors-format chunks, :mod:`rl_jax.transfer.publisher.staging`), ``"device"``
  (generator-layout
  arrays on the trainer's devices, :mod:`rl_jax.transfer.publisher.device_staging`) or ``"disk"``
  (an HF
  checkpoint directory written once per version for every layout);
* ``same_host``: usable only by pullers on the publisher's host (``transport="auto"`` skips it
  when the publisher is elsewhere);
* ``streams``: a layout pulled only over streaming transports is announced before its version is
  staged, and its pullers verify it block by block while it is written;
* ``checks_values``: its pulls hold the values on the host, so the puller refuses non-finite
  ones (``PullerConfig.check_finite``) and the engine may skip its own check;
* ``keeps_deadline``: :meth:`fetch` enforces the pull's deadline itself and never blocks past
  it; other fetches run in a thread that is abandoned at the deadline.

The publisher uses the class (it passes itself to the class methods: :meth:`check_publisher`,
:meth:`start`, :meth:`routes`, :meth:`entry`); every :class:`~rl_jax.transfer.puller.core.Puller`
makes one instance per transport it pulls over, holding what it keeps from pull to pull
(mappings, buffers), and calls :meth:`fetch`. A fetch reads the puller's public state
(``config``, ``client``, ``layout_key``, ``puller_id``, ``shardings``, ``directories``,
``hooks``) and helpers (``arrays_from_chunks``, ``place``, ``require_finite``, ``nonfinite``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

if TYPE_CHECKING:
    import jax

    from rl_jax.transfer.layout import Index
    from rl_jax.transfer.manifest import Manifest

# The publisher's copies of a version, in the order it makes them: a manifest's tensor infos
# come from the first one a layout needs (host staging's carry offsets and finiteness).
STAGINGS = ("host", "device", "disk")

Route = Callable[[Mapping[str, str], Any], Any]  # (query, JSON body) -> answer


class Fetched(NamedTuple):
    """What :meth:`Transport.fetch` returns: the arrays (flat names, target shardings), the bytes
    that crossed into this process, and the shard digests it took of the very bytes the arrays
    alias (``{name: {index: digest}}``; None: :func:`~rl_jax.transfer.manifest.verify` hashes
    the arrays)."""

    arrays: dict[str, jax.Array]
    nbytes: int
    digests: dict[str, dict[Index, str]] | None = None


class Transport(abc.ABC):
    """One weight transport (see the module docstring)."""

    name: ClassVar[str]
    staging: ClassVar[str]
    same_host: ClassVar[bool] = False
    streams: ClassVar[bool] = False
    checks_values: ClassVar[bool] = True
    keeps_deadline: ClassVar[bool] = False

    def __init__(self, puller: Any):
        self.puller = puller

    # ---- publisher side -------------------------------------------------------------------------

    @classmethod
    def check_publisher(cls, config: Any, spec: Any) -> None:
        """Raises ``ValueError`` when a publisher built with ``config`` (a
        ``PublisherConfig``) and ``spec`` cannot offer this transport."""

    @classmethod
    def start(cls, publisher: Any) -> Any:
        """Called once by a publisher that enables this transport; what it returns is kept as
        ``publisher.transport_state[name]``."""
        return None

    @classmethod
    def routes(cls, publisher: Any) -> dict[tuple[str, str], tuple[Route, int]]:
        """Control routes this transport serves on every publisher, enabled or not (a request
        for a layout it was not prepared for gets 409): ``(method, path) -> (handler, largest
        request body in bytes)``. Handlers run in the control server's threads and raise
        ``control.HTTPStatus`` to refuse."""
        return {}

    @classmethod
    @abc.abstractmethod
    def entry(cls, publisher: Any, staged: Mapping[str, Any]) -> dict[str, Any]:
        """This transport's entry in a manifest (``Manifest.transports[name]``): what a puller
        needs to fetch the version from the publisher's ``staged`` copy (the description of
        the copy named by ``staging``)."""

    # ---- puller side ----------------------------------------------------------------------------

    @classmethod
    def streamed(cls, manifest: Manifest) -> bool:
        """Whether ``manifest`` was announced before its version was staged (its checksums
        pending): :meth:`fetch` then returns the digests it verified block by block."""
        return False

    @abc.abstractmethod
    def fetch(self, manifest: Manifest, deadline: float) -> Fetched:
        """Fetches ``manifest``'s version into the puller's target layout before ``deadline``
        (``time.monotonic()``); raises a :class:`~rl_jax.transfer.errors.TransferError` on any
        failure."""
