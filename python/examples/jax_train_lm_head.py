"""Train a small word-level language model with optax and xent.jax, on a text the OS ships.

    python python/examples/jax_train_lm_head.py [--steps 300] [--loss linear|logits] [--out DIR]

The model predicts each word from the CONTEXT words before it: their embeddings, concatenated,
go through one tanh layer to a hidden state h, and the LM head (V x D, as torch.nn.Linear holds
it) scores the vocabulary. The loss is xent.jax.linear_cross_entropy(h, head, labels, bias),
which never forms the batch's logits; --loss logits computes them (h @ head.T + bias) and calls
xent.jax.cross_entropy instead, for the same loss. The text is GPL-3 from
/usr/share/common-licenses (--text for another file). It writes the loss curve to
DIR/jax_lm_head_loss.png (matplotlib, where installed) and always DIR/jax_lm_head_loss.csv, and
prints the final loss and how long the steps took.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import xent.jax as xj

CONTEXT = 4  # words of context per prediction
TEXT = Path("/usr/share/common-licenses/GPL-3")


def load_words(path: Path, min_count: int):
    """The text as word ids: lower-cased words and punctuation marks; words seen fewer than
    min_count times share the id 0 (<unk>). Returns (ids, vocabulary)."""
    words = re.findall(r"[a-z0-9']+|[^\sa-z0-9']", path.read_text(encoding="utf-8").lower())
    counts = collections.Counter(words)
    vocab = ["<unk>"] + sorted(w for w, c in counts.items() if c >= min_count)
    index = {w: i for i, w in enumerate(vocab)}
    return np.array([index.get(w, 0) for w in words], np.int32), vocab


def init_params(key, vocab: int, embed: int, hidden: int):
    k1, k2, k3 = jax.random.split(key, 3)
    fan_in = CONTEXT * embed
    return {
        "embed": jax.random.normal(k1, (vocab, embed)) * 0.1,
        "w1": jax.random.normal(k2, (fan_in, hidden)) / np.sqrt(fan_in),
        "b1": jnp.zeros((hidden,)),
        "head": jax.random.normal(k3, (vocab, hidden)) / np.sqrt(hidden),
        "bias": jnp.zeros((vocab,)),
    }


def hidden_state(params, context):
    """(B, CONTEXT) word ids -> (B, hidden)."""
    e = params["embed"][context].reshape(context.shape[0], -1)
    return jnp.tanh(e @ params["w1"] + params["b1"])


def loss_fn(params, context, labels, fused: bool):
    h = hidden_state(params, context)
    if fused:
        return xj.linear_cross_entropy(h, params["head"], labels, params["bias"])
    return xj.cross_entropy(h @ params["head"].T + params["bias"], labels)


def batches(ids: np.ndarray, batch: int, seed: int):
    """Random (context, next word) batches from the text, forever."""
    rng = np.random.default_rng(seed)
    windows = np.lib.stride_tricks.sliding_window_view(ids, CONTEXT + 1)
    while True:
        rows = windows[rng.integers(0, len(windows), batch)]
        yield jnp.asarray(rows[:, :CONTEXT]), jnp.asarray(rows[:, CONTEXT])


def train(
    steps: int = 300,
    *,
    batch: int = 256,
    embed: int = 32,
    hidden: int = 256,
    lr: float = 3e-3,
    fused: bool = True,
    text: Path = TEXT,
    min_count: int = 2,
    seed: int = 0,
):
    """Trains the model; returns (losses per step, vocabulary size)."""
    ids, vocab = load_words(text, min_count)
    params = init_params(jax.random.key(seed), len(vocab), embed, hidden)
    opt = optax.adam(lr)
    state = opt.init(params)

    @jax.jit
    def step(params, state, context, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, context, labels, fused)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    data = batches(ids, batch, seed)
    for _ in range(steps):
        params, state, loss = step(params, state, *next(data))
        losses.append(float(loss))
    return losses, len(vocab)


def write_curve(losses, out: Path) -> list[Path]:
    """The loss per step as CSV, and as a PNG where matplotlib is installed."""
    out.mkdir(parents=True, exist_ok=True)
    csv = out / "jax_lm_head_loss.csv"
    csv.write_text("step,loss\n" + "".join(f"{i},{v:.6f}\n" for i, v in enumerate(losses)))
    written = [csv]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: the loss curve is in the CSV only")
        return written
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / word)")
    ax.set_title("LM head trained with xent.jax")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    png = out / "jax_lm_head_loss.png"
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return written + [png]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--loss", choices=("linear", "logits"), default="linear")
    ap.add_argument("--text", type=Path, default=TEXT)
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    if not args.text.exists():
        ap.error(f"{args.text} does not exist; pass --text FILE (any plain-text file)")
    start = time.perf_counter()
    losses, vocab = train(args.steps, batch=args.batch, fused=args.loss == "linear", text=args.text)
    seconds = time.perf_counter() - start
    for path in write_curve(losses, args.out):
        print(f"wrote {path}")
    tail = losses[-10:]
    print(
        f"vocabulary {vocab} words, {args.steps} steps of {args.batch} in {seconds:.1f} s: "
        f"loss {losses[0]:.3f} at the first step, {sum(tail) / len(tail):.3f} over the last "
        f"{len(tail)} (log V = {np.log(vocab):.3f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
