"""The client of a pool of generator servers (this project's or real SGLang's), over HTTP.

``core`` (:class:`~rl_jax.generator.client.core.GeneratorClient`: requests spread over the
servers, retries, servers joining and leaving), ``control`` (operations broadcast to every
server: weight updates, pause, abort, versions), ``identity`` (which server is at the other end
and what it honours). May import the generator package's shared modules; never the engine or
the server.
"""
