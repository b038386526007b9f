"""Starting generator servers as processes: ``pool`` (a pool of servers, this project's or
SGLang's in its own environment, from one config block) and ``orphan_guard`` (ends a server with
the process that started it). The top layer of the generator package.
"""
