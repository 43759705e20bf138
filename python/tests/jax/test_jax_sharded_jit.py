"""xent.jax.cross_entropy and linear_cross_entropy under jax.jit on operands with a NamedSharding
(meshes of 2 and 4 CPU devices, conftest starts 4): the logits split by vocabulary, by rows, or
both, and the LM head's weight by vocabulary. Values and gradients equal the unsharded call
within 1e-6 relative (float32), and the compiled HLO gathers no logits nor weight: its only
all-gathers are of the vocab-parallel records (uint8)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_jax_cross_entropy import make, resolve
from test_jax_vocab_parallel import linear_inputs

import xent.jax as xj


def mesh_of(rows, vocab):
    cpus = jax.devices("cpu")
    if len(cpus) < rows * vocab:
        pytest.fail(f"XLA's CPU client has {len(cpus)} devices, the test needs {rows * vocab}")
    return Mesh(np.array(cpus[: rows * vocab]).reshape(rows, vocab), ("b", "v"))


def check(actual, expected, rtol=1e-6):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = max(1.0, float(np.nanmax(np.abs(expected)))) if expected.size else 1.0
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


_GATHER = re.compile(r"=\s*(\(?[a-z0-9]+)\[[^=]*?\s(all-gather(?:-start)?)\(")


def gathered_types(compiled) -> list[str]:
    """The element types of every all-gather in a compiled function's HLO."""
    return [m.group(1).lstrip("(") for m in _GATHER.finditer(compiled.as_text())]


def assert_gathers_records_only(f, *args, vocab_split=True):
    """No all-gather in f's HLO but of the records, which one where the vocabulary is split."""
    types = gathered_types(f.lower(*args).compile())
    assert all(t == "u8" for t in types), f"all-gathers of {types}: the operands were gathered"
    assert ("u8" in types) == vocab_split, f"all-gathers of {types}"


def value_and_grad(loss, *args, argnums=0):
    """The loss summed (reduction none) and its gradient, jitted, and the unsharded call's."""
    f = jax.jit(jax.value_and_grad(lambda *a: loss(*a).sum(), argnums=argnums))
    return f, f(*args)


# (mesh rows x vocabulary, the logits' spec): the vocabulary alone, rows and vocabulary, rows
# alone, and both split over a tuple of mesh axes.
LAYOUTS = [
    ((1, 2), P(None, "v")),
    ((1, 4), P(None, "v")),
    ((1, 2), P("b", "v")),
    ((2, 2), P("b", "v")),
    ((2, 2), P("b", None)),
    ((2, 2), P(None, ("b", "v"))),
    ((2, 2), P(("b", "v"), None)),
]

CE_OPTIONS = [
    {},
    {"reduction": "sum", "label_smoothing": 0.1},
    {"reduction": "none", "ignore_index": 3, "z_loss": 1e-3},
    {"weight": "random", "label_smoothing": 0.3, "z_loss": 1e-2, "softcap": 4.0, "ignore_index": 1},
    {"inplace_backward": False},
]


@pytest.mark.parametrize("kw", CE_OPTIONS, ids=lambda kw: ",".join(kw) or "defaults")
@pytest.mark.parametrize("shape,spec", LAYOUTS, ids=lambda v: str(v).replace(" ", ""))
def test_cross_entropy_matches_unsharded_without_gathering_logits(shape, spec, kw):
    classes = 16
    x, y = make((12,), classes)
    kw = resolve(kw, classes)
    xs = jax.device_put(x, NamedSharding(mesh_of(*shape), spec))
    f, (loss, grad) = value_and_grad(lambda x: xj.cross_entropy(x, y, **kw), xs)
    want, want_grad = jax.value_and_grad(lambda x: xj.cross_entropy(x, y, **kw).sum())(x)
    check(loss, want)
    check(grad, want_grad)
    assert grad.sharding.is_equivalent_to(xs.sharding, 2)
    assert_gathers_records_only(f, xs, vocab_split=spec[1] is not None)


# float16 forms its gradient in backward from each row's upstream (the loss's gradient over the
# mean's normaliser W): W of every row shard together, as the forward's mean, not of one shard.
@pytest.mark.parametrize("shape,spec", LAYOUTS, ids=lambda v: str(v).replace(" ", ""))
def test_float16_mean_divides_by_every_shards_normaliser(shape, spec):
    classes = 16
    x, y = make((12,), classes, jnp.float16)
    y = y.at[1].set(-100)
    kw = resolve({"weight": "random", "label_smoothing": 0.1}, classes)
    xs = jax.device_put(x, NamedSharding(mesh_of(*shape), spec))
    f, (loss, grad) = value_and_grad(lambda x: xj.cross_entropy(x, y, **kw) * 1024.0, xs)
    want, want_grad = jax.value_and_grad(lambda x: xj.cross_entropy(x, y, **kw) * 1024.0)(x)
    check(loss, want, 1e-3)
    check(grad, want_grad, 1e-3)
    assert_gathers_records_only(f, xs, vocab_split=spec[1] is not None)


def test_three_dimensional_logits_and_return_lse():
    x, y = make((4, 3), 16)
    xs = jax.device_put(x, NamedSharding(mesh_of(2, 2), P("b", None, "v")))
    f = jax.jit(lambda x: xj.cross_entropy(x, y, return_lse=True, label_smoothing=0.1))
    loss, lse = f(xs)
    want, want_lse = xj.cross_entropy(x, y, return_lse=True, label_smoothing=0.1)
    check(loss, want)
    check(lse, want_lse)
    assert_gathers_records_only(f, xs)


def test_uneven_shards_inside_jit():
    # 13 classes over 4 devices and 7 rows over 2: XLA pads the last shards. The padding columns
    # are no classes; rows that do not divide are not split (XLA gathers them).
    x, y = make((7,), 13)
    y = y.at[2].set(-100)
    for shape, spec in (((1, 4), P(None, "v")), ((2, 2), P("b", "v"))):
        sharding = NamedSharding(mesh_of(*shape), spec)

        def loss(x):
            return xj.cross_entropy(jax.lax.with_sharding_constraint(x, sharding), y, z_loss=1e-3)

        # The gradient summed over classes: an uneven (7, 13) result would be gathered to leave.
        f = jax.jit(lambda x: (loss(x), jax.grad(loss)(x).sum(axis=1)))
        got, got_grad = f(x)
        want, want_grad = jax.value_and_grad(lambda x: xj.cross_entropy(x, y, z_loss=1e-3))(x)
        check(got, want)
        check(got_grad, want_grad.sum(axis=1))
        if shape == (1, 4):
            assert_gathers_records_only(f, x)


def test_vmap_and_checkpoint_of_sharded_logits():
    x, y = make((3, 8), 16)
    xs = jax.device_put(x, NamedSharding(mesh_of(1, 4), P(None, None, "v")))
    _, (loss, grad) = value_and_grad(jax.vmap(xj.cross_entropy), xs, y)
    want, want_grad = jax.value_and_grad(lambda x: jax.vmap(xj.cross_entropy)(x, y).sum())(x)
    check(loss, want)
    check(grad, want_grad)
    f, (loss, grad) = value_and_grad(jax.checkpoint(xj.cross_entropy), xs[0], y[0])
    check(loss, xj.cross_entropy(x[0], y[0]))
    check(grad, jax.grad(xj.cross_entropy)(x[0], y[0]))
    assert_gathers_records_only(f, xs[0], y[0])


def test_float64_logits_are_gathered_and_right():
    # float64 calls are not partitioned (the vocab-parallel handlers take no float64). They run
    # on the CPU only: the unsharded call too is put there, not on a GPU that jax may default to.
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        x, y = make((8,), 16, jnp.float64)
        xs = jax.device_put(x, NamedSharding(mesh_of(2, 2), P("b", "v")))
        _, (loss, grad) = value_and_grad(lambda x: xj.cross_entropy(x, y), xs)
        want, want_grad = jax.value_and_grad(lambda x: xj.cross_entropy(x, y))(x)
        check(loss, want, 1e-12)
        check(grad, want_grad, 1e-12)


def test_gspmd_partitioner():
    x, y = make((8,), 16)
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        xs = jax.device_put(x, NamedSharding(mesh_of(2, 2), P("b", "v")))
        f, (loss, grad) = value_and_grad(lambda x: xj.cross_entropy(x, y, z_loss=1e-3), xs)
        assert_gathers_records_only(f, xs)
    finally:
        jax.config.update("jax_use_shardy_partitioner", previous)
    want, want_grad = jax.value_and_grad(lambda x: xj.cross_entropy(x, y, z_loss=1e-3))(x)
    check(loss, want)
    check(grad, want_grad)


# --- the fused linear path ------------------------------------------------------------------------

# (mesh, hidden's spec, the weight's spec): the weight by vocabulary, hidden by rows, both.
LINEAR_LAYOUTS = [
    ((1, 2), P(), P("v", None)),
    ((1, 4), P(), P("v", None)),
    ((2, 2), P("b", None), P("v", None)),
    ((2, 2), P("b", None), P()),
]

LINEAR_OPTIONS = [
    {},
    {"reduction": "sum", "label_smoothing": 0.1, "ignore_index": 2},
    {"reduction": "none", "weight": "random", "z_loss": 1e-3, "softcap": 4.0},
]


@pytest.mark.parametrize("kw", LINEAR_OPTIONS, ids=lambda kw: ",".join(kw) or "defaults")
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("shape,hspec,wspec", LINEAR_LAYOUTS, ids=lambda v: str(v).replace(" ", ""))
def test_linear_matches_unsharded_without_gathering_the_weight(shape, hspec, wspec, bias, kw):
    classes = 16
    h, wt, b, y = linear_inputs(8, 6, classes, bias)
    kw = resolve(kw, classes)
    cw = kw.pop("weight", None)
    mesh = mesh_of(*shape)
    hs = jax.device_put(h, NamedSharding(mesh, hspec))
    ws = jax.device_put(wt, NamedSharding(mesh, wspec))
    bs = None if b is None else jax.device_put(b, NamedSharding(mesh, P(*wspec[:1])))
    argnums = (0, 1, 2) if bias else (0, 1)

    def loss(h, wt, b):
        return xj.linear_cross_entropy(h, wt, y, b, class_weight=cw, **kw)

    f, (got, grads) = value_and_grad(loss, hs, ws, bs, argnums=argnums)
    want, want_grads = jax.value_and_grad(lambda *a: loss(*a).sum(), argnums=argnums)(h, wt, b)
    check(got, want)
    for g, w in zip(grads, want_grads):
        check(g, w)
    assert grads[1].sharding.is_equivalent_to(ws.sharding, 2)
    assert_gathers_records_only(f, hs, ws, bs, vocab_split=wspec != P())


@pytest.mark.parametrize("shape,hspec,wspec", LINEAR_LAYOUTS, ids=lambda v: str(v).replace(" ", ""))
def test_linear_float16_mean_divides_by_every_shards_normaliser(shape, hspec, wspec):
    h, wt, _, y = linear_inputs(8, 6, 16, False)
    h, wt = h.astype(jnp.float16), wt.astype(jnp.float16)
    y = y.at[1].set(-100)
    mesh = mesh_of(*shape)
    hs = jax.device_put(h, NamedSharding(mesh, hspec))
    ws = jax.device_put(wt, NamedSharding(mesh, wspec))

    def loss(h, wt):
        return xj.linear_cross_entropy(h, wt, y) * 1024.0

    f, (got, grads) = value_and_grad(loss, hs, ws, argnums=(0, 1))
    want, want_grads = jax.value_and_grad(loss, argnums=(0, 1))(h, wt)
    check(got, want, 1e-3)
    for g, w in zip(grads, want_grads):
        check(g, w, 2e-3)
    assert_gathers_records_only(f, hs, ws, vocab_split=wspec != P())


@pytest.mark.parametrize("spec", [P("b", None), P("b", "v")], ids=["rows", "rows_vocab"])
def test_a_bad_label_on_one_row_shard_raises_on_every_device(spec):
    # Only the devices holding row 5 meet it: unless every device raises, the others wait for them
    # in a row sum until XLA ends the process.
    x, y = make((8,), 16)
    y = y.at[5].set(-1)
    h, wt = jax.random.normal(jax.random.PRNGKey(2), (8, 4)), jnp.ones((16, 4))
    mesh = mesh_of(2, 2)
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    hs = jax.device_put(h, NamedSharding(mesh, P("b", None)))
    calls = [
        (lambda x: xj.cross_entropy(x, y), xs),
        (jax.grad(lambda x: xj.cross_entropy(x, y)), xs),
        (lambda h: xj.linear_cross_entropy(h, wt, y), hs),
        (jax.grad(lambda h: xj.linear_cross_entropy(h, wt, y)), hs),
    ]
    for f, arg in calls:
        with pytest.raises(jax.errors.JaxRuntimeError, match="targets"):
            jax.block_until_ready(jax.jit(f)(arg))
