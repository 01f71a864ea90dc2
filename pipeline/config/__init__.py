"""jaxaot.config."""
