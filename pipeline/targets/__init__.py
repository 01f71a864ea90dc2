"""jaxaot.targets."""
