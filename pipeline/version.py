"""jaxaot's version (one place; pyproject.toml's [project] version says the same)."""

__version__ = "0.1.0"
