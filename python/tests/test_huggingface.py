"""xent.torch.patch on every causal-LM family the installed transformers has among Llama,
Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3 and GPT-2: tiny random configs on the CPU in
float32, the patched model against an unpatched copy (the same weights): loss and every
parameter's gradient, 20 optimizer steps, gradient accumulation (num_items_in_batch), calls
without labels (logits, logits_to_keep), tuple outputs, no N x V tensor in the patched training
step (every op's output seen by a dispatch mode), a deepcopy of a patched model and the
softcapping changed after patching.
"""

import copy
import inspect
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import xent.torch

transformers = pytest.importorskip("transformers")

V = 1000  # vocabulary: N x V (rows x vocab) is larger than any other tensor of these models
B, T = 2, 24
D = 32
SMALL = dict(
    vocab_size=V,
    hidden_size=D,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", SMALL),
    "mistral": ("MistralConfig", "MistralForCausalLM", SMALL),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", SMALL),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(SMALL, head_dim=8)),
    # Gemma 2 and 3 soft-cap their final logits (30.0 by default; 2.0 here, so it bites).
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(SMALL, head_dim=8, final_logit_softcapping=2.0),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(SMALL, head_dim=8, final_logit_softcapping=2.0),
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(SMALL, pad_token_id=0)),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(vocab_size=V, n_embd=D, n_layer=2, n_head=4, n_positions=64),
    ),
}
AVAILABLE = [f for f, (cfg, cls, _) in FAMILIES.items() if hasattr(transformers, cls)]


def make_pair(family, seed=0):
    """An unpatched model and a patched copy with the same weights, in training mode."""
    config_name, class_name, kw = FAMILIES[family]
    config = getattr(transformers, config_name)(**kw)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    ref = getattr(transformers, class_name)(config).float().train()
    # No dropout, so the two models see the same function.
    for m in ref.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    mine = xent.torch.patch(copy.deepcopy(ref))
    return ref, mine


def batch(seed=1, ignore=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    labels = ids.clone()
    if ignore:
        labels[0, :5] = -100  # a prompt not trained on
        labels[1, -3:] = -100  # padding
    return ids, labels


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(ref, mine):
    g_ref, g_mine = grads(ref), grads(mine)
    assert g_ref.keys() == g_mine.keys() and g_ref
    for name in g_ref:
        torch.testing.assert_close(g_mine[name], g_ref[name], rtol=1e-5, atol=1e-7, msg=name)


pytestmark = pytest.mark.parametrize("family", AVAILABLE)


def test_every_family_is_covered(family):
    # The transformers 5.x installed by CI has all eight.
    assert AVAILABLE == list(FAMILIES)


def test_loss_and_every_gradient_match_the_unpatched_model(family):
    ref, mine = make_pair(family)
    ids, labels = batch()
    out_ref = ref(ids, labels=labels)
    out = mine(ids, labels=labels)
    assert out.logits is None and out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-5, atol=0)
    out_ref.loss.backward()
    out.loss.backward()
    assert_same_grads(ref, mine)


def test_labels_given_by_position(family):
    ref, mine = make_pair(family)
    ids, labels = batch()
    params = inspect.signature(ref.forward).parameters
    if params["labels"].kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
        pytest.skip(f"{family}'s forward takes labels by name only")
    before = list(params.values())[1 : list(params).index("labels")]
    args = [ids, *(p.default for p in before), labels]
    out = mine(*args)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref(ids, labels=labels).loss, rtol=1e-5, atol=0)


def test_twenty_optimizer_steps_give_the_same_losses(family):
    ref, mine = make_pair(family)
    losses = []
    for model in (ref, mine):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run = []
        for step in range(20):
            ids, labels = batch(seed=step % 2)  # two batches to learn by heart
            loss = model(ids, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        losses.append(run)
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), rtol=1e-5, atol=0)
    assert losses[0][-1] < losses[0][0]  # it trained


def test_gradient_accumulation_with_num_items_in_batch(family):
    ref, mine = make_pair(family)
    micro = [batch(seed=s) for s in (3, 4)]
    # As transformers' Trainer counts it: the shifted labels not ignored, over every micro-batch.
    items = sum((labels[..., 1:] != -100).sum() for _, labels in micro)
    for model in (ref, mine):
        for ids, labels in micro:
            model(ids, labels=labels, num_items_in_batch=items).loss.backward()
    assert_same_grads(ref, mine)


def test_without_labels_the_logits_are_the_unpatched_models(family):
    ref, mine = make_pair(family)
    ids, _ = batch()
    with torch.no_grad():
        out_ref, out = ref(ids), mine(ids)
        assert out.loss is None
        torch.testing.assert_close(out.logits, out_ref.logits, rtol=0, atol=0)
        kept_ref, kept = ref(ids, logits_to_keep=3), mine(ids, logits_to_keep=3)
        assert kept.logits.shape == (B, 3, V)
        torch.testing.assert_close(kept.logits, kept_ref.logits, rtol=0, atol=0)


def test_shift_labels_and_tuple_outputs(family):
    ref, mine = make_pair(family)
    ids, labels = batch()
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    # shift_labels given: the labels are taken as already shifted.
    out_ref = ref(ids, labels=labels, shift_labels=shifted)
    out = mine(ids, labels=labels, shift_labels=shifted)
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-5, atol=0)
    loss, *rest = mine(ids, labels=labels, return_dict=False)
    ref_loss, ref_logits, *ref_rest = ref(ids, labels=labels, return_dict=False)
    assert ref_logits.shape == (B, T, V) and len(rest) == len(ref_rest)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)


class LargestOutputs(TorchDispatchMode):
    """Records every op output whose last dimension is the vocabulary and that has at least
    `rows` rows: the logits or anything of their size."""

    def __init__(self, rows):
        super().__init__()
        self.rows, self.seen = rows, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == V:
                if t.numel() >= self.rows * V:
                    self.seen.append((str(func), tuple(t.shape)))
        return out


def test_the_patched_training_step_forms_no_n_by_v_tensor(family):
    ref, mine = make_pair(family)
    ids, labels = batch()
    with LargestOutputs(B * T) as mode:
        ref(ids, labels=labels).loss.backward()
    assert mode.seen  # the check sees the unpatched model's logits
    with LargestOutputs(B * T) as mode:
        mine(ids, labels=labels).loss.backward()
    assert mode.seen == []


def test_patching_twice_and_generation(family):
    ref, mine = make_pair(family)
    assert xent.torch.patch(mine) is mine
    ids, _ = batch()
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(mine.generate(ids[:, :8], **kw), ref.generate(ids[:, :8], **kw))


def test_a_copy_of_a_patched_model_runs_its_own_weights(family):
    ref, mine = make_pair(family)
    ids, labels = batch()
    clone = copy.deepcopy(mine)
    assert inspect.signature(clone.forward) == inspect.signature(ref.forward)
    with torch.no_grad():
        for p in clone.parameters():
            p.zero_()
    loss = clone(ids, labels=labels).loss
    # Every logit 0: the uniform distribution's loss, whatever the original's weights.
    torch.testing.assert_close(loss, torch.tensor(math.log(V)), rtol=1e-6, atol=0)
    loss.backward()
    assert not grads(mine) and grads(clone)
    torch.testing.assert_close(mine(ids, labels=labels).loss, ref(ids, labels=labels).loss)


def test_the_softcapping_is_read_at_each_call(family):
    ref, mine = make_pair(family)
    if getattr(ref.config, "final_logit_softcapping", None) is None:
        pytest.skip("no final logit softcapping in this family")
    ids, labels = batch()
    for cap in (None, 0.5):
        ref.config.final_logit_softcapping = cap
        mine.config.final_logit_softcapping = cap
        torch.testing.assert_close(
            mine(ids, labels=labels).loss, ref(ids, labels=labels).loss, rtol=1e-5, atol=0
        )
