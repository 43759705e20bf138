"""A fused linear training call's choices as both frameworks' bindings take them: the names and
the codes the compiled parts read (csrc/linear_choices.h), and the checks that name a bad one."""

import numbers

ORDERS = {"automatic": 0, "fast": 1, "low_memory": 2}
ACCUMULATIONS = {"fp32": 0, "output": 1}


def choice_code(name, value, codes, who="xent"):
    """The code of a training choice (order, accumulate), or ValueError naming the argument."""
    code = codes.get(value) if isinstance(value, str) else None
    if code is None:
        raise ValueError(
            f"{who}: {name} must be one of {', '.join(repr(k) for k in codes)}, got {value!r}"
        )
    return code


def sparse_threshold(value):
    """A sparse-backward threshold as a float in [0, 1], or ValueError naming the argument. Any
    real number is taken (a NumPy scalar from a config too), a bool is not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value <= 1.0:
        raise ValueError(f"xent: sparse_threshold must be a number in [0, 1], got {value!r}")
    return float(value)
