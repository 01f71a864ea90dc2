"""jaxaot.snapshots."""
