"""The RL run: wires trainer, generator pool, weight transfer and rollout for
``mode = async | one_step_off | sync`` (see :mod:`rl_jax.orchestrator.rl`)."""


