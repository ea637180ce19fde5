"""The LLaMA and GPT-2 configurations compute exactly what Hugging Face's models compute.

Tiny Hugging Face configs are built in code (nothing is downloaded); the weights of a seeded
GPTModel are copied in through ``models.gpt.hf_mapping.to_hf`` and the logits compared in fp32.
"""

from __future__ import annotations

import pytest
import torch

from models.gpt import GPTModel, gpt2_config, llama_config
from models.gpt.hf_mapping import from_hf, hf_config_kwargs, to_hf

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 16
TOL = 1e-5


def _perturb_norms_and_biases(model: GPTModel) -> None:
    """Norm weights start at one and biases at zero; make them matter before comparing."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)


CASES = {
    "llama-gqa": (
        lambda: llama_config(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_query_groups=2,
            ffn_hidden_size=48,
            init_method_std=0.2,
            rotary_base=500000.0,
        ),
        "LlamaForCausalLM",
        "LlamaConfig",
    ),
    "llama-mqa-tied": (
        lambda: llama_config(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_query_groups=1,
            ffn_hidden_size=48,
            init_method_std=0.2,
            kv_channels=16,
            untie_embeddings_and_output_weights=False,
        ),
        "LlamaForCausalLM",
        "LlamaConfig",
    ),
    "gpt2": (
        lambda: gpt2_config(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            init_method_std=0.2,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        ),
        "GPT2LMHeadModel",
        "GPT2Config",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hugging_face(case):
    make, model_class, config_class = CASES[case]
    config = make()
    ours = GPTModel(config, VOCAB, SEQ).eval()
    _perturb_norms_and_biases(ours)
    hf_config = getattr(transformers, config_class)(
        **hf_config_kwargs(config, VOCAB, SEQ),
        bos_token_id=None,
        eos_token_id=None,
        attn_implementation="eager",
    )
    theirs = getattr(transformers, model_class)(hf_config).eval()
    missing, unexpected = theirs.load_state_dict(to_hf(ours.state_dict(), config, VOCAB), strict=False)
    assert not missing and not unexpected, (missing, unexpected)

    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(tokens).logits
        logits = ours(tokens)[..., :VOCAB]
        positions = torch.arange(SEQ).flip(0).expand(2, SEQ).contiguous()  # explicit position ids too
        expected_pos = theirs(tokens, position_ids=positions).logits
        logits_pos = ours(tokens, position_ids=positions)[..., :VOCAB]
    for a, b in ((logits, expected), (logits_pos, expected_pos)):
        diff = ((a - b).norm() / b.norm()).item()
        print(f"{case}: relative logits difference {diff:.2e}")
        assert diff <= TOL


@pytest.mark.parametrize("case", list(CASES))
def test_from_hf_inverts_to_hf(case):
    config = CASES[case][0]()
    ours = GPTModel(config, VOCAB, SEQ)
    state = ours.state_dict()
    back = from_hf(to_hf(state, config, VOCAB), config, VOCAB)
    assert back.keys() == state.keys()
    for name, value in state.items():
        assert torch.equal(back[name], value), name
