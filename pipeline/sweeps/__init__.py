"""jaxaot.sweeps."""
