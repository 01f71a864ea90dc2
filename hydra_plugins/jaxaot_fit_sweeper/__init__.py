"""jaxaot's fit sweeper for Hydra (``hydra/sweeper=jaxaot_fit``): the largest integer override
that still fits a TPU topology, by bisection; the search itself is :mod:`jaxaot.sweeps.fit_search`."""
