"""xent for JAX: fused cross-entropy as XLA FFI calls, differentiable, under jit, vmap and
jax.checkpoint.

    import xent.jax as xj
    loss = xj.cross_entropy(logits, labels)          # logits (..., V), labels (...) int32 / int64
    loss = xj.linear_cross_entropy(hidden, lm_head, labels)   # no (..., V) logits
    loss = xj.vocab_parallel_cross_entropy(shard, labels, axis_name="model")  # in shard_map

Under jax.jit, logits (or an LM head's weight) with a NamedSharding on the vocabulary or the rows
are partitioned without being gathered (_sharding.py).

Importing compiles nothing: the handlers were built with the package (python/csrc/jax/) and are
registered with XLA here, on the CPU and, where the package was built with nvcc, on CUDA.
"""

from . import _ffi
from .ops import cross_entropy, linear_cross_entropy
from .vocab_parallel import vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy

with_cuda: bool = _ffi.with_cuda
"""Whether the CUDA handlers were built (nvcc found when the package was installed)."""

__all__ = [
    "cross_entropy",
    "linear_cross_entropy",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_linear_cross_entropy",
    "with_cuda",
]
