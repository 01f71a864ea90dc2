"""The four stages in pipeline order: what ``start_at``/``stop_after`` index (JAX-free)."""

STAGES: tuple[str, ...] = ("stage_out", "lower", "compile", "execute")

__all__ = ["STAGES"]
