"""jaxaot's Optuna sweeper for Hydra (``hydra/sweeper=jaxaot_optuna``).

Hydra discovers sweepers only in the ``hydra_plugins`` namespace package; the search itself
lives in :mod:`jaxaot.sweeps.autotune`.
"""
