"""Hugging Face transformers causal LMs trained through xent's fused linear cross-entropy.

    model = AutoModelForCausalLM.from_config(config)
    xent.torch.patch(model)
    loss = model(input_ids, labels=labels).loss   # the N x V logits are never formed

A causal LM's forward computes `logits = lm_head(hidden)` (after slicing hidden by
logits_to_keep), applies the final logit softcapping where the model has one, and hands the
logits to `loss_function(logits, labels, vocab_size, **kwargs)`, which shifts the labels, ignores
-100 and divides a sum by num_items_in_batch when given (gradient accumulation). The patched
forward runs the model's own forward with two stand-ins for a call with labels: the output
embedding keeps its input (the last hidden states) and returns an empty tensor, and the loss
function computes the same loss from those hidden states and the output embedding's weight with
xent.torch.linear_cross_entropy, a chunk of rows at a time, softcap included. Everything else
(the decoder, the label handling the forward does itself, the keyword arguments) is the model's.
The output then has no logits. A call without labels is the unpatched forward, logits and all.
"""

import functools
import inspect

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


def patch(model, *, order="automatic", accumulate="fp32", sparse_threshold=0.0):
    """Makes `model` (a transformers causal LM: Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3,
    Phi-3, GPT-2 and others whose forward is `loss_function(lm_head(hidden), labels, ...)`)
    compute its training loss by fused linear cross-entropy, in place; returns the model.

    With labels, the loss and every gradient are the unpatched model's (within float32
    rounding), output.logits is None and no N x V tensor is allocated (the logits exist a chunk
    of rows at a time inside the op); label shift, ignore_index, num_items_in_batch, shift_labels,
    logits_to_keep and the config's final_logit_softcapping behave as in the unpatched model.
    Without labels (evaluation, generation) the call is the unpatched forward. The output
    embedding must be a linear layer (a `weight` of (vocab, hidden), optionally a `bias`);
    patching twice changes nothing (the first patch's options stay). order, accumulate and
    sparse_threshold are linear_cross_entropy's training choices (order="low_memory": no V x D
    float buffer; sparse_threshold: the sparse backward), checked here.
    """
    _linear_choice("order", order, _ORDERS)
    _linear_choice("accumulate", accumulate, _ACCUMULATIONS)
    _sparse_threshold(sparse_threshold)
    if getattr(model, "_xent_patched", False):
        return model
    head = model.get_output_embeddings()
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise TypeError(
            f"xent.torch.patch: {type(model).__name__} has no linear output embedding "
            "(get_output_embeddings() with a weight) to fuse with its loss"
        )
    forward = model.forward
    signature = inspect.signature(forward)
    if "labels" not in signature.parameters:
        raise TypeError(f"xent.torch.patch: {type(model).__name__}.forward takes no labels")
    softcap = getattr(model.config, "final_logit_softcapping", None)
    memory = dict(order=order, accumulate=accumulate, sparse_threshold=sparse_threshold)

    @functools.wraps(forward)
    def fused_forward(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("labels") is None:
            return forward(*args, **kwargs)
        captured = []

        def keep_hidden(hidden):
            captured.append(hidden)
            return hidden.new_empty(0)  # what the forward's logit ops then run on

        def loss_function(logits, labels, vocab_size=None, **loss_kwargs):
            (hidden,) = captured
            loss_kwargs = {
                k: loss_kwargs[k]
                for k in ("num_items_in_batch", "ignore_index", "shift_labels")
                if k in loss_kwargs
            }
            return _causal_lm_loss(hidden, head, softcap, memory, labels, **loss_kwargs)

        # Instance attributes, restored afterwards: the module's own forward (or one a hook
        # library installed) and the model's loss function come back unchanged.
        saved_forward = head.__dict__.get("forward")
        saved_loss = model.__dict__.get("_loss_function")
        head.forward = keep_hidden
        model._loss_function = loss_function
        try:
            out = forward(*bound.args, **bound.kwargs)
        finally:
            if saved_forward is None:
                del head.forward
            else:
                head.forward = saved_forward
            if saved_loss is None:
                del model._loss_function
            else:
                model._loss_function = saved_loss
        if isinstance(out, tuple):  # return_dict=False: (loss, logits, ...) without the logits
            return (out[0],) + tuple(out[2:])
        return type(out)(**{k: v for k, v in out.items() if k != "logits"})

    model.forward = fused_forward
    model._xent_patched = True
    return model
