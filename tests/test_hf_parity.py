"""The LLaMA and GPT-2 configurations compute exactly what Hugging Face's models compute.

Tiny Hugging Face configs are built in code (nothing is downloaded); the weights of a seeded
GPTModel are copied in through ``models.gpt.hf_mapping.to_hf`` and the logits compared in fp32.
Each model flag an imported model needs is shown to change the computation. ``tools/convert_checkpoint.py
--to-hf`` is checked end to end: ``AutoModelForCausalLM`` on the exported folder gives the logits of
the same checkpoint run at TP2 x PP2 on four real ranks, and ``AutoTokenizer`` the ids of our tokenizer.
``--from-hf`` then ``--to-hf`` gives the Hugging Face files back bit for bit, bad folders get one
error naming the file or field, and ``pretrain_gpt.py --load OUT --finetune --use-checkpoint-args``
trains an imported model with no model flag.
"""

from __future__ import annotations

import pytest
import torch

from models.gpt import GPTModel, gpt2_config, llama_config
from models.gpt.hf_mapping import from_hf, hf_config_kwargs, to_hf
from tests.pipeline_logits import checkpoint_logits

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 16
TOL = 1e-5
ROPE_OFFSET = 3000
"""RoPE cases also run at positions ROPE_OFFSET.. , where Llama-3.1's scaling of the slow frequencies shows."""


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
    "llama3-rope-scaling": (
        lambda: llama_config(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_query_groups=2,
            kv_channels=16,
            ffn_hidden_size=48,
            init_method_std=0.2,
            rotary_base=500000.0,
            rope_scaling=True,
            rope_scaling_factor=8.0,
            layernorm_epsilon=1e-6,
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
        if config.position_embedding_type == "rope":
            positions = positions + ROPE_OFFSET
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


# --------------------------------------------------------------------------------------------------
# Each model flag changes what the model computes
# --------------------------------------------------------------------------------------------------

ROPE_MODEL = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --swiglu --normalization RMSNorm "
    "--position-embedding-type rope --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 "
    "--init-method-std 0.2"
)
RUN = ("--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3")
GPT_MODEL = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --init-method-std 0.2"


def _model_from_flags(argv: str) -> GPTModel:
    from core.transformer.transformer_config import TransformerConfig
    from training.argument_checks import validate_args
    from training.arguments import parse_args, transformer_config_from_args

    args = validate_args(parse_args([*argv.split(), *RUN]), 1)
    return GPTModel(TransformerConfig(**transformer_config_from_args(args)), VOCAB, SEQ).eval()


def _logits_with(argv: str, state: dict) -> torch.Tensor:
    model = _model_from_flags(argv)
    model.load_state_dict(state)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    positions = (torch.arange(SEQ) + ROPE_OFFSET).expand(2, SEQ)
    with torch.no_grad():
        return model(tokens, position_ids=positions if "rope" in argv else None)[..., :VOCAB]


@pytest.mark.parametrize(
    "base, flags",
    [
        (ROPE_MODEL, "--rotary-base 500000"),
        (ROPE_MODEL, "--rotary-percent 0.5"),
        (ROPE_MODEL, "--use-rope-scaling"),
        (ROPE_MODEL + " --use-rope-scaling", "--rope-scaling-factor 32"),
        (ROPE_MODEL, "--norm-epsilon 0.5"),
        (ROPE_MODEL, "--apply-layernorm-1p"),
        (GPT_MODEL, "--openai-gelu"),
        (GPT_MODEL, "--norm-epsilon 0.5"),
    ],
)
def test_each_model_flag_changes_the_logits(base, flags):
    reference = _model_from_flags(base)
    _perturb_norms_and_biases(reference)
    state = reference.state_dict()
    before, after = _logits_with(base, state), _logits_with(f"{base} {flags}", state)
    assert ((after - before).norm() / before.norm()).item() > 1e-4


def test_no_position_embedding_is_megatrons_spelling_of_what_rope_already_does():
    """Megatron accepts --no-position-embedding only with RoPE, whose model has no position table anyway."""
    reference = _model_from_flags(ROPE_MODEL)
    state = reference.state_dict()
    assert torch.equal(
        _logits_with(ROPE_MODEL, state), _logits_with(f"{ROPE_MODEL} --no-position-embedding", state)
    )
    assert reference.embedding.position_embeddings is None


def test_layernorm_1p_stores_gamma_minus_one():
    """--apply-layernorm-1p with weights w - 1 computes what the plain norm computes with w; both start at gamma 1."""
    for base in (ROPE_MODEL, GPT_MODEL):
        plain = _model_from_flags(base)
        _perturb_norms_and_biases(plain)
        state = plain.state_dict()
        shifted = {k: v - 1 if "layernorm.weight" in k else v for k, v in state.items()}
        a, b = _logits_with(base, state), _logits_with(f"{base} --apply-layernorm-1p", shifted)
        assert ((a - b).norm() / a.norm()).item() < 1e-6
        fresh = _model_from_flags(f"{base} --apply-layernorm-1p")
        assert all(
            torch.count_nonzero(p) == 0 for n, p in fresh.named_parameters() if "layernorm.weight" in n
        )


# --------------------------------------------------------------------------------------------------
# tools/convert_checkpoint.py --to-hf: logits of a TP2 x PP2 run, ids of our tokenizer
# --------------------------------------------------------------------------------------------------

EXPORTS = {
    # case: (config, tokenizer type)
    "llama-gqa": (CASES["llama-gqa"][0], "Llama2Tokenizer"),
    "llama3-rope-scaling": (CASES["llama3-rope-scaling"][0], "GPTSentencePieceTokenizer"),
    "gpt2": (CASES["gpt2"][0], "GPT2BPETokenizer"),
}
TEXTS = [
    "Hello world, it's 2024!",
    "  leading spaces\tand\ttabs\n\nnew lines   ",
    "naïve café — ünïcödé ✓ 你好",
    "numbers 1234567 and <s> special </s> strings <|endoftext|>",
    " x",
    "",
]


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    """A SentencePiece BPE model (trained by tools/train_tokenizer.py) and GPT-2 BPE vocab/merges files."""
    from tokenizers import ByteLevelBPETokenizer

    from tests.test_data import make_docs, write_jsonl
    from tools import train_tokenizer

    root = tmp_path_factory.mktemp("tokenizers")
    docs = make_docs(200, seed=3) + TEXTS
    jsonl = write_jsonl(root / "docs.jsonl", docs)
    spm = train_tokenizer.main(["--input", jsonl, "--model-prefix", str(root / "spm"), "--vocab-size", "400"])
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(docs, vocab_size=400, min_frequency=1, special_tokens=["<|endoftext|>"])
    bpe.save_model(str(root))
    return {
        "spm": {"tokenizer_model": str(spm)},
        "bpe": {"vocab_file": str(root / "vocab.json"), "merge_file": str(root / "merges.txt")},
        "docs": docs,
    }


def _write_trident_checkpoint(root, config, vocab: int, tokenizer_type: str, files: dict) -> None:
    """A seeded GPTModel (norms and biases perturbed) written at TP2 x PP2 by the checkpoint writer."""
    from training.checkpoint import Parallelism, gpt_tensor_specs, write_checkpoint

    model = GPTModel(config, vocab, SEQ)
    _perturb_norms_and_biases(model)
    specs, tied = gpt_tensor_specs(config, vocab, SEQ)
    state = model.state_dict()
    tensors = ((n, state[n][: spec.shape[0]]) for n, spec in specs.items())
    write_checkpoint(
        str(root),
        tensors,
        specs=specs,
        tied=tied,
        parallelism=Parallelism(2, 2, 1, "Et|tL"),
        config=config.to_dict(),
        vocab_size=vocab,
        max_sequence_length=SEQ,
        tokenizer_type=tokenizer_type,
        tokenizer_files=files,
    )


def test_export_gives_the_logits_of_a_tp2_pp2_run_and_our_tokenizers_ids(ranks, tmp_path, tokenizer_files):
    from tools import convert_checkpoint
    from training.checkpoint import open_checkpoint
    from training.tokenizer import build_tokenizer

    roots, vocabs = [], {}
    for case, (make, tokenizer_type) in EXPORTS.items():
        files = tokenizer_files["bpe" if tokenizer_type == "GPT2BPETokenizer" else "spm"]
        ours = build_tokenizer(
            tokenizer_type,
            files.get("tokenizer_model"),
            **{k: v for k, v in files.items() if k != "tokenizer_model"},
        )
        vocabs[case] = ours
        config = make()
        _write_trident_checkpoint(tmp_path / case, config, ours.vocab_size, tokenizer_type, files)
        roots.append((str(tmp_path / case), config.position_embedding_type == "rope"))
    tokens = torch.randint(0, 400, (2, SEQ), generator=torch.Generator().manual_seed(1))
    positions = (torch.arange(SEQ) + ROPE_OFFSET).expand(2, SEQ)
    results = ranks(4).run(checkpoint_logits, roots, tokens, positions, timeout=120)
    last = next(r for r in results if r[0] is not None)  # the last stage's first TP rank
    for (case, _), (root, rope), ours_logits in zip(EXPORTS.items(), roots, last):
        out = tmp_path / f"{case}-hf"
        assert convert_checkpoint.main(["--load", root, "--to-hf", str(out), "--quiet"]) == 0
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
        with torch.no_grad():
            theirs = hf(tokens, position_ids=positions if rope else None).logits
        diff = ((ours_logits - theirs).norm() / theirs.norm()).item()
        print(f"{case}: TP2xPP2 vs AutoModelForCausalLM relative logits difference {diff:.2e}")
        assert diff <= TOL
        assert (
            hf.config.rope_parameters["rope_theta"] == open_checkpoint(root).config.rotary_base
            if rope
            else True
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
        ours = vocabs[case]
        for text in TEXTS + tokenizer_files["docs"][:50]:
            assert tokenizer(text).input_ids == ours.tokenize(text), (case, text)
        assert (hf.config.eos_token_id, tokenizer.eos_token_id) == (ours.eod, ours.eod)
