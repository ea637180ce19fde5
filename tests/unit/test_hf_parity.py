"""The LLaMA and GPT-2 configurations compute exactly what Hugging Face's models compute.

Tiny Hugging Face configs are built in code (nothing is downloaded); the weights of a seeded
GPTModel are copied in through ``models.gpt.hf_mapping.to_hf`` and the logits compared in fp32.
Each model flag an imported model needs is shown to change the computation (the export against a
TP2 x PP2 run is in tests/dist/test_hf_parity.py). ``--from-hf`` then ``--to-hf`` gives the Hugging Face files back bit for bit, bad folders get one
error naming the file or field, and ``pretrain_gpt.py --load OUT --finetune --use-checkpoint-args``
trains an imported model with no model flag.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from models.gpt import GPTModel
from models.gpt.hf_mapping import from_hf, hf_config_kwargs, to_hf
from tests.support.bpe import train_byte_level_bpe
from tests.support.hf import (
    CASES,
    ROPE_OFFSET,
    SEQ,
    TOL,
    VOCAB,
    check_config_refused,
    convert,
    gpt2_case,
    llama_case,
    perturb_norms_and_biases,
    random_hf_model,
    safetensors_of,
    write_trident_checkpoint,
)

transformers = pytest.importorskip("transformers")


ONE_PLUS = {  # --apply-layernorm-1p: exported as gamma = 1 + weight
    "llama-gqa-layernorm-1p": (
        lambda: llama_case(layernorm_zero_centered_gamma=True),
        "LlamaForCausalLM",
        "LlamaConfig",
    ),
    "gpt2-layernorm-1p": (
        lambda: gpt2_case(layernorm_zero_centered_gamma=True),
        "GPT2LMHeadModel",
        "GPT2Config",
    ),
}


@pytest.mark.parametrize("case", list(CASES) + list(ONE_PLUS))
def test_logits_match_hugging_face(case):
    make, model_class, config_class = {**CASES, **ONE_PLUS}[case]
    config = make()
    ours = GPTModel(config, VOCAB, SEQ).eval()
    perturb_norms_and_biases(ours)
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
    from training.arguments.checks import validate_args
    from training.arguments.parser import parse_args, transformer_config_from_args

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
        pytest.param(base, flags, id=f"{name} {flags}")
        for name, base, flags in (
            ("llama", ROPE_MODEL, "--rotary-base 500000"),
            ("llama", ROPE_MODEL, "--rotary-percent 0.5"),
            ("llama", ROPE_MODEL, "--use-rope-scaling"),
            ("llama --use-rope-scaling", ROPE_MODEL + " --use-rope-scaling", "--rope-scaling-factor 32"),
            ("llama", ROPE_MODEL, "--norm-epsilon 0.5"),
            ("llama", ROPE_MODEL, "--apply-layernorm-1p"),
            ("gpt", GPT_MODEL, "--openai-gelu"),
            ("gpt", GPT_MODEL, "--norm-epsilon 0.5"),
        )
    ],
)
def test_each_model_flag_changes_the_logits(base, flags):
    reference = _model_from_flags(base)
    perturb_norms_and_biases(reference)
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
        perturb_norms_and_biases(plain)
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


def test_a_null_tokenizer_model_exports_its_end_of_document_id_and_no_text_tokenizer(tmp_path):
    """--vocab-size N: ids 0..N-1 and the end-of-document id N, so VOCAB = N + 1 ids and eos N."""
    from training.checkpoint import open_checkpoint
    from training.hf.exporter import export_to_hf
    from training.hf.tokenizer import TOKENIZER_FILES

    write_trident_checkpoint(tmp_path / "A", CASES["gpt2"][0](), VOCAB, "NullTokenizer", {})
    out = tmp_path / "out"
    summary = export_to_hf(open_checkpoint(str(tmp_path / "A")), str(out))
    eod = VOCAB - 1
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["vocab_size"]) == (None, eod, VOCAB)
    assert json.loads((out / "generation_config.json").read_text()) == {
        "_from_model_config": True,
        "eos_token_id": eod,
    }
    assert transformers.GenerationConfig.from_pretrained(str(out)).eos_token_id == eod
    assert transformers.AutoConfig.from_pretrained(str(out)).eos_token_id == eod
    assert not [name for name in TOKENIZER_FILES if (out / name).exists()]
    assert (
        f"config.json, generation_config.json, no tokenizer files (a NullTokenizer model reads token ids: it has "
        f"no text tokenizer; its end-of-document id {eod} is eos_token_id), in "
    ) in summary.line()


# --------------------------------------------------------------------------------------------------
# tools/convert_checkpoint.py --from-hf: back bit for bit, bad folders, training an imported model
# --------------------------------------------------------------------------------------------------

HF_VOCAB = 300
LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
HF_MODELS = {
    "llama-gqa-scaled": (
        "LlamaConfig",
        {
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 64,
            "rms_norm_eps": 1e-6,
            "rope_theta": 500000.0,
            "rope_scaling": {**LLAMA3, "original_max_position_embeddings": 8192},
            "tie_word_embeddings": False,
        },
    ),
    "llama-tied": (
        "LlamaConfig",
        {
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 64,
            "tie_word_embeddings": True,
        },
    ),
    "gpt2": ("GPT2Config", {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}),
}
ARCHITECTURE_FIELDS = [
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "hidden_act",
    "n_embd",
    "n_layer",
    "n_head",
    "n_inner",
    "n_positions",
    "layer_norm_epsilon",
    "activation_function",
    "bos_token_id",
    "eos_token_id",
]


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory, tokenizer_files):
    """Tiny Hugging Face models with random weights (norms and biases too), saved with a BPE tokenizer;
    the LLaMA with GQA is sharded with an index."""
    root = tmp_path_factory.mktemp("hf")
    bpe = train_byte_level_bpe(tokenizer_files["docs"], HF_VOCAB, min_frequency=2)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>"
    )
    eos = tokenizer.eos_token_id
    folders = {}
    for case, (config_class, fields) in HF_MODELS.items():
        config = getattr(transformers, config_class)(
            vocab_size=HF_VOCAB, bos_token_id=eos, eos_token_id=eos, **fields
        )
        model = random_hf_model(config)
        folder = root / case
        model.save_pretrained(str(folder), max_shard_size="40KB" if case == "llama-gqa-scaled" else "5GB")
        tokenizer.save_pretrained(str(folder))
        folders[case] = folder
    assert (folders["llama-gqa-scaled"] / "model.safetensors.index.json").is_file()
    return folders


@pytest.mark.parametrize("case", list(HF_MODELS))
def test_import_then_export_gives_the_hugging_face_files_back(tmp_path, hf_folders, case):
    folder = hf_folders[case]
    split = ("--target-tensor-parallel-size", 2, "--target-pipeline-model-parallel-size", 2)
    assert convert("--from-hf", folder, "--save", tmp_path / "ckpt", *split) == (0, "")
    shards = ("--max-shard-size", "40KB") if case == "llama-gqa-scaled" else ()
    assert convert("--load", tmp_path / "ckpt", "--to-hf", tmp_path / "out", *shards) == (0, "")
    original, exported = safetensors_of(folder), safetensors_of(tmp_path / "out")
    assert original.keys() == exported.keys()
    assert all(
        torch.equal(original[k], exported[k]) and original[k].dtype == exported[k].dtype for k in original
    )
    if shards:
        index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
        assert sorted(index["weight_map"]) == sorted(original) and len(set(index["weight_map"].values())) > 1
    theirs = transformers.AutoConfig.from_pretrained(str(folder)).to_dict()
    ours = transformers.AutoConfig.from_pretrained(str(tmp_path / "out")).to_dict()
    assert {k: ours.get(k) for k in ARCHITECTURE_FIELDS} == {k: theirs.get(k) for k in ARCHITECTURE_FIELDS}
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()


BAD_CONFIGS = [
    (
        "llama-tied",
        {"model_type": "mistral"},
        "model_type 'mistral' is not supported: Trident imports 'llama', 'gpt2', 'mixtral' and 'qwen2_moe' models",
    ),
    (
        "llama-tied",
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}},
        "rope_parameters.rope_type 'yarn' is not supported: Trident has plain RoPE and Llama-3.1's scaling ('llama3')",
    ),
    (
        "llama-gqa-scaled",
        {"rope_parameters": {**LLAMA3, "original_max_position_embeddings": 4096, "rope_theta": 5e5}},
        (
            "rope_parameters.original_max_position_embeddings 4096 is not supported: Trident's --use-rope-scaling "
            "has Llama-3.1's 8192 (only the factor may change)"
        ),
    ),
    (
        "llama-tied",
        {"attention_bias": True},
        (
            "attention_bias True is not supported: Trident has biases on every linear layer or on none, and "
            "mlp_bias is False"
        ),
    ),
    (
        "llama-tied",
        {"hidden_act": "gelu"},
        "hidden_act 'gelu' is not supported: LLaMA's gated MLP is SwiGLU ('silu')",
    ),
    (
        "gpt2",
        {"tie_word_embeddings": False},
        "tie_word_embeddings False is not supported: Trident's GPT-2 ties the output layer to the word embedding",
    ),
]


@pytest.mark.parametrize("case, change, message", BAD_CONFIGS)
def test_an_unsupported_hugging_face_config_is_one_error_naming_the_field(
    tmp_path, hf_folders, case, change, message
):
    check_config_refused(tmp_path, hf_folders[case], change, message)


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_missing_or_truncated_shard_is_one_error_naming_the_file(tmp_path, hf_folders, damage):
    import shutil

    folder = tmp_path / "hf"
    shutil.copytree(hf_folders["llama-gqa-scaled"], folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / sorted(set(index["weight_map"].values()))[1]
    size = shard.stat().st_size
    if damage == "missing":
        shard.unlink()
        expected = f"{shard} is missing (listed in {folder}/model.safetensors.index.json)"
    else:
        os.truncate(shard, size - 100)
        expected = (
            f"checkpoint file {shard} is truncated or corrupt: its header describes {size} bytes but the file "
            f"has {size - 100}"
        )
    assert convert("--from-hf", folder, "--save", tmp_path / "ckpt") == (1, f"error: {expected}")
    assert not (tmp_path / "ckpt").exists()


def _pretrain(argv: list[str]):
    from tests.support.pretrain_run import pretrain_gpt_in_process
    from training.arguments.parser import parse_args

    args = parse_args(argv)
    return args, pretrain_gpt_in_process(args=args)


def test_pretrain_trains_an_imported_model_with_no_model_flags(tmp_path, hf_folders, capsys):
    """--finetune --use-checkpoint-args: sizes, RoPE theta and scaling, GQA, norm epsilon, the dropout (0)
    and the tokenizer all come from the imported checkpoint; at --lr 0 the weights it saves are the
    Hugging Face ones. The summary's command then continues the run from its checkpoint."""
    import shlex

    from training.checkpoint import open_checkpoint

    assert convert("--from-hf", hf_folders["llama-gqa-scaled"], "--save", tmp_path / "imported")[0] == 0
    argv = (
        f"--load {tmp_path / 'imported'} --finetune --use-checkpoint-args --mock-data --micro-batch-size 2 "
        "--train-iters 2 --lr 0 --eval-iters 0 --log-interval 1 --num-workers 0"
    ).split()
    args, state = _pretrain([*argv, "--save", str(tmp_path / "run")])
    assert state.iteration == 2 and all(
        torch.isfinite(torch.tensor(s["lm loss"])).all() for s in state.losses
    )
    assert (args.rotary_base, args.rope_scaling, args.rope_scaling_factor) == (500000.0, True, 32.0)
    assert (args.num_layers, args.num_query_groups, args.layernorm_epsilon) == (2, 2, 1e-6)
    assert (args.tokenizer_type, args.seq_length) == ("HuggingFaceTokenizer", 64)
    assert (args.hidden_dropout, args.attention_dropout) == (0.0, 0.0)
    imported, trained = open_checkpoint(str(tmp_path / "imported")), open_checkpoint(str(tmp_path / "run"))
    assert trained.iteration == 2
    assert all(torch.equal(t, trained.full_tensor(n)) for n, t in imported.iter_full_tensors())
    out = capsys.readouterr().out
    assert re.search(r"iteration +2/ +2 \|", out)
    assert "--hidden-dropout 0.0 --attention-dropout 0.0" in next(
        line for line in out.splitlines() if line.startswith("--use-checkpoint-args: ")
    )
    # The first loss is the model's own: no dropout, as with the flags set to 0 by hand.
    _, no_dropout = _pretrain([*argv, "--hidden-dropout", "0", "--attention-dropout", "0"])
    assert state.losses[0]["lm loss"] == no_dropout.losses[0]["lm loss"]
    # Train longer as the summary says (flags only: pretrain() was given them directly): no --finetune,
    # one --train-iters, from iteration 2 of the run's own checkpoint.
    command = shlex.split(re.search(r"^  train longer: (.*)$", out, re.MULTILINE).group(1))
    assert command.count("--train-iters") == 1 and "--finetune" not in command
    capsys.readouterr()
    args, state = _pretrain(command[1:])
    assert (state.iteration, [s["lm loss"] > 0 for s in state.losses]) == (4, [True, True])
    assert f"loaded checkpoint {tmp_path / 'run'} at iteration 2" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--load", "A", "--to-hf", "B", "--save", "C"],
            "--to-hf OUT exports the checkpoint --load DIR [--iteration N]; it takes no --save or --target-* flag",
        ),
        (
            ["--from-hf", "A", "--load", "B", "--save", "C"],
            "--from-hf DIR imports into --save OUT; it takes no --load or --iteration",
        ),
        (
            ["--to-hf", "A", "--from-hf", "B"],
            "--to-hf and --from-hf exclude each other: convert one way per run",
        ),
        (
            ["--load", "A", "--save", "B"],
            (
                "resharding needs --target-tensor-parallel-size, --target-pipeline-model-parallel-size (or --to-hf "
                "OUT / --from-hf DIR for Hugging Face)"
            ),
        ),
        (
            ["--load", "A", "--to-hf", "B", "--max-shard-size", "5 parsecs"],
            "--max-shard-size '5 parsecs' is not a size such as 5GB, 500MB or 1000000",
        ),
    ],
)
def test_convert_checkpoint_says_which_flags_each_direction_takes(tmp_path, argv, message):
    write_trident_checkpoint(tmp_path / "A", CASES["gpt2"][0](), VOCAB, "NullTokenizer", {})
    assert convert(*(tmp_path / a if a in ("A", "B", "C") else a for a in argv)) == (1, f"error: {message}")
    assert not (tmp_path / "B").exists() and not (tmp_path / "C").exists()
