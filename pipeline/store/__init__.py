"""jaxaot.store."""
