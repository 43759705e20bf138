"""xent: fused cross-entropy and fused linear cross-entropy, never materialising what it need not.

One package per framework, over the same C++ entry points:
    xent.torch   PyTorch custom ops and modules (`import xent.torch`)
    xent.jax     XLA FFI calls with custom VJPs (`import xent.jax`)
Importing `xent` alone loads no framework.
"""
