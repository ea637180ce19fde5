"""Mixtral and Qwen2-MoE: our MoE models compute what Hugging Face's compute, both ways, and generate alike.

Tiny configs are built in code (nothing is downloaded). Export: our weights through ``to_hf`` into a
folder (Hub names, what ``save_pretrained`` writes) that ``from_pretrained`` loads; import: a Hugging
Face model's own state dict through ``from_hf``. Logits are compared in fp32, the router included.
``tools/convert_checkpoint.py --from-hf`` at EP 2 then ``--to-hf`` gives the files back bit for bit,
a config we cannot represent is one error naming the field, and ``tools/generate.py`` greedy decoding
equals ``generate()`` for 32 tokens.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from models.gpt import GPTModel, llama_config
from models.gpt.hf_mapping import from_hf, to_hf
from tests.e2e.test_generate import (  # noqa: F401 (spm: fixture)
    NEW_TOKENS,
    PROMPT,
    _hf_generate,
    _write,
    generate_tool_json,
    spm,
)
from tests.support.hf import (
    check_config_refused,
    convert,
    perturb_norms_and_biases,
    random_hf_model,
    safetensors_of,
)
from training.hf.config import hf_config_json, transformer_config_from_hf

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, TOL = 64, 16, 1e-5
COMMON = {"hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2, "init_method_std": 0.2}
CASES = {
    "mixtral": ({"num_layers": 2, "ffn_hidden_size": 24, "num_moe_experts": 4}, "MixtralForCausalLM"),
    "qwen2_moe": (  # softmax over all experts, a dense layer between MoE ones, q/k/v biases, gated shared expert
        {
            "num_layers": 3,
            "ffn_hidden_size": 40,
            "num_moe_experts": 4,
            "moe_ffn_hidden_size": 16,
            "moe_shared_expert_intermediate_size": 24,
            "moe_shared_expert_gate": True,
            "moe_router_pre_softmax": True,
            "add_qkv_bias": True,
            "moe_layer_freq": [1, 0, 1],
        },
        "Qwen2MoeForCausalLM",
    ),
    "qwen2_moe-norm-topk": (
        {
            "num_layers": 2,
            "ffn_hidden_size": 40,
            "num_moe_experts": 4,
            "moe_ffn_hidden_size": 16,
            "moe_shared_expert_intermediate_size": 24,
            "moe_shared_expert_gate": True,
            "add_qkv_bias": True,
        },
        "Qwen2MoeForCausalLM",
    ),
}


def _config(case: str, **overrides):
    return llama_config(**COMMON, **CASES[case][0], moe_router_topk=2, **overrides)


def _export(model: GPTModel, config, folder) -> None:
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in to_hf(model.state_dict(), config, VOCAB).items()}
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(hf_config_json(config, VOCAB, SEQ, dtype=torch.float32), fh)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hugging_face_both_ways(case, tmp_path):
    config = _config(case)
    ours = GPTModel(config, VOCAB, SEQ).eval()
    perturb_norms_and_biases(ours)
    _export(ours, config, tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager")
    assert type(theirs).__name__ == CASES[case][1]
    imported = GPTModel(config, VOCAB, SEQ).eval()
    imported.load_state_dict(from_hf(theirs.state_dict(), config, VOCAB))  # transformers' own layout
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs.eval()(tokens).logits
        exported, back = ours(tokens)[..., :VOCAB], imported(tokens)[..., :VOCAB]
    print(f"{case}: relative logits difference export {_relative(exported, expected):.1e}")
    assert _relative(exported, expected) <= TOL and _relative(back, expected) <= TOL
    back_config = transformer_config_from_hf(json.loads((tmp_path / "config.json").read_text()))[0]
    assert _architecture(back_config) == _architecture(config)


def _architecture(config) -> dict:
    """What the model computes: shapes, layer pattern, routing (not initialisation or training knobs)."""
    names = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
             "kv_channels", "add_qkv_bias", "num_moe_experts", "moe_router_topk", "moe_router_pre_softmax",
             "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "expert_ffn_hidden_size",
             "untie_embeddings_and_output_weights", "rotary_base", "layernorm_epsilon")  # fmt: skip
    return {name: getattr(config, name) for name in names} | {
        "pattern": config.moe_layer_pattern(config.num_layers)
    }


def test_qwen2_moe_sparse_step_and_dense_layers_become_a_layer_pattern():
    hf = json.loads(json.dumps(hf_config_json(_config("qwen2_moe"), VOCAB, SEQ, dtype=torch.float32)))
    hf |= {"num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    config, _, _ = transformer_config_from_hf(hf)
    assert config.moe_layer_pattern(6) == [False, True, False, False, False, True]


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """A tiny Mixtral and Qwen2-MoE with random weights, saved by ``save_pretrained`` (Hub names)."""
    folders = {}
    for case in ("mixtral", "qwen2_moe"):
        config = _config(case)
        kwargs = hf_config_json(config, VOCAB, SEQ, dtype=torch.float32)
        model = random_hf_model(transformers.AutoConfig.for_model(**kwargs))
        folders[case] = tmp_path_factory.mktemp(case)
        model.save_pretrained(str(folders[case]))
    return folders


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe"])
def test_import_at_ep2_then_export_gives_the_hugging_face_files_back(tmp_path, hf_folders, case):
    folder = hf_folders[case]
    split = ("--target-tensor-parallel-size", 1, "--target-pipeline-model-parallel-size", 2)
    split += ("--target-expert-model-parallel-size", 2)
    assert convert("--from-hf", folder, "--save", tmp_path / "ckpt", *split) == (0, "")
    manifest = json.loads((tmp_path / "ckpt" / "iter_0000000" / "manifest.json").read_text())
    assert manifest["parallel"]["ep"] == 2
    assert {f for f in manifest["files"] if "experts" in f} >= {
        f"model_experts_pp{p}_ep{e}.safetensors"
        for p in (0, 1)
        for e in (0, 1)
        if case == "mixtral" or p == 0
    }
    _model_flags_come_from_the_checkpoint(str(tmp_path / "ckpt"), case)
    assert convert("--load", tmp_path / "ckpt", "--to-hf", tmp_path / "out") == (0, "")
    original, exported = safetensors_of(folder), safetensors_of(tmp_path / "out")
    assert original.keys() == exported.keys() and all(torch.equal(original[k], exported[k]) for k in original)
    assert any(".experts.3." in k for k in original)  # the Hub's per-expert names


def _model_flags_come_from_the_checkpoint(ckpt: str, case: str) -> None:
    """--use-checkpoint-args takes the MoE flags too; a dense command line is refused, naming them."""
    from training.errors import ConfigError
    from training.run import parse_run

    run_flags = (
        "--mock-data --tokenizer-type NullTokenizer --vocab-size 63 --micro-batch-size 1 --train-iters 1"
    )
    run_flags += f" --lr 1e-4 --seq-length 16 --load {ckpt} --expert-model-parallel-size 2"
    run = parse_run([*run_flags.split(), "--use-checkpoint-args", "--finetune"], 2)
    assert _architecture(run.model) == _architecture(_config(case))
    with pytest.raises(ConfigError, match=r"--num-experts None \(default\) but the checkpoint has 4"):
        parse_run(
            [
                *run_flags.split()[:-2],
                "--num-layers",
                "2",
                "--hidden-size",
                "32",
                "--num-attention-heads",
                "4",
            ],
            1,
        )


BAD = [
    (
        "mixtral",
        {"router_jitter_noise": 0.1},
        "router_jitter_noise 0.1 is not supported: Trident's router multiplies no noise",
    ),
    (
        "mixtral",
        {"sliding_window": 4096},
        "sliding_window 4096 is not supported: Trident's attention is fully causal",
    ),
    (
        "qwen2_moe",
        {"use_sliding_window": True, "sliding_window": 8},
        "sliding_window 8 is not supported: Trident's attention is fully causal",
    ),
    (
        "qwen2_moe",
        {"shared_expert_intermediate_size": 0},
        "shared_expert_intermediate_size 0 is not supported: Qwen2-MoE's shared expert needs a size",
    ),
    (
        "mixtral",
        {"model_type": "deepseek_v3"},
        "model_type 'deepseek_v3' is not supported: Trident imports 'llama', 'gpt2', 'mixtral' and 'qwen2_moe' models",
    ),
]


@pytest.mark.parametrize("case, change, message", BAD)
def test_an_hf_moe_config_we_cannot_represent_is_one_error_naming_the_field(
    tmp_path, hf_folders, case, change, message
):
    check_config_refused(tmp_path, hf_folders[case], change, message)


def _checkpoint_and_hf_model(case: str, spm_model: str, root) -> tuple[str, object, object]:
    """A random Hugging Face MoE model and the same weights as a Trident checkpoint with our tokenizer."""
    from training.tokenizer import build_tokenizer

    tokenizer = build_tokenizer("Llama2Tokenizer", spm_model)
    config = _config(case)
    hf_config = transformers.AutoConfig.for_model(
        **hf_config_json(config, tokenizer.vocab_size, 64, dtype=torch.float32)
        | {"bos_token_id": 1, "eos_token_id": 2}
    )
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():  # wide weights: logits far from ties
        gen = torch.Generator().manual_seed(0)
        for name, p in hf_model.named_parameters():
            scale = 0.3 if p.dim() > 1 else 0.1
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (p.dim() == 1 and name.endswith("weight")))
    return (
        _write(root, hf_model, config, tokenizer.vocab_size, "Llama2Tokenizer", spm_model),
        hf_model,
        tokenizer,
    )


@pytest.mark.slow
def test_greedy_generation_equals_hugging_face_generate(spm, tmp_path):  # noqa: F811
    """In process: the checkpoint loaded for generation, greedy, 32 tokens (slow: the tool's test below
    runs the same for both families through tools/generate.py)."""
    from models.gpt.generation import generate
    from training.inference import load_for_generation

    root, hf_model, tokenizer = _checkpoint_and_hf_model("mixtral", spm, tmp_path / "ckpt")
    loaded = load_for_generation(root)
    prompt = tokenizer.tokenize(PROMPT)
    ours = generate(
        loaded.model, prompt, max_new_tokens=NEW_TOKENS, vocab_size=loaded.vocab_size, eos_id=None
    )
    assert ours.tokens == _hf_generate(hf_model, prompt, do_sample=False, eos_token_id=None)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe"])
def test_greedy_generate_tool_equals_hugging_face_generate(case, spm, tmp_path):  # noqa: F811
    root, hf_model, tokenizer = _checkpoint_and_hf_model(case, spm, tmp_path / "ckpt")
    out = generate_tool_json(
        "--load", root, "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--greedy"
    )
    prompt = tokenizer.tokenize(PROMPT)
    assert out["tokens"] == _hf_generate(hf_model, prompt, do_sample=False)
    assert len(out["tokens"]) == len(prompt) + NEW_TOKENS
