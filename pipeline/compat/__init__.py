"""The private JAX, jaxlib and Hydra internals jaxaot uses, each behind one function.

Every private touch of jaxaot is in this package: ``jaxaot.compat.jax`` for JAX and jaxlib
(``jax._src``, ``jaxlib._*``, ``jaxlib.xla_client``, ``jaxlib.mlir`` and private attributes of
JAX objects such as ``Lowered._lowering``), ``jaxaot.compat.hydra`` for Hydra
(``hydra._internal`` and the patches of Hydra's classes). No other module imports them
(tests/test_layers.py checks). Each function takes the public path where the installed version
has one, gates the private one by version, and refuses in one line naming the version a
feature needs where neither exists. Each module's ``PRIVATE_NAMES`` lists the private names it
reads, with the versions that have them (tests/test_compat.py resolves them on the installed
versions). Importing this package imports neither JAX nor Hydra.
"""
