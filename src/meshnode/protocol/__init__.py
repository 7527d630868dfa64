"""The pure protocol core: no I/O, no asyncio; every clock is a parameter.

Submodules: ``canonical`` (§5.3), ``nkeys`` and ``signing`` (§4), ``envelope`` (§5),
``errors`` (§12), ``timeutil``, and the decision rules built on them.
"""
