"""jaxaot.cli."""
