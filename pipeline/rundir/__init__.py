"""jaxaot.rundir."""
