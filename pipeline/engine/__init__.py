"""jaxaot.engine."""
