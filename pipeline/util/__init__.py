"""jaxaot.util."""
