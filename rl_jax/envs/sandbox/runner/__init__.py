"""The trusted runner of the code sandbox, as modules sent into it (stdlib only; see runner.py).

Load order (each imports only those before it, by bare name): :data:`MODULES`.
"""

MODULES = ("protocol", "seccomp_filter", "confinement", "processes", "outcome", "harness",
           "runner")
