"""GPTModel in one process: the layout places global layer numbers, stage flags agree with it, tied
chunks on one rank share one parameter, vocabulary padding leaves the loss alone. Every split on
real ranks against the single-device model: tests/dist/test_gpt_model.py."""

from __future__ import annotations

import pytest
import torch

from models.gpt import GPTModel, gpt_provider, parallelize_gpt, pipeline_layout
from tests.support.gpt_model import MBS, SEQ, VOCAB, WORD_EMBEDDINGS, make_batches, make_config, rel
from tests.support.pipeline_toy import reference_loss_and_grads


def test_vocab_padding_does_not_change_the_loss():
    batches = make_batches(2)
    unpadded = GPTModel(make_config("llama", make_vocab_size_divisible_by=1), VOCAB, SEQ)
    padded = GPTModel(make_config("llama", make_vocab_size_divisible_by=128), VOCAB, SEQ)
    assert unpadded.padded_vocab_size == VOCAB and padded.padded_vocab_size == 128
    with torch.no_grad():  # whatever the padding rows hold, they must not matter
        for name in (WORD_EMBEDDINGS, "output_layer.weight"):
            dict(padded.named_parameters())[name][VOCAB:].normal_(0.0, 10.0)
    loss_a, grads_a = reference_loss_and_grads(unpadded, batches, per_token=True)
    loss_b, grads_b = reference_loss_and_grads(padded, batches, per_token=True)
    assert abs(loss_a - loss_b) <= 1e-6 * loss_a
    print(f"vocab padding: relative loss difference {abs(loss_a - loss_b).item() / loss_a.item():.2e}")
    for name, grad in grads_a.items():
        assert rel(grads_b[name][: grad.shape[0]], grad) <= 1e-6, name
        assert not grads_b[name][grad.shape[0] :].any(), f"{name}: padding rows got a gradient"
    logits = padded(batches[0][0])
    assert logits.shape == (MBS, SEQ, 128) and torch.isneginf(logits[..., VOCAB:]).all()


def test_stage_flags_must_agree_with_the_layout():
    config = make_config("gpt", pipeline_model_parallel_size=2)
    with pytest.raises(ValueError) as err:
        GPTModel(config, VOCAB, SEQ, pre_process=True, post_process=True)
    assert str(err.value) == (
        "GPTModel(post_process=True) disagrees with the pipeline layout: stage (pp_rank 0, "
        "vp_stage None) does not hold the loss; pass post_process=False or use "
        "parallelize_gpt"
    )
    config = make_config("gpt", pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=2)
    with pytest.raises(ValueError) as err:
        GPTModel(config, VOCAB, SEQ)
    assert str(err.value) == (
        "GPTModel(vp_stage=None) on pipeline rank 0: vpp_rank is required: the layout has 2 "
        "virtual stages per rank"
    )
    config = make_config(
        "gpt",
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        pipeline_model_parallel_layout="|Et|tttL|",
    )
    with pytest.raises(ValueError) as err:
        GPTModel(config, VOCAB, SEQ, pre_process=False, post_process=False, vp_stage=0)
    assert str(err.value) == (
        "tied embeddings need the embedding on the first pipeline rank and the loss on the last "
        "(the embedding group keeps them in sync), but the layout puts them on ranks (1, 0); "
        "fix the pipeline layout or set untie_embeddings_and_output_weights=True"
    )


def test_layout_string_places_global_layer_numbers():
    config = make_config(
        "llama",
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=2,
        pipeline_model_parallel_layout="Ettt|tL",
    )
    first, last = parallelize_gpt(gpt_provider(config, VOCAB, SEQ), layout=pipeline_layout(config)).modules
    assert list(first.decoder.layers) == ["0", "1", "2"] and list(last.decoder.layers) == ["3"]
    assert (first.pre_process, first.post_process, last.pre_process, last.post_process) == (
        True,
        False,
        False,
        True,
    )
    whole = GPTModel(make_config("llama"), VOCAB, SEQ)
    for name, p in [*first.named_parameters(), *last.named_parameters()]:
        assert torch.equal(p, dict(whole.named_parameters())[name]), name


def test_tied_chunks_on_one_rank_share_one_parameter():
    config = make_config("gpt", virtual_pipeline_model_parallel_size=2)
    first, last = parallelize_gpt(gpt_provider(config, VOCAB, SEQ), layout=pipeline_layout(config)).modules
    assert last.output_layer.weight is None and "output_layer.weight" not in dict(last.named_parameters())
    assert last.shared_embedding_or_output_weight() is first.embedding.word_embeddings.weight
    with pytest.raises(
        ValueError, match="tied embeddings: the embedding is in an earlier chunk of this rank"
    ):
        GPTModel(config, VOCAB, SEQ, pre_process=False, post_process=True, vp_stage=1)
