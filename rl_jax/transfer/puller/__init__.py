"""The generator's side of weight transfer: pull the newest version in one's own layout, verify
it (digests, finiteness, versions) and hand it over.

``core`` (:class:`~rl_jax.transfer.puller.core.Puller`: any target shardings, over any
transport), ``generator`` (:class:`~rl_jax.transfer.puller.generator.GeneratorPuller`: an
engine's layout, the publisher it may pull from). May import the transfer package's shared
modules and its transports; never the publisher.
"""
