"""The trainer's side of weight transfer: :class:`~rl_jax.transfer.publisher.core.Publisher`
stages each version in every layout generators asked for and announces it.

``core`` (publish, announce, the staging directory), ``routes`` (its control channel's routes),
``preparing`` (one version made ready for one layout, and its manifest), ``staging`` (host
staging slots), ``shard_geometry`` (how each slot shard is filled from the trainer's shards),
``shard_copy`` (the copy-and-hash kernels that fill them), ``device_staging`` and
``disk_staging`` (the ``jax_transfer`` and ``disk`` copies). May import the transfer package's
shared modules and its transports; never the puller.
"""
