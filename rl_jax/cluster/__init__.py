"""Launching a run's roles on a cluster engine (Ray): where each process goes, its command line,
its supervision (restarts, logs) and its shutdown.

:mod:`rl_jax.cluster.spec` says what to launch (no Ray needed: pure data and command lines);
:mod:`rl_jax.cluster.supervisor` runs one process on a node; :mod:`rl_jax.cluster.ray_cluster`
places the supervisors on a Ray cluster and drives them (``launch/ray_launch.py``).
"""
