"""Adapters for the libraries JAX users have: Flax (NNX, linen), Equinox, optax, orbax."""
