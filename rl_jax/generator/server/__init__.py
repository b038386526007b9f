"""The HTTP server speaking SGLang's API in front of one engine.

``app`` (:class:`~rl_jax.generator.server.app.GeneratorServer`: the routes), ``httpio``
(aiohttp plumbing: bounded bodies, JSON answers, the protocol log), ``weight_endpoints`` and
``distributed_endpoints`` (weight updates from disk, the transfer service, SGLang's
distributed protocol), ``config`` and ``setup`` (settings, what a server loads before it
serves), ``warmup`` (compiling before serving), ``serve`` (the process's entry point). May
import the engine and the shared modules; never the client or the launcher.
"""
