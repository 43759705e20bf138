"""Writes the fuzzer's seed corpus (tests/fuzz/corpus/): one small input per call and dtype, and
one per call and spoiled argument, so that a short run starts from every path of cpu_fuzz.cpp.

libFuzzer's FuzzedDataProvider takes integers from the end of the input, one byte for a choice
among at most 256, so a seed ends with its choices (last byte first) and begins with bytes from a
fixed generator for the shapes and values. Usage: python3 tests/fuzz/make_corpus.py [DIR]
"""

import pathlib
import random
import sys

CALLS = [
    "forward",
    "forward_backward",
    "backward",
    "linear_forward",
    "linear_fb",
    "linear_backward",
]
DTYPES = ["float", "double", "bf16", "half"]
# The order of cpu_fuzz.cpp's enum spoil, after none.
SPOILS = [
    "ld",
    "negative",
    "class_id",
    "smoothing",
    "z_loss",
    "softcap",
    "weights",
    "reduce",
    "output",
    "soft_shape",
    "num_correct",
    "upstream",
    "lse",
    "grad",
    "bias",
    "workspace",
]


def seed(
    rng: random.Random, call: int, dtype: int, spoil: int | None, extreme: bool
) -> bytes:
    """The bytes that make LLVMFuzzerTestOneInput choose these, after `rng`'s shapes and values."""
    choices = [call, dtype]
    if spoil is None:
        choices.append(0)
    else:
        choices += [1, spoil + 1]
    choices += [0 if extreme else 1, rng.randrange(3)]
    body = bytes(rng.randrange(256) for _ in range(rng.randrange(24, 96)))
    return body + bytes(reversed(choices))


def main() -> None:
    out = pathlib.Path(
        sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent / "corpus"
    )
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(46)
    seeds = {}
    for c, call in enumerate(CALLS):
        for d, dtype in enumerate(DTYPES):
            seeds[f"{call}-{dtype}"] = seed(rng, c, d, None, False)
            seeds[f"{call}-{dtype}-extreme"] = seed(rng, c, d, None, True)
        for s, spoil in enumerate(SPOILS):
            seeds[f"{call}-spoil-{spoil}"] = seed(rng, c, 0, s, False)
    for name, data in seeds.items():
        (out / name).write_bytes(data)
    print(f"{len(seeds)} seeds in {out}")


if __name__ == "__main__":
    main()
