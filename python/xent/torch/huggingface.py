"""Hugging Face transformers causal LMs trained through xent's fused linear cross-entropy.

    model = AutoModelForCausalLM.from_config(config)
    xent.torch.patch(model)
    loss = model(input_ids, labels=labels).loss   # the N x V logits are never formed

A causal LM's forward computes `logits = lm_head(hidden)` (after slicing hidden by
logits_to_keep), applies the final logit softcapping where the model has one, and hands the
logits to `loss_function(logits, labels, vocab_size, **kwargs)`, which shifts the labels, ignores
-100 and divides a sum by num_items_in_batch when given (gradient accumulation). The patched
forward runs the model's own forward with two stand-ins for a call with labels: the output
embedding keeps its input (the last hidden states) and returns a single 1 (the loss function
checks, at the first call and after the softcapping changes, that the forward's logit ops
changed it only by the softcapping), and the loss function computes the same loss from those
hidden states and the output embedding's weight with xent.torch.linear_cross_entropy, a chunk of
rows at a time, softcap included. Everything else
(the decoder, the label handling the forward does itself, the keyword arguments) is the model's.
The output then has no logits. A call without labels is the unpatched forward, logits and all.
"""

import inspect
import types

import torch
import torch.nn.functional as F

from .ops import _ACCUMULATIONS, _ORDERS, _linear_choice, _linear_loss, _sparse_threshold


def _causal_lm_loss(
    hidden,
    head,
    softcap,
    memory,
    labels,
    num_items_in_batch=None,
    ignore_index=-100,
    shift_labels=None,
):
    """transformers' ForCausalLMLoss on lm_head(hidden) (float32), without forming the logits."""
    if shift_labels is None:
        # Shift so that tokens < n predict n, as ForCausalLMLoss does.
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    h = hidden.reshape(-1, hidden.shape[-1])
    t = shift_labels.reshape(-1).to(h.device)
    if t.shape[0] != h.shape[0]:
        raise ValueError(
            f"Expected input batch_size ({h.shape[0]}) to match target batch_size ({t.shape[0]})."
        )
    reduction = "sum" if num_items_in_batch is not None else "mean"
    # The loss in float32, as transformers computes it from logits upcast to float32.
    loss = _linear_loss(
        h,
        head.weight,
        t,
        getattr(head, "bias", None),
        None,
        ignore_index,
        reduction,
        0.0,
        0.0,
        softcap,
        **memory,
    )
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _checked_probe(logits, probe, softcap):
    """The forward's logits ops ran on `probe` (ones standing in for lm_head's output): only the
    final logit softcapping may have changed it, else the fused loss would not be the model's."""
    want = probe if softcap is None else torch.tanh(probe / softcap) * softcap
    if logits.shape != probe.shape or not torch.allclose(
        logits.float(), want.float(), rtol=1e-2, atol=0.0
    ):
        raise TypeError(
            "xent.torch.patch: the model's forward transforms lm_head's output beyond the "
            "config's final_logit_softcapping (a logit scale such as Cohere's logit_scale or "
            "Granite's logits_scaling), which the fused loss cannot apply: use the unpatched model"
        )


def _fused_forward(self, *args, **kwargs):
    """A patched model's forward (bound to the model, so a deepcopy's forward is the copy's): with
    labels, the model's own forward with lm_head and the loss function stood in for."""
    forward = self._xent_forward
    # Trainer passes labels by name; binding to the signature (tens of microseconds) only finds
    # labels given by position.
    if "labels" in kwargs:
        labels = kwargs["labels"]
    else:
        labels = inspect.signature(forward).bind(*args, **kwargs).arguments.get("labels")
    if labels is None:
        return forward(*args, **kwargs)
    head = self.get_output_embeddings()
    softcap = getattr(self.config, "final_logit_softcapping", None)
    captured = []

    def keep_hidden(hidden):
        captured.append(hidden)
        # What the forward's logit ops then run on (checked in loss_function).
        captured.append(hidden.new_ones((1,) * hidden.dim()))
        return captured[1]

    def loss_function(logits, labels, vocab_size=None, **loss_kwargs):
        hidden, probe = captured
        # Once per model and softcap: the comparison waits for the device.
        if self.__dict__.get("_xent_probed", ()) != (softcap,):
            _checked_probe(logits, probe, softcap)
            self._xent_probed = (softcap,)
        loss_kwargs = {
            k: loss_kwargs[k]
            for k in ("num_items_in_batch", "ignore_index", "shift_labels")
            if k in loss_kwargs
        }
        return _causal_lm_loss(hidden, head, softcap, self._xent_options, labels, **loss_kwargs)

    # Instance attributes, restored afterwards: the module's own forward (or one a hook library
    # installed) and the model's loss function come back unchanged.
    saved_forward = head.__dict__.get("forward")
    saved_loss = self.__dict__.get("_loss_function")
    head.forward = keep_hidden
    self._loss_function = loss_function
    try:
        out = forward(*args, **kwargs)
    finally:
        if saved_forward is None:
            del head.forward
        else:
            head.forward = saved_forward
        if saved_loss is None:
            del self._loss_function
        else:
            self._loss_function = saved_loss
    if isinstance(out, tuple):  # return_dict=False: (loss, logits, ...) without the logits
        return (out[0],) + tuple(out[2:])
    return type(out)(**{k: v for k, v in out.items() if k != "logits"})


def patch(model, *, order="automatic", accumulate="fp32", sparse_threshold=0.0):
    """Makes `model` (a transformers causal LM: Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3,
    Phi-3, GPT-2 and others whose forward is `loss_function(lm_head(hidden), labels, ...)`)
    compute its training loss by fused linear cross-entropy, in place; returns the model.

    With labels, the loss and every gradient are the unpatched model's (within float32
    rounding), output.logits is None and no N x V tensor is allocated (the logits exist a chunk
    of rows at a time inside the op); label shift, ignore_index, num_items_in_batch, shift_labels,
    logits_to_keep and the config's final_logit_softcapping (read at each call) behave as in the
    unpatched model. Without labels (evaluation, generation) the call is the unpatched forward.
    The output embedding must be a torch.nn.Linear with its own forward (a quantised or adapter
    layer is refused: its output is not hidden @ weight.T); a forward that changes the logits
    beyond the softcapping (a logit scale) raises TypeError at its first call with labels. A copy
    (copy.deepcopy) of a patched model is patched and runs its own weights. Patching twice changes
    nothing (the first patch's options stay). order, accumulate and sparse_threshold are
    linear_cross_entropy's training choices (order="low_memory": no V x D float buffer;
    sparse_threshold: the sparse backward), checked here.
    """
    _linear_choice("order", order, _ORDERS)
    _linear_choice("accumulate", accumulate, _ACCUMULATIONS)
    _sparse_threshold(sparse_threshold)
    if getattr(model, "_xent_patched", False):
        return model
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or type(head).forward is not torch.nn.Linear.forward:
        raise TypeError(
            f"xent.torch.patch: {type(model).__name__}'s output embedding is "
            f"{type(head).__name__}, not a torch.nn.Linear computing hidden @ weight.T (+ bias) "
            "to fuse with its loss"
        )
    if "labels" not in inspect.signature(model.forward).parameters:
        raise TypeError(f"xent.torch.patch: {type(model).__name__}.forward takes no labels")
    # The forward being patched (the class's, or one a hook library installed): a bound method,
    # which copy.deepcopy binds to the copy.
    model._xent_forward = model.forward
    model._xent_options = dict(
        order=order, accumulate=accumulate, sparse_threshold=sparse_threshold
    )
    model.forward = types.MethodType(_forward_like(model.forward), model)
    model._xent_patched = True
    return model


def _forward_like(forward):
    """_fused_forward as a function with `forward`'s name, doc and signature (a self before its
    parameters), which inspect reports for the patched model's bound forward (Trainer reads it),
    holding no reference to the model."""

    def fused_forward(self, *args, **kwargs):
        return _fused_forward(self, *args, **kwargs)

    for name in ("__name__", "__qualname__", "__doc__", "__module__"):
        setattr(fused_forward, name, getattr(forward, name, None))
    sig = inspect.signature(forward)
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    fused_forward.__signature__ = sig.replace(parameters=[self_param, *sig.parameters.values()])
    return fused_forward
