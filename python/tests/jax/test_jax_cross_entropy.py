"""xent.jax.cross_entropy against a float64 NumPy oracle and optax, on the CPU and (where jax
sees one) a GPU: values and gradients for every option, jit / grad / value_and_grad / vmap /
jax.checkpoint, the edge sizes, float64 (on the CPU device; a GPU's handlers refuse it by name),
and the errors for bad arguments, the handlers' own included."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.test_util import check_grads

import xent.jax as xj
from xent.jax import _ffi


def put(device, *arrays):
    return tuple(jax.device_put(a, device) for a in arrays)


# --- the float64 oracle, written plainly ----------------------------------------------------------


def oracle(
    logits,
    labels,
    *,
    weight=None,
    ignore_index=-100,
    label_smoothing=0.0,
    reduction="mean",
    z_loss=0.0,
    softcap=0.0,
):
    """Loss (as reduction asks), per-row LSE and d loss / d logits, in float64.

    The options are float32 in xent, so they are rounded to float32 here too."""
    x0 = np.asarray(logits, np.float64)
    classes = x0.shape[-1]
    x0 = x0.reshape(-1, classes)
    y = np.asarray(labels).reshape(-1)
    rows = x0.shape[0]
    eps = float(np.float32(label_smoothing))
    z = float(np.float32(z_loss))
    cap = float(np.float32(softcap))
    w = np.ones(classes) if weight is None else np.asarray(weight, np.float32).astype(np.float64)

    x = cap * np.tanh(x0 / cap) if cap else x0
    m = x.max(axis=1, keepdims=True) if rows else np.zeros((0, 1))
    lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=1))
    logp = x - lse[:, None]
    p = np.exp(logp)
    keep = y != ignore_index
    yc = np.where(keep, y, 0)
    r = np.arange(rows)

    nll = -w[yc] * logp[r, yc]
    smooth = -(logp * w).sum(axis=1) / classes
    row = (1 - eps) * nll + eps * smooth + z * lse**2
    row = np.where(keep, row, 0.0)

    # d row / d x (the capped logits): softmax terms of each part.
    onehot = np.zeros_like(x)
    onehot[r, yc] = 1.0
    d = (1 - eps) * w[yc][:, None] * (p - onehot)
    d += eps / classes * (w.sum() * p - w[None, :])
    d += 2 * z * lse[:, None] * p
    d = np.where(keep[:, None], d, 0.0)
    if cap:
        d *= 1 - np.tanh(x0 / cap) ** 2

    if reduction == "none":
        return row.reshape(np.shape(labels)), lse, d.reshape(np.shape(logits))
    if reduction == "sum":
        return row.sum(), lse, d.reshape(np.shape(logits))
    total = (w[yc] * keep).sum()
    with np.errstate(invalid="ignore", divide="ignore"):
        return row.sum() / total, lse, (d / total).reshape(np.shape(logits))


def make(shape, classes, dtype=jnp.float32, seed=0, scale=3.0, label_dtype=jnp.int32):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    x = (scale * jax.random.normal(k1, (*shape, classes), jnp.float32)).astype(dtype)
    y = jax.random.randint(k2, shape, 0, classes).astype(label_dtype)
    return x, y


def loss_and_grad(x, y, **kw):
    """xent's loss and its gradient, the gradient taken of sum(loss) for reduction none."""
    return jax.value_and_grad(lambda x: xj.cross_entropy(x, y, **kw).sum())(x)


TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}


def assert_close(actual, expected, tol):
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), np.asarray(expected, np.float64), rtol=tol, atol=tol
    )


# --- values and gradients -------------------------------------------------------------------------

OPTIONS = [
    {},
    {"reduction": "sum"},
    {"reduction": "none"},
    {"label_smoothing": 0.1},
    {"z_loss": 1e-3},
    {"softcap": 5.0},
    {"weight": "random"},
    {"ignore_index": 3},
    {"ignore_index": 3, "reduction": "none", "label_smoothing": 0.2},
    {"weight": "random", "label_smoothing": 0.3, "z_loss": 1e-2, "softcap": 4.0, "ignore_index": 1},
    {"weight": "random", "reduction": "sum", "ignore_index": 0, "softcap": 2.0},
]


def resolve(kw, classes):
    kw = dict(kw)
    if kw.get("weight") == "random":
        kw["weight"] = jax.random.uniform(jax.random.PRNGKey(7), (classes,), minval=0.1, maxval=2)
    return kw


@pytest.mark.parametrize("kw", OPTIONS, ids=lambda kw: ",".join(kw) or "defaults")
@pytest.mark.parametrize(
    "dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__
)
def test_matches_float64_oracle(device, kw, dtype):
    classes = 37
    x, y = make((3, 5), classes, dtype)
    kw = resolve(kw, classes)
    if "weight" in kw:
        (kw["weight"],) = put(device, kw["weight"])
    x, y = put(device, x, y)
    loss, grad = loss_and_grad(x, y, **kw)
    want, want_lse, want_grad = oracle(x, y, **kw)
    if kw.get("reduction") == "none":
        want = want.sum()
    tol = TOL[dtype]
    assert loss.dtype == dtype and grad.dtype == dtype
    assert_close(loss, want, tol * max(1.0, abs(float(want))))
    assert_close(grad, want_grad, tol)
    _, lse = xj.cross_entropy(x, y, return_lse=True, **kw)
    assert lse.shape == y.shape and lse.dtype == jnp.float32
    ignored = np.asarray(y) == kw.get("ignore_index", -100)  # rows never read: LSE 0
    assert_close(lse, np.where(ignored, 0.0, want_lse.reshape(y.shape)), 2e-4)


@pytest.mark.parametrize("label_dtype", [jnp.int32, jnp.int64], ids=["int32", "int64"])
def test_int64_labels_match_int32(device, label_dtype):
    with jax.enable_x64(True):
        x, y = make((4, 6), 19, label_dtype=label_dtype)
        x, y = put(device, x, y)
        assert y.dtype == label_dtype
        loss, grad = loss_and_grad(x, y, ignore_index=2)
        want, _, want_grad = oracle(x, y, ignore_index=2)
    assert_close(loss, want, 2e-5)
    assert_close(grad, want_grad, 2e-5)


def test_float64_matches_oracle_and_finite_differences():
    # float64 runs on the CPU only: on a machine with a GPU, jax's default device, the test puts
    # its work on the CPU itself.
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        x, y = make((4, 3), 11, jnp.float64, scale=1.0)
        w = jax.random.uniform(jax.random.PRNGKey(3), (11,), minval=0.5, maxval=1.5)
        kw = {
            "weight": w,
            "label_smoothing": 0.25,
            "z_loss": 0.01,
            "softcap": 3.0,
            "ignore_index": 4,
        }
        for reduction in ("mean", "sum", "none"):
            loss, grad = loss_and_grad(x, y, reduction=reduction, **kw)
            want, _, want_grad = oracle(x, y, reduction=reduction, **kw)
            assert loss.dtype == jnp.float64
            assert_close(loss, np.sum(want), 1e-12)
            assert_close(grad, want_grad, 1e-12)
            check_grads(
                lambda x, r=reduction: xj.cross_entropy(x, y, reduction=r, **kw),
                (x,),
                order=1,
                modes=("rev",),
            )


def expect_float64_refused_on_gpu(device, calls):
    """Each of calls(device) (made with x64 on) fails naming float64 as CPU-only; skipped on the
    CPU, where float64 runs, and without the CUDA handlers."""
    if device.platform == "cpu":
        pytest.skip("float64 runs on the CPU (the float64 oracle tests)")
    if not xj.with_cuda:
        pytest.skip("xent.jax was built without its CUDA handlers")
    with jax.enable_x64(True):
        for call in calls(device):
            with pytest.raises(Exception, match="float64, which runs on the CPU only"):
                jax.block_until_ready(call())


def test_float64_on_a_gpu_names_the_cpu(device):
    def calls(device):
        x, y = put(device, *make((4, 3), 11, jnp.float64))
        return (
            lambda: xj.cross_entropy(x, y, reduction="none"),
            lambda: jax.grad(lambda x: xj.cross_entropy(x, y))(x),
        )

    expect_float64_refused_on_gpu(device, calls)


def test_matches_optax(device):
    classes = 50
    x, y = make((2, 8), classes)
    x, y = put(device, x, y)
    # Plain: optax's per-row losses and their mean.
    per_row = optax.softmax_cross_entropy_with_integer_labels(x, y)
    assert_close(xj.cross_entropy(x, y, reduction="none"), per_row, 2e-5)
    g = jax.grad(lambda x: xj.cross_entropy(x, y))(x)
    g_optax = jax.grad(lambda x: optax.softmax_cross_entropy_with_integer_labels(x, y).mean())(x)
    assert_close(g, g_optax, 2e-6)

    # Smoothing, class weights and an ignored label, written out over optax's pieces.
    eps, ignore = 0.1, 7
    w = jax.random.uniform(jax.random.PRNGKey(5), (classes,), minval=0.2, maxval=2.0)
    y = y.at[0, :3].set(ignore)

    def optax_loss(x):
        keep = y != ignore
        yc = jnp.where(keep, y, 0)
        logp = jax.nn.log_softmax(x)
        nll = optax.softmax_cross_entropy_with_integer_labels(x, yc) * w[yc]
        smooth = -(logp * w).sum(-1) / classes
        row = jnp.where(keep, (1 - eps) * nll + eps * smooth, 0.0)
        return row.sum() / jnp.where(keep, w[yc], 0.0).sum()

    def xent_loss(x):
        return xj.cross_entropy(x, y, weight=w, label_smoothing=eps, ignore_index=ignore)

    assert_close(xent_loss(x), optax_loss(x), 2e-5)
    assert_close(jax.grad(xent_loss)(x), jax.grad(optax_loss)(x), 2e-6)

    # Smoothing without weights is optax's smoothed soft-label cross-entropy.
    smoothed = optax.smooth_labels(jax.nn.one_hot(y, classes), eps)
    y_all = jnp.where(y == ignore, 0, y)
    smoothed = optax.smooth_labels(jax.nn.one_hot(y_all, classes), eps)
    assert_close(
        xj.cross_entropy(x, y_all, label_smoothing=eps, reduction="none"),
        optax.softmax_cross_entropy(x, smoothed),
        2e-5,
    )


# --- transformations ----------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_jit_grad_and_value_and_grad(device, reduction):
    x, y = make((6, 4), 33)
    x, y = put(device, x, y)

    def f(x):
        return (2.5 * xj.cross_entropy(x, y, reduction=reduction, label_smoothing=0.1)).sum()

    value, grad = jax.jit(jax.value_and_grad(f))(x)
    want, _, want_grad = oracle(x, y, reduction=reduction, label_smoothing=0.1)
    assert_close(value, 2.5 * np.sum(want), 2e-5 * abs(2.5 * np.sum(want)))
    assert_close(grad, 2.5 * want_grad, 2e-5)
    assert_close(jax.grad(f)(x), grad, 1e-6)
    assert_close(jax.jit(f)(x), value, 1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradient_in_a_buffer_of_its_own(device, reduction):
    x, y = make((6, 4), 33)
    x, y = put(device, x, y)
    kept = np.asarray(x).copy()
    want, _, want_grad = oracle(x, y, reduction=reduction, z_loss=1e-3)
    steps = {}
    for inplace in (True, False):

        def f(x, inplace=inplace):
            return xj.cross_entropy(
                x, y, reduction=reduction, z_loss=1e-3, inplace_backward=inplace
            )

        steps[inplace] = jax.jit(jax.value_and_grad(f))
        value, grad = steps[inplace](x)
        assert_close(value, want, 2e-5 * abs(float(want)))
        assert_close(grad, want_grad, 2e-5)
        np.testing.assert_array_equal(np.asarray(x), kept)  # the caller's logits are intact
    # Only the in-place fused call hands its gradient the logits' buffer (the scale call after it
    # aliases its own operand either way).
    for inplace, step in steps.items():
        calls = [
            line
            for line in step.lower(x).as_text().splitlines()
            if "custom_call @xent_cross_entropy_fwd_bwd" in line
        ]
        assert calls, "no fused call in the lowered step"
        assert all(("output_operand_aliases" in line) == inplace for line in calls)


def test_upstream_gradient_per_row(device):
    x, y = make((5,), 21)
    up = jnp.linspace(-2.0, 3.0, 5)
    x, y, up = put(device, x, y, up)
    grad = jax.grad(lambda x: (up * xj.cross_entropy(x, y, reduction="none", z_loss=0.01)).sum())(x)
    _, _, d = oracle(x, y, reduction="none", z_loss=0.01)
    assert_close(grad, np.asarray(up)[:, None] * d, 2e-5)


def assert_rounded_once(got, want, name, share=1.0):
    """got is want rounded once to float16 (within 0.6 of float16's spacing at want) on `share` of
    the entries, and close everywhere: the linear calls' sums that cancel leave a few entries
    further off. Rounded at upstream 1 and then scaled, entries below float16's normal range are
    thousands of spacings off."""
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all(), name
    spacing = np.spacing(np.abs(want).astype(np.float16)).astype(np.float64)
    assert np.quantile(np.abs(got - want) / spacing, share) <= 0.6, name
    np.testing.assert_allclose(got, want, rtol=8e-3, atol=1e-3 * np.abs(want).max(), err_msg=name)


# A loss scale (jmp's first, 2^15) or a gradient-accumulation factor reaches float16 gradients
# before they are rounded, as in torch: formed at upstream 1 and scaled afterwards, the entries
# p / N below float16's normal range would lose their digits or vanish.
@pytest.mark.parametrize("upstream", [2.0**15, 1 / 3], ids=["scale-2^15", "third"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_float16_gradients_take_the_upstream_before_rounding(device, upstream, reduction):
    rows, classes, dim = 64, 1000, 48
    x, y = make((rows,), classes, jnp.float16)
    k1, k2 = jax.random.split(jax.random.PRNGKey(5))
    h = jax.random.normal(k1, (rows, dim)).astype(jnp.float16)
    wt = (jax.random.normal(k2, (classes, dim)) / 4).astype(jnp.float16)
    y = y.at[3].set(-100)
    if reduction == "sum":  # keeps the sum's gradient inside float16's range
        upstream /= rows
    x, y, h, wt = put(device, x, y, h, wt)

    def ce(x):
        return xj.cross_entropy(x, y, reduction=reduction) * upstream

    def lce(h, wt):
        return xj.linear_cross_entropy(h, wt, y, reduction=reduction) * upstream

    g = float(np.float16(upstream))  # the loss is float16, and so is its gradient
    _, _, d = oracle(x, y, reduction=reduction)
    assert_rounded_once(jax.grad(ce)(x), d * g, "cross_entropy")
    h64, w64 = np.asarray(h, np.float64), np.asarray(wt, np.float64)
    _, _, dz = oracle(h64 @ w64.T, y, reduction=reduction)
    dh, dw = jax.grad(lce, argnums=(0, 1))(h, wt)
    assert_rounded_once(dh, dz @ w64 * g, "linear d_hidden", share=0.999)
    assert_rounded_once(dw, dz.T @ h64 * g, "linear d_weight", share=0.999)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_vmap_matches_a_loop(device, reduction):
    x, y = make((4, 9), 17)
    y = y.at[1, :4].set(-100)
    x, y = put(device, x, y)

    def f(x, y):
        return xj.cross_entropy(x, y, reduction=reduction, softcap=3.0).sum()

    for batched in (jax.vmap(f), jax.jit(jax.vmap(f))):
        assert_close(batched(x, y), [f(x[i], y[i]) for i in range(4)], 1e-6)
    grads = jax.vmap(jax.grad(f))(x, y)
    assert_close(grads, [jax.grad(f)(x[i], y[i]) for i in range(4)], 1e-6)
    # One operand batched, the other shared (the handler broadcasts it; nothing is copied).
    shared = jax.vmap(f, in_axes=(0, None))(x, y[0])
    assert_close(shared, [f(x[i], y[0]) for i in range(4)], 1e-6)
    shared = jax.vmap(jax.grad(f), in_axes=(None, 0))(x[0], y)
    assert_close(shared, [jax.grad(f)(x[0], y[i]) for i in range(4)], 1e-6)
    # Nested, and over a batch axis that is not the first.
    x3 = jnp.stack([x, 2 * x])
    nested = jax.vmap(jax.vmap(f, in_axes=(1, None)), in_axes=(0, None))(
        jnp.swapaxes(x3, 1, 2), y[0]
    )
    want = [[f(x3[a, i], y[0]) for i in range(4)] for a in range(2)]
    assert_close(nested, want, 1e-6)


def test_vmap_with_batched_weights(device):
    classes = 13
    x, y = make((3, 5), classes)
    w = jax.random.uniform(jax.random.PRNGKey(1), (3, classes), minval=0.1, maxval=2.0)
    x, y, w = put(device, x, y, w)

    def f(x, y, w):
        return xj.cross_entropy(x, y, weight=w)

    got = jax.vmap(jax.value_and_grad(f))(x, y, w)
    for i in range(3):
        want, _, want_grad = oracle(x[i], y[i], weight=w[i])
        assert_close(got[0][i], want, 2e-5)
        assert_close(got[1][i], want_grad, 2e-5)


def test_checkpoint(device):
    x, y = make((8,), 40)
    h = jax.random.normal(jax.random.PRNGKey(2), (8, 16))
    wt = jax.random.normal(jax.random.PRNGKey(4), (16, 40))
    x, y, h, wt = put(device, x, y, h, wt)

    def model(wt):
        return xj.cross_entropy(h @ wt, y, z_loss=1e-3)

    def reference(wt):
        logits = h @ wt
        lse = jax.nn.logsumexp(logits, axis=-1)
        return (optax.softmax_cross_entropy_with_integer_labels(logits, y) + 1e-3 * lse**2).mean()

    g = jax.jit(jax.grad(jax.checkpoint(model)))(wt)
    assert_close(g, jax.grad(reference)(wt), 2e-5)
    assert_close(jax.grad(model)(wt), g, 1e-6)


def test_lse_is_outside_the_gradient(device):
    x, y = make((4,), 9)
    x, y = put(device, x, y)
    g = jax.grad(lambda x: xj.cross_entropy(x, y, return_lse=True)[1].sum())(x)
    assert_close(g, np.zeros_like(g), 0)


# --- edge sizes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_one_class(device, reduction):
    x, y = make((5,), 1)
    x, y = put(device, x, y)
    loss, grad = loss_and_grad(x, y, reduction=reduction, label_smoothing=0.3)
    assert_close(loss, 0.0, 1e-6)
    assert_close(grad, np.zeros(grad.shape), 1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_no_rows(device, reduction):
    x, y = put(device, jnp.zeros((0, 7)), jnp.zeros((0,), jnp.int32))
    loss = xj.cross_entropy(x, y, reduction=reduction)
    grad = jax.grad(lambda x: xj.cross_entropy(x, y, reduction=reduction).sum())(x)
    assert grad.shape == (0, 7)
    if reduction == "mean":
        assert math.isnan(float(loss))
    elif reduction == "sum":
        assert float(loss) == 0.0
    else:
        assert loss.shape == (0,)


def test_no_rows_run_where_their_operands_are():
    # Every operand empty (no rows, no class weights): still run on their device, not the default.
    cpu1 = jax.devices("cpu")[1]
    x, y = put(cpu1, jnp.zeros((0, 7)), jnp.zeros((0,), jnp.int32))
    for reduction in ("mean", "sum", "none"):
        assert xj.cross_entropy(x, y, reduction=reduction).devices() == {cpu1}
    grad = jax.grad(lambda x: xj.cross_entropy(x, y, reduction="sum"))(x)
    assert grad.devices() == {cpu1}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_every_row_ignored(device, reduction):
    x, _ = make((2, 3), 8)
    y = jnp.full((2, 3), -100, jnp.int32)
    x, y = put(device, x, y)
    loss, grad = loss_and_grad(x, y, reduction=reduction, z_loss=0.1)
    if reduction == "mean":  # 0 / 0, as PyTorch gives; its gradient rows are all ignored
        assert math.isnan(float(loss))
    else:
        assert float(loss) == 0.0
        assert_close(grad, np.zeros(grad.shape), 0)


def test_single_row_without_leading_dimensions(device):
    x, y = make((), 10)
    x, y = put(device, x, y)
    loss, grad = loss_and_grad(x, y)
    want, _, want_grad = oracle(x, y)
    assert loss.shape == () and grad.shape == (10,)
    assert_close(loss, want, 2e-5)
    assert_close(grad, want_grad, 2e-5)


def test_large_vocabulary(device):
    x, y = make((3,), 50257, scale=4.0)
    x, y = put(device, x, y)
    loss, grad = loss_and_grad(x, y, label_smoothing=0.1)
    want, _, want_grad = oracle(x, y, label_smoothing=0.1)
    assert_close(loss, want, 2e-5 * abs(want))
    assert_close(grad, want_grad, 1e-6)


# --- bad arguments ------------------------------------------------------------------------------


def test_bad_arguments_name_themselves():
    x, y = make((4,), 6)
    cases = [
        (TypeError, "logits", {"logits": x.astype(jnp.int32)}),
        (ValueError, "logits", {"logits": jnp.float32(1.0)}),
        (ValueError, "V = 0", {"logits": jnp.zeros((4, 0))}),
        (TypeError, "labels", {"labels": y.astype(jnp.float32)}),
        (ValueError, "labels", {"labels": y[:3]}),
        (ValueError, "weight", {"weight": jnp.ones(5)}),
        (TypeError, "weight", {"weight": jnp.ones(6, jnp.int32)}),
        (ValueError, "reduction", {"reduction": "avg"}),
        (ValueError, "label_smoothing", {"label_smoothing": 1.5}),
        (ValueError, "label_smoothing", {"label_smoothing": float("nan")}),
        (ValueError, "z_loss", {"z_loss": -1.0}),
        (ValueError, "z_loss", {"z_loss": float("inf")}),
        (ValueError, "z_loss", {"z_loss": 1e39}),  # inf as the float32 the handlers take
        (ValueError, "softcap", {"softcap": -2.0}),
        (ValueError, "softcap", {"softcap": float("inf")}),
        # 0 as a float32 (it turned softcap off) and a denormal whose reciprocal is inf.
        (ValueError, "softcap", {"softcap": 1e-50}),
        (ValueError, "softcap", {"softcap": 1e-40}),
        (TypeError, "ignore_index", {"ignore_index": 1.5}),
        (ValueError, "ignore_index", {"ignore_index": 2**63}),
        # No int32 label can equal it (the sharded calls compare labels with it in int32).
        (ValueError, "ignore_index", {"ignore_index": 2**31}),
        (TypeError, "label_smoothing", {"label_smoothing": jnp.ones(3)}),
        (TypeError, "inplace_backward", {"inplace_backward": 1}),
    ]
    for error, name, change in cases:
        args = {"logits": x, "labels": y}
        args.update({k: change.pop(k) for k in ("logits", "labels") if k in change})
        with pytest.raises(error, match=name):
            xj.cross_entropy(args["logits"], args["labels"], **change)


def test_traced_option_is_a_type_error():
    x, y = make((4,), 6)
    with pytest.raises(TypeError, match="z_loss"):
        jax.jit(lambda x, z: xj.cross_entropy(x, y, z_loss=z))(x, 0.1)


def test_out_of_range_label_is_an_error_on_the_cpu_and_nan_on_the_gpu(device):
    x, y = make((4,), 6)
    if device.platform == "cpu":
        x, y = put(device, x, y.at[2].set(6))
        with pytest.raises(Exception, match="targets"):
            jax.block_until_ready(xj.cross_entropy(x, y))
        return
    # On the GPU the handler cannot report it without a host synchronisation.
    y = y.at[2].set(-5)
    x, y = put(device, x, y)
    losses = xj.cross_entropy(x, y, reduction="none")
    assert math.isnan(float(losses[2]))
    want, _, _ = oracle(x, y.at[2].set(-100), reduction="none")
    assert_close(np.delete(np.asarray(losses), 2), np.delete(want, 2), 2e-5)


def test_handler_checks_name_the_argument(device):
    # The handlers check what reaches them on their own, whoever calls them: here a raw ffi_call
    # on the device's platform, with the CUDA handler's workspace result on a GPU.
    x, y = make((4,), 6)
    f32 = jnp.float32
    attrs = {
        "ignore_index": np.int64(-100),
        "reduction": np.int32(1),
        "label_smoothing": np.float32(0),
        "z_loss": np.float32(0),
        "softcap": np.float32(0),
    }
    results = (jax.ShapeDtypeStruct((), f32), jax.ShapeDtypeStruct((4,), f32))
    if device.platform != "cpu":
        if not xj.with_cuda:
            pytest.skip("xent.jax was built without its CUDA handlers")
        workspace = _ffi.workspace_bytes("cross_entropy", f32, 4)
        results += (jax.ShapeDtypeStruct((workspace,), jnp.uint8),)

    def forward(*args, **changes):
        call = jax.ffi.ffi_call("xent_cross_entropy_fwd", results)
        return jax.block_until_ready(call(*put(device, *args), **{**attrs, **changes}))

    no_weight = jnp.zeros((0,), f32)
    for args, changes, name in [
        ((x, y[:3], no_weight), {}, "labels"),
        ((x, y.astype(jnp.float32), no_weight), {}, "labels"),
        ((x, y, jnp.ones(5, f32)), {}, "weight"),
        ((x.astype(jnp.int32), y, no_weight), {}, "logits"),
        ((x, y, no_weight), {"reduction": np.int32(7)}, "reduction"),
        ((x, y, no_weight), {"label_smoothing": np.float32(2)}, "label_smoothing"),
    ]:
        with pytest.raises(Exception, match=name):
            forward(*args, **changes)
