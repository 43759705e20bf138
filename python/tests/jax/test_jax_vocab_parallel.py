"""xent.jax.vocab_parallel_cross_entropy under jax.shard_map on meshes of 2 and 4 CPU devices
(conftest starts XLA's CPU client with 4): values and gradients against the unsharded
xent.jax.cross_entropy and the float64 oracle for every option, even and uneven vocabularies
(padded last shards, a shard of padding only), bf16, vmap, and the errors for bad arguments."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from test_jax_cross_entropy import OPTIONS, assert_rounded_once, make, oracle, put, resolve

import xent.jax as xj


def mesh_of(devices):
    cpus = jax.devices("cpu")
    if len(cpus) < devices:
        pytest.fail(f"XLA's CPU client has {len(cpus)} devices, the test needs {devices}")
    return Mesh(np.array(cpus[:devices]), ("model",))


def padded(x, devices):
    """x (..., V) padded with garbage columns to R x ceil(V / R), as a padded LM head gives."""
    classes = x.shape[-1]
    width = -(-classes // devices)
    pad = width * devices - classes
    junk = jnp.full((*x.shape[:-1], pad), 7.0, x.dtype)  # large: it must not reach the LSE
    return jnp.concatenate([x, junk], axis=-1)


def sharded(devices, classes, **kw):
    """The vocab-parallel loss of padded global logits, as a jitted shard_map over `model`."""
    weight = kw.pop("weight", None)

    def body(x, y, w):
        return xj.vocab_parallel_cross_entropy(
            x, y, axis_name="model", vocab_size=classes, weight=w, **kw
        )

    def run(x, y):
        spec = P(*([None] * (x.ndim - 1)), "model")
        f = jax.shard_map(body, mesh=mesh_of(devices), in_specs=(spec, P(), P()), out_specs=P())
        return f(padded(x, devices), y, weight)

    return jax.jit(run)


def check(actual, expected, rtol):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = max(1.0, float(np.nanmax(np.abs(expected)))) if expected.size else 1.0
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


def value_and_grad(loss_fn, x, cotangent):
    """The loss and d <cotangent, loss> / d x (a random upstream gradient, per row for none)."""
    loss, vjp = jax.vjp(loss_fn, x)
    return loss, vjp(cotangent(loss))[0]


def cotangent_for(loss):
    return jax.random.uniform(jax.random.PRNGKey(3), loss.shape, loss.dtype, 0.5, 1.5)


SIZES = [(2, 16), (2, 13), (4, 16), (4, 13), (4, 5)]  # (devices, V): even, uneven, an empty shard

# The three kinds of shards a size gives the handlers: every device full (one plain call), a
# last shard partly padding (a lax.switch over the widths), a shard of padding only; each on 2
# and 4 devices where it can be.
KINDS = [[(2, 16), (4, 16)], [(4, 13), (2, 13)], [(4, 5)]]


def cases(options, bias=False):
    """Every option on every kind of shard, the kind's sizes taken in turn (each size runs about
    half the options; a full cross covers no more and compiles twice as much). bias: alternate a
    bias too, so that every option and every size runs with and without one."""
    out = []
    for j, kw in enumerate(options):
        for k, sizes in enumerate(KINDS):
            devices, classes = sizes[j % len(sizes)]
            name = f"{devices}-{classes}-{','.join(kw) or 'defaults'}"
            if not bias:
                out.append(pytest.param(devices, classes, kw, id=name))
                continue
            with_bias = (j // 2 + k) % 2 == 1
            name = f"{'bias' if with_bias else 'no-bias'}-{name}"
            out.append(pytest.param(devices, classes, with_bias, kw, id=name))
    return out


# The gradient in a buffer of its own (no alias to the shard) as well as over it.
VP_OPTIONS = [*OPTIONS, {"inplace_backward": False, "reduction": "sum", "label_smoothing": 0.1}]


@pytest.mark.parametrize("devices,classes,kw", cases(VP_OPTIONS))
def test_matches_unsharded_and_float64_oracle(devices, classes, kw):
    x, y = make((3, 7), classes)
    kw = resolve(kw, classes)
    if kw.get("ignore_index", -100) >= classes:
        kw["ignore_index"] = classes - 1
    f = sharded(devices, classes, **kw)
    loss, grad = value_and_grad(lambda x: f(x, y), x, cotangent_for)
    want, want_grad = value_and_grad(lambda x: xj.cross_entropy(x, y, **kw), x, cotangent_for)
    check(loss, want, 1e-6)
    check(grad, want_grad, 1e-6)

    ref, _, ref_grad = oracle(x, y, **{k: v for k, v in kw.items() if k != "inplace_backward"})
    ct = np.asarray(cotangent_for(loss), np.float64)
    ref_grad = ref_grad * (ct[..., None] if kw.get("reduction") == "none" else ct)
    check(loss, ref, 1e-6)
    check(grad, ref_grad, 1e-6)


@pytest.mark.parametrize("devices,classes", SIZES, ids=lambda s: str(s))
def test_padding_columns_get_zero_gradient(devices, classes):
    x, y = make((4,), classes)
    xp = padded(x, devices)

    def body(x, y):
        return xj.vocab_parallel_cross_entropy(x, y, axis_name="model", vocab_size=classes)

    f = jax.shard_map(body, mesh=mesh_of(devices), in_specs=(P(None, "model"), P()), out_specs=P())
    grad = jax.jit(jax.grad(f))(xp, y)
    assert np.all(np.asarray(grad)[:, classes:] == 0)
    check(grad[:, :classes], jax.grad(xj.cross_entropy)(x, y), 1e-6)


@pytest.mark.parametrize("devices,classes", [(2, 16), (4, 13)], ids=lambda s: str(s))
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_return_lse_is_the_unsharded_lse(devices, classes, reduction):
    x, y = make((2, 5), classes)
    y = y.at[0, 1].set(-100)
    loss, lse = sharded(devices, classes, reduction=reduction, return_lse=True)(x, y)
    want, want_lse = xj.cross_entropy(x, y, reduction=reduction, return_lse=True)
    check(loss, want, 1e-6)
    check(lse, want_lse, 1e-6)
    assert lse.shape == y.shape


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__)
def test_half_precision_matches_unsharded(dtype):
    classes = 301
    x, y = make((6,), classes, dtype)
    kw = {"label_smoothing": 0.1, "z_loss": 1e-3}
    f = sharded(4, classes, **kw)
    loss, grad = jax.value_and_grad(lambda x: f(x, y))(x)
    want, want_grad = jax.value_and_grad(lambda x: xj.cross_entropy(x, y, **kw))(x)
    assert loss.dtype == dtype and grad.dtype == dtype
    tol = {jnp.bfloat16: 2e-2, jnp.float16: 4e-3}[dtype]
    check(loss, want, tol)
    check(grad, want_grad, tol)


# As the unsharded calls (test_jax_cross_entropy): a loss scale reaches float16 gradients before
# they are rounded, here over shards of the vocabulary (one of them partly padding). The linear
# path rounds each chunk's logit gradient to float16 for its GEMMs, so its gradients are held to
# float16's unit roundoff in norm; at 1024 rows a mean's gradient rounded at upstream 1 / W
# misses it (its small entries lose their digits).
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_float16_gradients_take_the_upstream_before_rounding(reduction):
    classes = 999
    x, y = make((64,), classes, jnp.float16)
    y = y.at[3].set(-100)
    upstream = 2.0**15 if reduction == "mean" else 2.0**9
    g = float(np.float16(upstream))
    f = sharded(2, classes, reduction=reduction)
    _, _, d = oracle(x, y, reduction=reduction)
    assert_rounded_once(jax.grad(lambda x: f(x, y) * upstream)(x), d * g, "cross_entropy")

    h, wt, _, y = linear_inputs(1024, 48, classes, False)
    h, wt, y = h.astype(jnp.float16), (wt / 4).astype(jnp.float16), y.at[3].set(-100)
    upstream = 2.0**15 if reduction == "mean" else 2.0**5
    g = float(np.float16(upstream))
    lf = sharded_linear(2, classes, False, reduction=reduction)
    grads = jax.grad(lambda h, wt: lf(h, wt, None, y) * upstream, argnums=(0, 1))(h, wt)
    _, wants = linear_oracle(h, wt, None, y, reduction=reduction)
    for name, got, want in zip(("d_hidden", "d_weight"), grads, wants):
        got, want = np.asarray(got, np.float64), want * g
        assert np.isfinite(got).all(), name
        assert np.linalg.norm(got - want) <= 2.0**-11 * np.linalg.norm(want), name


def test_int64_labels_all_ignored_and_rows_of_zero():
    classes = 11
    x, y = make((5,), classes)
    ignored = jnp.full((5,), -100, jnp.int32)
    got = sharded(4, classes, reduction="sum")(x, ignored)
    assert float(got) == 0.0
    assert np.isnan(float(sharded(4, classes)(x, ignored)))  # mean over no rows, as unsharded
    empty = sharded(2, classes, reduction="none")(x[:0], y[:0])
    assert empty.shape == (0,)


def test_vmap_and_checkpoint_inside_shard_map():
    classes, devices = 13, 4
    x, y = make((3, 4), classes)

    def body(x, y):
        loss = partial(xj.vocab_parallel_cross_entropy, axis_name="model", vocab_size=classes)
        return jax.vmap(jax.checkpoint(loss))(x, y)

    f = jax.shard_map(
        body, mesh=mesh_of(devices), in_specs=(P(None, None, "model"), P()), out_specs=P()
    )
    xp = padded(x, devices)
    loss, grad = jax.jit(jax.value_and_grad(lambda x: f(x, y).sum()))(xp)
    want, want_grad = jax.value_and_grad(lambda x: jax.vmap(xj.cross_entropy)(x, y).sum())(x)
    check(loss, want, 1e-6)
    check(grad[..., :classes], want_grad, 1e-6)


# --- errors ---------------------------------------------------------------------------------------


def call_in_mesh(x, y, devices=2, **kw):
    def body(x, y):
        return xj.vocab_parallel_cross_entropy(x, y, **kw)

    f = jax.shard_map(body, mesh=mesh_of(devices), in_specs=(P(None, "model"), P()), out_specs=P())
    return f(x, y)


def test_eager_shard_map_of_calls_with_absent_operands():
    # Not jitted: jax.shard_map then wraps each call in a manual computation of its operands, and
    # jaxlib 0.11's Shardy crashed the process on an empty one (no class weights, no bias).
    x, y = make((6,), 8)
    h, wt, _, yl = linear_inputs(6, 3, 8, False)
    rows = partial(jax.shard_map, mesh=mesh_of(2), in_specs=P("model"), out_specs=P("model"))
    got = rows(lambda x, y: xj.cross_entropy(x, y, reduction="none"))(x, y)
    check(got, xj.cross_entropy(x, y, reduction="none"), 1e-6)
    summed = jax.shard_map(
        lambda x, y: lax.psum(xj.cross_entropy(x, y, reduction="sum"), "model"),
        mesh=mesh_of(2),
        in_specs=P("model"),
        out_specs=P(),
    )
    grad = jax.grad(lambda x: summed(x, y))(x)  # the fused forward+backward
    check(grad, jax.grad(lambda x: xj.cross_entropy(x, y, reduction="sum"))(x), 1e-6)
    linear = partial(jax.shard_map, mesh=mesh_of(2), in_specs=(P("model"), P(), P("model")))
    got = linear(
        lambda h, wt, y: xj.linear_cross_entropy(h, wt, y, reduction="none"), out_specs=P("model")
    )(h, wt, yl)
    check(got, xj.linear_cross_entropy(h, wt, yl, reduction="none"), 1e-6)
    for classes in (8, 13):  # vocab-parallel, even and uneven (a switch over the shard widths)
        x, y = make((6,), classes)
        grad = jax.grad(
            lambda x: call_in_mesh(padded(x, 2), y, axis_name="model", vocab_size=classes)
        )(x)
        check(grad, jax.grad(lambda x: xj.cross_entropy(x, y))(x), 1e-6)


def test_errors_name_the_argument():
    x, y = make((4,), 8)
    with pytest.raises(ValueError, match="axis_name 'vocab'"):
        call_in_mesh(x, y, axis_name="vocab")
    with pytest.raises(ValueError, match="vocab_size must be in \\[1, 8\\]"):
        call_in_mesh(x, y, axis_name="model", vocab_size=9)
    with pytest.raises(ValueError, match="weight must have shape \\(V,\\) = \\(7,\\)"):
        call_in_mesh(x, y, axis_name="model", vocab_size=7, weight=jnp.ones(8))
    with pytest.raises(TypeError, match="logits must be float32, bfloat16 or float16"):
        call_in_mesh(x.astype(jnp.int32), y, axis_name="model")
    with pytest.raises(ValueError, match="labels must have shape"):
        call_in_mesh(x, y[:3], axis_name="model")
    with pytest.raises(TypeError, match="inplace_backward must be a bool"):
        call_in_mesh(x, y, axis_name="model", inplace_backward=None)
    with pytest.raises(ValueError, match="axis_name"):
        xj.vocab_parallel_cross_entropy(x, y, axis_name="model")  # outside shard_map


def test_a_bad_label_is_named_as_the_caller_gave_it():
    # Each device's calls see class ids rotated by its first class and, where the caller's
    # ignore_index lies in [0, V), another one: the error still names the caller's label and
    # ignore_index (the CPU handlers raise; on CUDA the row's loss is NaN).
    x, _ = make((4,), 8)
    h, wt, b, _ = linear_inputs(4, 3, 8, True)
    for label in (-1, 9, -100):
        y = jnp.array([0, 1, label, 3])
        words = f"target {label} outside \\[0, 8\\) and not ignore_index \\(5\\)"
        with pytest.raises(jax.errors.JaxRuntimeError, match=words):
            jax.block_until_ready(sharded(2, 8, ignore_index=5)(x, y))
        with pytest.raises(jax.errors.JaxRuntimeError, match=words):
            jax.block_until_ready(sharded_linear(2, 8, True, ignore_index=5)(h, wt, b, y))


def test_merge_refuses_shards_that_do_not_tile_the_vocabulary(device):
    # Two devices' records that both claim classes [0, 4) of 8: the merge's header check, run on
    # the device's platform (_vp_call adds the CUDA handler's workspace result on a GPU).
    from xent.jax import _ffi
    from xent.jax._core import _check_options
    from xent.jax.vocab_parallel import _block_bytes, _vp_call

    if device.platform != "cpu" and not xj.with_cuda:
        pytest.skip("xent.jax was built without its CUDA handlers")
    x, y = make((3,), 4)
    none = jnp.zeros((0,), jnp.float32)
    x, y, none = put(device, x, y, none)
    cfg = _check_options(-100, 0.0, "mean", 0.0, 0.0)
    send_type = jax.ShapeDtypeStruct((_block_bytes(3, cfg),), jnp.uint8)
    send = _vp_call("xent_vocab_parallel_records", send_type, x, y, none, cfg=cfg, vocab=8)
    results = (jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((3,), jnp.float32))
    workspace = _ffi.workspace_bytes("vocab_parallel_merge", jnp.float32, 3)

    def merge(recv):
        return jax.block_until_ready(
            _vp_call(
                "xent_vocab_parallel_merge",
                results,
                recv,
                y,
                none,
                cfg=cfg,
                vocab=8,
                workspace=workspace,
            )
        )

    recv = jnp.concatenate([send, send])
    if device.platform == "cpu":
        with pytest.raises(Exception, match="recv.*tile"):
            merge(recv)
    else:  # the device's headers are not read on the host: NaN, as documented
        loss, lse = merge(recv)
        assert np.isnan(float(loss)) and np.isnan(np.asarray(lse)).all()
    with pytest.raises(Exception, match="recv.*blocks"):
        merge(recv[:-8])


# --- the fused linear path ------------------------------------------------------------------------


def linear_oracle(h, wt, b, y, **kw):
    """The loss and the gradients of hidden, weight and bias, in float64, through the oracle."""
    h64, w64 = np.asarray(h, np.float64), np.asarray(wt, np.float64)
    logits = h64 @ w64.T + (0.0 if b is None else np.asarray(b, np.float64))
    loss, _, dz = oracle(logits, y, **kw)
    if kw.get("reduction") == "none":
        loss = loss.sum()
    return loss, (dz @ w64, dz.T @ h64, dz.sum(axis=0))


def linear_inputs(rows, dim, classes, bias):
    """hidden (rows, dim), an LM head's weight (classes, dim), its bias (classes,) or None (bias
    False) and labels (rows,), float32."""
    keys = jax.random.split(jax.random.PRNGKey(5), 4)
    h = jax.random.normal(keys[0], (rows, dim))
    wt = jax.random.normal(keys[1], (classes, dim))
    b = jax.random.normal(keys[2], (classes,)) if bias else None
    return h, wt, b, jax.random.randint(keys[3], (rows,), 0, classes)


def sharded_linear(devices, classes, bias, **kw):
    class_weight = kw.pop("weight", None)

    def body(h, wt, b, y, cw):
        return xj.vocab_parallel_linear_cross_entropy(
            h, wt, y, b, axis_name="model", vocab_size=classes, class_weight=cw, **kw
        )

    def run(h, wt, b, y):
        pad = -(-classes // devices) * devices - classes
        wt = jnp.concatenate([wt, jnp.full((pad, wt.shape[1]), 0.5, wt.dtype)])
        b = None if b is None else jnp.concatenate([b, jnp.full((pad,), 9.0, b.dtype)])
        f = jax.shard_map(
            body,
            mesh=mesh_of(devices),
            in_specs=(P(), P("model", None), None if b is None else P("model"), P(), P()),
            out_specs=P(),
        )
        return f(h, wt, b, y, class_weight).sum()

    return run


LINEAR_OPTIONS = [
    {},
    {"reduction": "sum", "label_smoothing": 0.1},
    {"reduction": "none", "ignore_index": 2, "z_loss": 1e-3},
    {"weight": "random", "label_smoothing": 0.3, "softcap": 4.0, "chunk_rows": 3},
]


@pytest.mark.parametrize("devices,classes,bias,kw", cases(LINEAR_OPTIONS, bias=True))
def test_linear_matches_unsharded_and_float64_oracle(devices, classes, bias, kw):
    h, wt, b, y = linear_inputs(7, 6, classes, bias)
    kw = resolve(kw, classes)
    argnums = (0, 1, 2) if bias else (0, 1)
    f = sharded_linear(devices, classes, bias, **kw)
    loss, padded_grads = jax.jit(jax.value_and_grad(f, argnums=argnums))(h, wt, b, y)
    grads = padded_grads
    kw.pop("chunk_rows", None)
    cw = kw.pop("weight", None)

    def unsharded(h, wt, b):
        return xj.linear_cross_entropy(h, wt, y, b, class_weight=cw, **kw).sum()

    want, want_grads = jax.jit(jax.value_and_grad(unsharded, argnums=argnums))(h, wt, b)
    # d_hidden whole; d_weight and d_bias without their padding rows.
    grads = (grads[0], *(g[:classes] for g in grads[1:]))
    check(loss, want, 1e-6)
    for got, expected in zip(grads, want_grads):
        check(got, expected, 1e-6)

    ref, ref_grads = linear_oracle(h, wt, b, y, weight=cw, **kw)
    check(loss, ref, 1e-6)
    for got, expected in zip(grads, ref_grads):
        check(got, expected, 1e-6)
    assert np.all(np.asarray(padded_grads[1])[classes:] == 0)  # padding rows: no gradient


def test_linear_bf16_matches_unsharded():
    classes, devices = 301, 4
    keys = jax.random.split(jax.random.PRNGKey(2), 3)
    h = jax.random.normal(keys[0], (9, 16), jnp.bfloat16)
    wt = jax.random.normal(keys[1], (classes, 16), jnp.bfloat16)
    y = jax.random.randint(keys[2], (9,), 0, classes)
    f = sharded_linear(devices, classes, False)
    loss, (dh, dw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(h, wt, None, y)
    want, (wh, ww) = jax.value_and_grad(
        lambda h, wt: xj.linear_cross_entropy(h, wt, y), argnums=(0, 1)
    )(h, wt)
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    check(loss, want, 2e-2)
    check(dh, wh, 2e-2)
    check(dw[:classes], ww, 2e-2)


def test_linear_errors_name_the_argument():
    h = jnp.ones((3, 4))
    y = jnp.zeros((3,), jnp.int32)

    def call(wt, b=None, **kw):
        def body(h, wt, y):
            return xj.vocab_parallel_linear_cross_entropy(h, wt, y, b, **kw)

        f = jax.shard_map(
            body, mesh=mesh_of(2), in_specs=(P(), P("model", None), P()), out_specs=P()
        )
        return f(h, wt, y)

    with pytest.raises(ValueError, match="weight must be \\(C, D\\) with D = 4"):
        call(jnp.ones((8, 5)), axis_name="model")
    with pytest.raises(ValueError, match="bias must have shape \\(C,\\) = \\(4,\\)"):
        call(jnp.ones((8, 4)), jnp.ones(8), axis_name="model")
    with pytest.raises(ValueError, match="axis_name 'vocab'"):
        call(jnp.ones((8, 4)), axis_name="vocab")
    with pytest.raises(ValueError, match="chunk_rows must be >= 1"):
        call(jnp.ones((8, 4)), axis_name="model", chunk_rows=0)


# --- rows split over a second mesh axis (data parallelism) ------------------------------------------


def data_model_mesh(model):
    cpus = jax.devices("cpu")
    return Mesh(np.array(cpus[: 4 // model * model]).reshape(4 // model, model), ("data", "model"))


@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("model", [1, 2], ids=["data", "data_model"])
def test_rows_over_another_axis_train_inside_shard_map(model, reduction):
    # Each device's loss and gradients vary along "data" too: jax types xent's results so, and the
    # replicated weight's gradient is summed over "data" as jax's own shard_map would sum it.
    mesh = data_model_mesh(model)
    h, wt, _, y = linear_inputs(8, 4, 16, bias=False)
    x = h @ wt.T
    vocab = dict(axis_name="model") if model > 1 else {}
    ce = xj.vocab_parallel_cross_entropy if model > 1 else xj.cross_entropy
    lce = xj.vocab_parallel_linear_cross_entropy if model > 1 else xj.linear_cross_entropy
    x_spec, w_spec = (P("data", "model"), P("model")) if model > 1 else (P("data"), P())

    def logits_step(x, y):
        loss, g = jax.value_and_grad(lambda x: ce(x, y, reduction=reduction, **vocab).sum())(x)
        return jax.lax.psum(loss, "data"), g

    def linear_step(h, wt, y):
        f = lambda h, wt: lce(h, wt, y, reduction=reduction, **vocab).sum()  # noqa: E731
        loss, grads = jax.value_and_grad(f, argnums=(0, 1))(h, wt)
        return jax.lax.psum(loss, "data"), *grads

    want_loss, _, want_dx = oracle(x, y, reduction="sum")
    loss, dx = jax.jit(
        jax.shard_map(logits_step, mesh=mesh, in_specs=(x_spec, P("data")), out_specs=(P(), x_spec))
    )(x, y)
    check(loss, want_loss, 1e-6)
    check(dx, want_dx, 1e-6)
    want_loss, (want_dh, want_dw, _) = linear_oracle(h, wt, None, y, reduction="sum")
    loss, dh, dw = jax.jit(
        jax.shard_map(
            linear_step,
            mesh=mesh,
            in_specs=(P("data"), w_spec, P("data")),
            out_specs=(P(), P("data"), w_spec),
        )
    )(h, wt, y)
    check(loss, want_loss, 1e-6)
    check(dh, want_dh, 1e-6)
    check(dw, want_dw, 1e-6)
    # Without the psum the loss differs between devices: a replicated output is refused, as for
    # jax's own ops.
    with pytest.raises(ValueError):
        jax.jit(
            jax.shard_map(
                lambda x, y: ce(x, y, **vocab),
                mesh=mesh,
                in_specs=(x_spec, P("data")),
                out_specs=P(),
            )
        )(x, y)
