"""Weights into real SGLang servers.

``broadcast`` (SGLang's distributed weight-update protocol as SGLang forms it: the group, the
sender), ``receiver`` (its receiving side, for this project's server), ``sidecar`` (a puller
beside an SGLang server that hands it each verified version through SGLang's local endpoints).
The top layer of the transfer package: may import the puller and everything below it.
"""
