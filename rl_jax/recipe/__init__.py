"""The RL recipe's typed schema: one set of defaults and one validation pass.

A recipe is a tree of frozen dataclasses, one per section (``rollout``, ``trainer``, ...). Every
field's default lives here and nowhere else. Recipe files (``configs/*.py``) start from
:func:`base_config` (an ``ml_collections.ConfigDict`` built from these defaults, so absl's
``--config.rollout.max_lag=4`` overrides keep their type checks and unknown keys stay an error
naming the key) and change only what differs. Readers of a recipe (the orchestrator, the
systems model's planner, the launchers) call :func:`parse`, which turns the ConfigDict into an
:class:`RLRecipe` and checks it once:

* unknown fields and values of the wrong type, named by their dotted path;
* each field's own range (``rollout.max_lag must be an integer >= 0, got -1``);
* relations between fields (``trainer.micro_batch_rows`` and ``trainer.num_microbatches``);
* names looked up in registries (losses, advantage estimators, environments, dtypes), unless
  ``registries=False`` (the planner, which must not import JAX).

Checks that need files, prompts or a mesh (``rollout.seq_len`` against the longest prompt) run
when those exist, in :mod:`rl_jax.orchestrator.config`.

This module imports nothing heavy: registry checks import their packages when they run.
"""


