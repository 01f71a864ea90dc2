"""The hand-written baseline with JAX's persistent compilation cache on: warm runs' peer.

Exactly ``bench/baseline_jit.py``, after
``jax.config.update("jax_compilation_cache_dir", DIR)`` and
``jax_persistent_cache_min_compile_time_secs=0`` (so every compile is cached): what a user
who knows JAX's own cache would write. Its second and later runs load the executable.
Usage: python bench/baseline_cached.py axpy|transformer|transformer_train CACHE_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))

from baseline_jit import main

if __name__ == "__main__":
    jax.config.update("jax_compilation_cache_dir", sys.argv[2])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    main(sys.argv[1])
