"""The inference engine: continuous batching over a paged KV cache with in-flight weight updates.

``core`` (:class:`~rl_jax.generator.engine.core.Engine`: submit, update weights, pause, abort),
``config`` (its settings), ``scheduling`` and ``bookkeeping`` (admissions, where requests and
sequences are), ``continuous_batching`` (the data path), ``runner`` (the compiled device work),
``decode`` (the decode-path model), ``kv_cache``, ``sampling``, ``weights`` (loading, checking
and laying out weights), ``kernels/`` (decode attention), ``local`` (the ``Generator``
interface over an engine in this process). May import the generator package's shared modules;
never the server, the client or the launcher.
"""
