"""Flax linen partition boxes (``nn.Partitioned``, ``nn.LogicallyPartitioned``) in arguments.

``model.init`` of a module whose initializers use ``nn.with_partitioning`` or
``nn.with_logical_partitioning`` returns params whose leaves are boxes: a value plus axis names.
jaxaot traces the value alone (the leaf path names the param, not ``.../value``), records the
names as the leaf's logical axes, and boxes the traced value again inside the function, so
``model.apply`` sees exactly what it was given.
"""

from __future__ import annotations

import sys
from typing import Any


def is_box(x: Any) -> bool:
    meta = sys.modules.get("flax.core.meta")
    return meta is not None and isinstance(x, meta.AxisMetadata)


def box_axes(box: Any) -> tuple[str | None, ...] | None:
    names = getattr(box, "names", None)
    if names is None:
        return None
    return tuple(None if n is None else str(n) for n in names)
