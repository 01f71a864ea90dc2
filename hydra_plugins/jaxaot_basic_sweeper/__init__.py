"""jaxaot's default sweeper (``hydra/sweeper=jaxaot_basic``): Hydra's basic sweeper that
composes each distinct defaults list once (see :mod:`jaxaot.sweeps.compose_cache`)."""
