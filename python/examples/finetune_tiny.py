"""Fine-tunes a tiny, randomly initialised causal LM on a text file, its loss by xent.

    python python/examples/finetune_tiny.py                     # the GPL-3 text, GPU if present
    python python/examples/finetune_tiny.py --device cpu --steps 50 --text README.md

The model is a Llama of a few small layers built from a transformers config (nothing is
downloaded), patched by xent.torch.patch: its training loss comes from the last hidden states and
the lm_head weight by fused linear cross-entropy, and the N x V logits are never formed. The text
becomes token ids byte by byte (ids 0..255 of a vocabulary of --vocab entries, a real tokenizer's
size: the logits, and so what the patch saves, grow with it). The script shows a progress bar
(tqdm when installed, a plain one otherwise), writes the loss curve as a PNG (when matplotlib is
installed) and reports the peak memory of one training step (forward and backward) with and
without the patch, measured on the same batch:
  CUDA  torch.cuda.max_memory_allocated (torch's caching allocator), above what was allocated
        before the step;
  CPU   the process's peak resident set (Linux's VmHWM, reset through /proc/self/clear_refs before
        the step), above the resident set before it. glibc's malloc, which torch's CPU allocator
        calls, is told (mallopt) to map every block of 64 KiB or more from the OS and unmap it when
        freed, so the resident set follows the tensors: by default it keeps freed blocks for
        reuse, and a step that reuses them would show no growth.
"""

import argparse
import copy
import ctypes
import ctypes.util
import gc
import re
import sys
import time
from pathlib import Path

import torch
import transformers

import xent.torch


def parse_args(argv):
    default_device = "cuda" if torch.cuda.is_available() and xent.torch.cuda_built() else "cpu"
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3", help="a text file")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--vocab", type=int, default=8192, help="the model's vocabulary size")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--device", default=default_device)
    ap.add_argument("--plot", default="finetune_tiny_loss.png", help="the loss curve's PNG")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def byte_tokens(path, seq):
    """The file's bytes as token ids (int64), enough for one sequence and its next token."""
    data = Path(path).read_bytes()
    if len(data) < seq + 1:
        raise SystemExit(f"{path} has {len(data)} bytes; --seq {seq} needs at least {seq + 1}")
    return torch.tensor(list(data), dtype=torch.int64)


def random_batch(tokens, batch, seq, generator):
    """`batch` windows of `seq` tokens at random offsets (labels are the inputs: the model
    shifts them itself)."""
    starts = torch.randint(0, tokens.numel() - seq, (batch,), generator=generator)
    return torch.stack([tokens[s : s + seq] for s in starts.tolist()])


def tiny_llama(args):
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    return transformers.AutoModelForCausalLM.from_config(config)


def _kib(field):
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", status).group(1)) * 1024


def _glibc():
    """glibc, with large blocks mapped and unmapped one by one (see the top of the file); None
    elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        m_mmap_threshold = -3  # malloc.h
        return libc if libc.mallopt(m_mmap_threshold, 64 * 1024) == 1 else None
    except (OSError, AttributeError, TypeError):
        return None


def step_peak_bytes(model, ids, device):
    """Peak memory of one forward + backward of `model` on `ids` above the memory in use before
    it (see the top of the file for how each device measures it); None where it cannot."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        libc = _glibc()
        if libc is None:
            return None
        libc.malloc_trim(0)  # what malloc still holds goes back to the OS
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        except OSError:
            return None
        before = _kib("VmRSS")
    model(input_ids=ids, labels=ids).loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = _kib("VmHWM")
    model.zero_grad(set_to_none=True)
    return peak - before


def progress(total):
    """tqdm's bar when it is installed, otherwise a line rewritten in place."""
    try:
        from tqdm import tqdm

        return tqdm(total=total, unit="step")
    except ImportError:
        return _PlainBar(total)


class _PlainBar:
    def __init__(self, total):
        self.total, self.n, self.start, self.postfix = total, 0, time.perf_counter(), ""

    def set_postfix_str(self, text):
        self.postfix = text

    def update(self, n=1):
        self.n += n
        width = 30
        done = width * self.n // max(self.total, 1)
        rate = self.n / max(time.perf_counter() - self.start, 1e-9)
        bar = "#" * done + "." * (width - done)
        print(f"\r[{bar}] {self.n}/{self.total} {rate:.1f} step/s {self.postfix}", end="")

    def close(self):
        print()


def plot(losses, path, title):
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss curve written")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"loss curve: {path}")


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    tokens = byte_tokens(args.text, args.seq)
    generator = torch.Generator().manual_seed(args.seed)
    model = tiny_llama(args).to(device)
    print(
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, vocabulary "
        f"{args.vocab}, {args.batch} x {args.seq} tokens a step, on {device}; "
        f"{tokens.numel()} bytes of {args.text}"
    )

    # Peak memory of a training step on one batch, unpatched (a copy) and patched.
    ids = random_batch(tokens, args.batch, args.seq, generator).to(device)
    unpatched = copy.deepcopy(model)
    xent.torch.patch(model)
    peaks = {}
    for name, m in (("unpatched", unpatched), ("xent.torch.patch", model)):
        step_peak_bytes(m, ids, device)  # a first step allocates what every later one reuses
        peaks[name] = step_peak_bytes(m, ids, device)
    del unpatched
    how = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "peak RSS (VmHWM)"
    for name, peak in peaks.items():
        shown = "not measurable here" if peak is None else f"{peak / 2**20:.1f} MiB"
        print(f"peak memory of a training step, {name}: {shown} ({how}, above the step's start)")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    bar = progress(args.steps)
    for _ in range(args.steps):
        ids = random_batch(tokens, args.batch, args.seq, generator).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix_str(f"loss {losses[-1]:.3f}")
        bar.update()
    bar.close()
    print(f"loss: {losses[0]:.3f} at the first step, {losses[-1]:.3f} at the last")
    plot(losses, args.plot, f"tiny Llama on {Path(args.text).name}, loss by xent")
    return 0


if __name__ == "__main__":
    sys.exit(main())
