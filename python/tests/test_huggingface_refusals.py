"""What xent.torch.patch refuses, loudly, where the fused loss would not be the model's: an output
embedding that is not a plain torch.nn.Linear, and forwards that scale lm_head's output (Cohere's
logit_scale, Granite's logits_scaling), which the fused loss never sees.
"""

import pytest
import torch

import xent.torch

transformers = pytest.importorskip("transformers")

V, D = 64, 16
SMALL = dict(
    vocab_size=V,
    hidden_size=D,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=32,
)


def tiny(config_name, class_name, **kw):
    if not hasattr(transformers, class_name):
        pytest.skip(f"this transformers has no {class_name}")
    torch.manual_seed(0)
    return getattr(transformers, class_name)(getattr(transformers, config_name)(**SMALL, **kw))


@pytest.mark.parametrize(
    "config_name, class_name, kw",
    [
        ("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.0625)),
        ("GraniteConfig", "GraniteForCausalLM", dict(logits_scaling=8.0)),
    ],
)
def test_a_forward_that_scales_the_logits_raises(config_name, class_name, kw):
    model = xent.torch.patch(tiny(config_name, class_name, **kw))
    ids = torch.randint(0, V, (2, 8))
    with pytest.raises(TypeError, match="logit scale"):
        model(ids, labels=ids)
    with torch.no_grad():  # without labels, the unpatched forward
        assert model(ids).logits.shape == (2, 8, V)


def test_an_unscaled_granite_trains_as_the_unpatched_model():
    ref = tiny("GraniteConfig", "GraniteForCausalLM", logits_scaling=1.0)
    ids = torch.randint(0, V, (2, 8))
    want = ref(ids, labels=ids).loss
    got = xent.torch.patch(ref)(ids, labels=ids).loss
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


class Scaled(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def test_an_output_embedding_that_is_not_a_plain_linear_is_refused():
    model = tiny("LlamaConfig", "LlamaForCausalLM")
    model.set_output_embeddings(Scaled(D, V, bias=False))
    with pytest.raises(TypeError, match="not a torch.nn.Linear"):
        xent.torch.patch(model)
