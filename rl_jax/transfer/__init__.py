"""Versioned, verified weight transfer from the trainer's shards to generator servers.

Subpackages, from the lowest layer up (``tools/import_graph.py`` checks that each imports only
its own and lower ones, never a sibling of its layer):

- this package's own modules, what both sides share: ``manifest`` (what a version is, in one
  layout), ``layout``, ``chunks`` (the safetensors chunks and the staging file's bookkeeping),
  ``checksum``, ``finite`` (copies that find non-finite values), ``control`` (the HTTP control
  channel, both ends), ``pulling`` (a puller's deadlines and range checks, also the
  transports'), ``jax_transport``, ``config``, ``errors``;
- :mod:`~rl_jax.transfer.transports`: the transports behind one interface (``shm``, ``socket``,
  ``jax_transfer``, ``disk``, ``delta``), each with its publisher and puller halves;
- :mod:`~rl_jax.transfer.publisher` (the trainer's side: ``Publisher.publish(params, version)``)
  and :mod:`~rl_jax.transfer.puller` (the generator's side: ``Puller`` for any target shardings,
  ``GeneratorPuller`` for an engine's layout); neither imports the other;
- :mod:`~rl_jax.transfer.sglang`: real SGLang servers, through SGLang's distributed protocol
  (both ends, over ``torch.distributed``) or a sidecar that pulls beside the server.

Each name has one home: import it from the module that defines it.
"""
