"""Which handler's signature each xent.jax call lowers to, checked without a GPU: a CUDA call takes
its device workspace as one more uint8 result (_core._call), a CPU call has none, and the choice
is the platform's that a computation is lowered for, not jax's default backend's (on a GPU
machine, a call on CPU arrays runs the CPU handler, eager or under an eager jax.vmap too).

Every workspace is faked to WORKSPACE bytes, what a CUDA build's query answers, so that a build
without the CUDA handlers lowers the same custom calls for CUDA; nothing runs on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_jax_cross_entropy import assert_close, make

import xent.jax as xj
from xent.jax import _ffi

WORKSPACE = 4096  # bytes, recognisable in the lowered text
_RESULT = f"tensor<{WORKSPACE}xui8>"


@pytest.fixture
def fake_workspace(monkeypatch):
    monkeypatch.setattr(_ffi, "workspace_bytes", lambda *args, **kwargs: WORKSPACE)


def _ce(reduction):
    def f(x, y):
        return jax.value_and_grad(lambda x: xj.cross_entropy(x, y, reduction=reduction).sum())(x)

    return f, make((6,), 11)


def _linear(reduction):
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    h, w = jax.random.normal(k[0], (6, 4)), jax.random.normal(k[1], (11, 4))
    y = jax.random.randint(k[2], (6,), 0, 11)

    def f(h, w, y):
        loss = lambda h, w: xj.linear_cross_entropy(h, w, y, reduction=reduction).sum()
        return jax.value_and_grad(loss, argnums=(0, 1))(h, w)

    return f, (h, w, y)


def _vocab_parallel():
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("v",))
    body = lambda x, y: xj.vocab_parallel_cross_entropy(x, y, axis_name="v")
    sm = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "v"), P()), out_specs=P())
    return jax.value_and_grad(sm), make((6,), 11)


# name: (function and arguments, the calls that take a workspace on CUDA)
CALLS = {
    "cross_entropy mean": (_ce("mean"), 1),  # fused forward-backward; the scale takes none
    "cross_entropy none": (_ce("none"), 1),  # forward; backward takes none
    "linear_cross_entropy mean": (_linear("mean"), 1),  # fused
    "linear_cross_entropy none": (_linear("none"), 2),  # forward and backward
    "vocab_parallel_cross_entropy": (_vocab_parallel(), 1),  # the merge
}


@pytest.mark.parametrize("name", CALLS)
def test_the_workspace_result_follows_the_lowering_platform(fake_workspace, name):
    (f, args), with_workspace = CALLS[name]
    traced = jax.jit(f).trace(*args)
    cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
    cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
    assert cuda.count(_RESULT) == with_workspace, cuda
    assert _RESULT not in cpu, cpu
    assert cuda.count("custom_call @xent_") == cpu.count("custom_call @xent_") > 0


def _counting_fake(monkeypatch):
    asked = []
    monkeypatch.setattr(_ffi, "workspace_bytes", lambda *a, **k: asked.append(a) or WORKSPACE)
    return asked


@pytest.mark.parametrize("name", CALLS)
def test_cpu_arrays_run_the_cpu_handlers_where_cuda_takes_a_workspace(monkeypatch, name):
    # A workspace-taking call runs through lax.platform_dependent, here on the CPU: eagerly, under
    # an eager vmap (_sharding's batching rule runs one) and jitted, as without the workspace.
    (f, args), _ = CALLS[name]
    cpu = jax.devices("cpu")[0]
    args = jax.device_put(args, cpu)
    batched = jax.device_put(jax.tree.map(lambda a: jnp.stack([a, a[::-1]]), args), cpu)
    want = f(*args), jax.vmap(f)(*batched)
    asked = _counting_fake(monkeypatch)
    for got in (
        (f(*args), jax.vmap(f)(*batched)),
        jax.jit(lambda a, b: (f(*a), jax.vmap(f)(*b)))(args, batched),
    ):
        jax.tree.map(lambda g, w: assert_close(g, w, 1e-6), got, want)
    assert asked


def test_sharded_calls_with_a_workspace_run_on_cpu_meshes(monkeypatch):
    # Under jit on a vocabulary-sharded operand, _sharding's partition callbacks make the calls.
    cpus = jax.devices("cpu")[:2]
    x, y = make((6,), 12)
    x = jax.device_put(x, NamedSharding(Mesh(np.array(cpus), ("v",)), P(None, "v")))
    loss = lambda x: xj.cross_entropy(x, y, z_loss=1e-3)
    want = jax.jit(jax.value_and_grad(loss))(x)
    asked = _counting_fake(monkeypatch)
    got = jax.jit(jax.value_and_grad(lambda x: loss(x)))(x)
    jax.tree.map(lambda g, w: assert_close(g, w, 1e-6), got, want)
    assert asked
