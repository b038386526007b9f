"""Generation: an inference engine, an HTTP server speaking SGLang's API in front of it, a client
for pools of such servers (this project's or real SGLang's) and a launcher for them.

Subpackages, from the lowest layer up (``tools/import_graph.py`` checks that each imports only
its own and lower ones, never a sibling of its layer):

- this package's own modules, what the sides share: ``types`` (requests, sampling parameters,
  outputs), ``protocol`` (SGLang's ``/generate`` requests), ``responses`` (its answers),
  ``json_body`` (request bodies' bounds), ``auth`` (API keys), ``base`` (the ``Generator``
  interface rollouts use);
- :mod:`~rl_jax.generator.engine` (continuous batching over a paged KV cache, in-flight weight
  updates) and :mod:`~rl_jax.generator.client` (HTTP to a pool of servers); neither imports
  the other;
- :mod:`~rl_jax.generator.server`: the HTTP server around one engine;
- :mod:`~rl_jax.generator.launcher`: starts pools of servers as processes.

Each name has one home: import it from the module that defines it.
"""
