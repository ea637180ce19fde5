"""Text generation: the key/value cache, ``tools/generate.py`` against ``transformers``' ``generate()``.

Tiny LLaMA (GQA) and GPT-2 models are built with ``transformers`` here (random weights, nothing is
downloaded), mapped into Trident checkpoints with ``models.gpt.hf_mapping.from_hf`` and the offline
checkpoint writer, with a real SentencePiece tokenizer trained here copied in. ``tools/generate.py``
then runs on those checkpoints and must choose the very tokens Hugging Face chooses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys

import pytest
import torch

from core.transformer.inference_context import InferenceContext
from models.gpt import GPTModel, gpt2_config, llama_config
from models.gpt.generation import SamplingParams, generate, warp_logits
from models.gpt.hf_mapping import from_hf, hf_config_kwargs
from tests.support.bpe import train_byte_level_bpe
from tests.support.torchrun_jobs import run_captured
from tools import generate as generate_tool
from training.checkpoint import gpt_tensor_specs, parallelism_of, write_checkpoint
from training.inference import load_for_generation
from training.tokenizer import build_tokenizer

transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ, NEW_TOKENS = 64, 32
PROMPT = "the pipeline stage sends a tensor to"
WORDS = ["the", "a", "pipeline", "stage", "tensor", "model", "parallel", "data", "gradient", "loss", "token",
         "layer", "attention", "batch", "rank"]  # fmt: skip

MODELS = {
    "llama-gqa": (
        lambda **kw: llama_config(
            num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48, **kw
        ),
        "LlamaForCausalLM",
        "LlamaConfig",
        "Llama2Tokenizer",
    ),
    "gpt2": (
        lambda **kw: gpt2_config(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            **kw,
        ),
        "GPT2LMHeadModel",
        "GPT2Config",
        "GPTSentencePieceTokenizer",
    ),
}


@pytest.fixture(scope="module")
def spm(tmp_path_factory) -> str:
    """A real SentencePiece model (unk 0, bos 1, eos 2), trained by the project's tool."""
    from tools import train_tokenizer

    root = tmp_path_factory.mktemp("spm")
    rng = random.Random(0)
    with open(root / "corpus.jsonl", "w", encoding="utf-8") as f:
        for _ in range(200):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 20)))
            f.write(json.dumps({"text": text}) + "\n")
    flags = [
        "--input",
        str(root / "corpus.jsonl"),
        "--model-prefix",
        str(root / "spm"),
        "--vocab-size",
        "300",
    ]
    return str(train_tokenizer.main(flags))


def _hf_model(case: str, vocab: int, seed: int = 0):
    """A random Hugging Face model and the TransformerConfig of the same architecture."""
    make, model_class, config_class, _ = MODELS[case]
    config = make()
    hf_config = getattr(transformers, config_class)(
        **hf_config_kwargs(config, vocab, SEQ), bos_token_id=1, eos_token_id=2, pad_token_id=2
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(hf_config).eval()
    with torch.no_grad():  # wider weights than the default 0.02, so that logits are far from ties
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            else:  # norm weights near one, biases near zero
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + name.endswith("weight"))
    return model, config


def _write(root, hf_model, config, vocab: int, tokenizer_type: str, files, tp: int = 1, pp: int = 1):
    """The Hugging Face weights as a Trident checkpoint at TP x PP, with the tokenizer copied in."""
    config = dataclasses.replace(config, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    ours = from_hf(hf_model.state_dict(), config, vocab)
    specs, tied = gpt_tensor_specs(config, vocab, SEQ)
    write_checkpoint(
        str(root),
        ((name, ours[name][tuple(slice(0, n) for n in spec.shape)]) for name, spec in specs.items()),
        specs=specs,
        tied=tied,
        parallelism=parallelism_of(config),
        config=config.to_dict(),
        vocab_size=vocab,
        max_sequence_length=SEQ,
        tokenizer_type=tokenizer_type,
        tokenizer_files=files if isinstance(files, dict) else {"tokenizer_model": files},
    )
    return str(root)


def _hf_generate(model, prompt: list[int], **kwargs) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, **kwargs)
    return out[0].tolist()


def _run_tool(capsys, *flags: str) -> dict:
    assert generate_tool.main(["--json", *flags]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def checkpoints(spm, tmp_path_factory):
    """Per model: the Hugging Face model and its checkpoint at TP1 and at TP2 x PP2."""
    vocab = build_tokenizer("GPTSentencePieceTokenizer", spm).vocab_size
    out = {}
    for case, (_, _, _, tokenizer_type) in MODELS.items():
        hf_model, config = _hf_model(case, vocab)
        root = tmp_path_factory.mktemp(case)
        out[case] = {
            "hf": hf_model,
            "tp1": _write(root / "tp1", hf_model, config, vocab, tokenizer_type, spm),
            "tokenizer": build_tokenizer(tokenizer_type, spm),
        }
        out[case]["tp2pp2"] = _write(root / "tp2pp2", hf_model, config, vocab, tokenizer_type, spm, 2, 2)
    return out


@pytest.mark.parametrize("tokenizer_type", ["GPT2BPETokenizer", "HuggingFaceTokenizer"])
def test_gpt2_bpe_and_hugging_face_tokenizers_travel_with_the_checkpoint(tokenizer_type, tmp_path, capsys):
    """The files training copies in (vocab.json and merges.txt, or a tokenizer folder) rebuild the tokenizer."""
    from argparse import Namespace

    from transformers import PreTrainedTokenizerFast

    from training.checkpoint.resume import tokenizer_record

    trainer = train_byte_level_bpe([PROMPT] * 3 + WORDS, 300, min_frequency=2, save_to=tmp_path)
    hf_folder = str(tmp_path / "hf")
    PreTrainedTokenizerFast(tokenizer_object=trainer._tokenizer, eos_token="<|endoftext|>").save_pretrained(
        hf_folder
    )
    bpe = {"vocab_file": str(tmp_path / "vocab.json"), "merge_file": str(tmp_path / "merges.txt")}
    flags = {
        "tokenizer_type": tokenizer_type,
        "tokenizer_model": None,
        "vocab_file": None,
        "merge_file": None,
    }
    flags.update(bpe if tokenizer_type == "GPT2BPETokenizer" else {"tokenizer_model": hf_folder})
    record = tokenizer_record(Namespace(**flags))  # what pretrain() copies into its checkpoints
    tokenizer = build_tokenizer(
        tokenizer_type, record["files"].get("tokenizer_model"), **{k: record["files"].get(k) for k in bpe}
    )
    hf_model, config = _hf_model("gpt2", tokenizer.vocab_size)
    root = _write(tmp_path / "ckpt", hf_model, config, tokenizer.vocab_size, tokenizer_type, record["files"])
    out = _run_tool(capsys, "--load", root, "--prompt", PROMPT, "--max-new-tokens", "4")
    prompt = tokenizer.tokenize(PROMPT)
    assert out["tokens"][: len(prompt)] == prompt and len(out["tokens"]) == len(prompt) + 4
    assert out["text"] == tokenizer.detokenize(out["tokens"])


# -- the key/value cache ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(MODELS))
def test_cached_logits_equal_a_full_forward_at_every_step(case):
    config = MODELS[case][0](init_method_std=0.3)
    vocab = 100
    model = GPTModel(config, vocab, SEQ).eval()
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    with torch.no_grad():
        context = InferenceContext(2, SEQ)
        cached = model(tokens[:, :8], inference_context=context)[..., :vocab]
        context.advance(8)
        assert rel(cached, model(tokens[:, :8])[..., :vocab]) <= 1e-5
        for t in range(8, 20):  # one token per step
            cached = model(tokens[:, t : t + 1], inference_context=context)[..., :vocab]
            context.advance(1)
            assert rel(cached[:, 0], model(tokens[:, : t + 1])[:, -1, :vocab]) <= 1e-5, t
        chunk = model(tokens[:, 20:24], inference_context=context)[..., :vocab]  # several new tokens at once
        assert rel(chunk, model(tokens)[:, 20:, :vocab]) <= 1e-5
    assert sorted(context.key_value_memory) == [0, 1]
    assert context.key_value_memory[0][0].shape == (2, config.num_query_groups, SEQ, config.kv_channels)


def test_the_context_refuses_more_positions_than_it_holds():
    context = InferenceContext(1, 4)
    with pytest.raises(
        ValueError, match="1 sequences of 4 positions, but layer 3 got 1 sequences reaching position 5"
    ):
        context.store(3, torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8))


# -- greedy decoding equals transformers' generate() --------------------------------------------------


def generate_tool_json(*flags: str) -> dict:
    """``python tools/generate.py FLAGS --json`` as a user runs it: its JSON line (it must exit 0)."""
    proc = run_captured(
        [sys.executable, os.path.join(ROOT, "tools", "generate.py"), *flags, "--json"],
        env={**os.environ, "PYTHONPATH": ROOT},
        timeout=120,
        cwd=None,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(MODELS))
def test_greedy_tool_output_equals_hugging_face_generate(case, checkpoints):
    entry = checkpoints[case]
    out = generate_tool_json(
        "--load", entry["tp1"], "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--greedy"
    )
    prompt = entry["tokenizer"].tokenize(PROMPT)
    assert out["tokens"][: len(prompt)] == prompt
    assert out["tokens"] == _hf_generate(entry["hf"], prompt, do_sample=False)
    assert len(out["tokens"]) == len(prompt) + len(out["top_logits"])
    assert out["text"] == entry["tokenizer"].detokenize(out["tokens"])
    for step, chosen in zip(out["top_logits"], out["tokens"][len(prompt) :]):
        assert len(step) == 5 and step[0][0] == chosen
        assert [v for _, v in step] == sorted((v for _, v in step), reverse=True)


@pytest.mark.parametrize("case", list(MODELS))
def test_a_tp2_pp2_checkpoint_generates_what_tp1_generates(case, checkpoints, capsys):
    """Resharded in memory: vocabulary re-padded (300 -> 512 rows at TP2, 384 at TP1), GPT-2's tied
    output layer stored on the last pipeline rank and LLaMA's untied one."""
    entry = checkpoints[case]
    flags = ["--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS)]
    tp1 = _run_tool(capsys, "--load", entry["tp1"], *flags)
    tp2pp2 = _run_tool(capsys, "--load", entry["tp2pp2"], *flags)
    assert tp2pp2["tokens"] == tp1["tokens"]
    for a, b in zip(tp2pp2["top_logits"], tp1["top_logits"]):
        assert [i for i, _ in a] == [i for i, _ in b]
        assert all(abs(x - y) <= 1e-4 * max(1.0, abs(y)) for (_, x), (_, y) in zip(a, b))


def test_generation_stops_at_eos_as_hugging_face_does(checkpoints):
    entry = checkpoints["llama-gqa"]
    loaded = load_for_generation(entry["tp1"])
    prompt = loaded.tokenizer.tokenize(PROMPT)
    free = generate(
        loaded.model, prompt, max_new_tokens=NEW_TOKENS, vocab_size=loaded.vocab_size, eos_id=None
    )
    generated = free.generated
    stop_at = next(i for i in range(3, NEW_TOKENS) if generated[i] not in generated[:i])  # first occurrence
    eos = generated[stop_at]
    ours = generate(loaded.model, prompt, max_new_tokens=NEW_TOKENS, vocab_size=loaded.vocab_size, eos_id=eos)
    assert ours.tokens == free.tokens[: len(prompt) + stop_at + 1]  # the EOS token is kept, then it stops
    assert ours.tokens == _hf_generate(entry["hf"], prompt, do_sample=False, eos_token_id=eos)


# -- sampling -----------------------------------------------------------------------------------------


def test_warping_is_temperature_then_top_k_then_top_p_as_in_transformers():
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    logits[0, :3] = logits[0, 10]  # ties at the top-k boundary are kept, as in transformers
    for temperature, top_k, top_p in ((0.7, 10, 0.9), (1.0, 0, 0.5), (2.0, 3, 1.0), (1.3, 1, 0.2)):
        expected = logits
        for warper in (
            TemperatureLogitsWarper(temperature),
            TopKLogitsWarper(top_k) if top_k else None,
            TopPLogitsWarper(top_p) if top_p < 1 else None,
        ):
            expected = expected if warper is None else warper(None, expected)
        params = SamplingParams(greedy=False, temperature=temperature, top_k=top_k, top_p=top_p)
        assert torch.equal(warp_logits(logits, params), expected)


def test_seeded_sampling_repeats_and_top_k_one_is_greedy(checkpoints, capsys):
    load = ["--load", checkpoints["gpt2"]["tp1"], "--prompt", PROMPT, "--max-new-tokens", "16"]
    sampled = [
        _run_tool(capsys, *load, "--temperature", "3", "--top-p", "0.95", "--seed", seed)["tokens"]
        for seed in ("7", "7", "8")
    ]
    assert sampled[0] == sampled[1] != sampled[2]
    greedy = _run_tool(capsys, *load, "--greedy")["tokens"]
    assert _run_tool(capsys, *load, "--top-k", "1", "--temperature", "0.5", "--seed", "3")["tokens"] == greedy
    assert sampled[0] != greedy


def test_seeded_sampling_draws_what_transformers_draws_with_that_seed(checkpoints):
    entry = checkpoints["gpt2"]
    loaded = load_for_generation(entry["tp1"])
    prompt = loaded.tokenizer.tokenize(PROMPT)
    params = SamplingParams(greedy=False, temperature=1.5, top_k=40, top_p=0.9)
    ours = generate(
        loaded.model,
        prompt,
        max_new_tokens=NEW_TOKENS,
        vocab_size=loaded.vocab_size,
        eos_id=loaded.eos_id,
        sampling=params,
        generator=torch.Generator().manual_seed(5),
    )
    torch.manual_seed(5)
    theirs = _hf_generate(entry["hf"], prompt, do_sample=True, temperature=1.5, top_k=40, top_p=0.9)
    assert ours.tokens == theirs


# -- bad input ----------------------------------------------------------------------------------------


def _error(capsys, *flags: str) -> str:
    assert generate_tool.main(list(flags)) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_bad_input_is_one_line_naming_the_flag(checkpoints, capsys, tmp_path):
    load = ["--load", checkpoints["gpt2"]["tp1"]]
    err = _error(capsys, "--load", str(tmp_path / "nothing"), "--prompt", "x")
    assert err.startswith(f"generate.py: error: --load {tmp_path / 'nothing'}: no checkpoint in ")
    err = _error(capsys, *load, "--ckpt-step", "5", "--prompt", "x")
    assert "--ckpt-step 5: no checkpoint for iteration 5" in err
    err = _error(capsys, *load, "--prompt", PROMPT, "--max-new-tokens", "60")
    n = len(checkpoints["gpt2"]["tokenizer"].tokenize(PROMPT))
    assert (
        f"--prompt is {n} tokens and --max-new-tokens is 60, {n + 60} positions in all, but the model has 64"
        in err
    )
    for flags, message in (
        (["--greedy", "--top-k", "3"], "--greedy cannot be combined with the sampling flag(s) --top-k"),
        (["--top-p", "0"], "--top-p 0.0 must be in (0, 1]"),
        (["--temperature", "-1"], "--temperature -1.0 must be > 0"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            generate_tool.main([*load, "--prompt", "x", *flags])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_tensor_parallel_generation_under_torchrun(checkpoints, capsys):
    """``python -m pytest -q -m slow tests/e2e/test_generate.py``: TP=2 under torchrun chooses the TP=1 tokens,
    and a world size that does not divide the heads is one error, printed once."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)

    def torchrun(nproc: int, *flags: str) -> subprocess.CompletedProcess:
        command = ["torchrun", "--standalone", "--nproc-per-node", str(nproc), "tools/generate.py", *flags]
        return run_captured(command, env=env, timeout=180, cwd=ROOT)

    for case in MODELS:
        flags = ["--load", checkpoints[case]["tp1"], "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS)]
        proc = torchrun(2, *flags, "--json")
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.strip().splitlines()
        assert len(lines) == 1  # rank 0 prints
        assert json.loads(lines[0])["tokens"] == _run_tool(capsys, *flags)["tokens"]
    proc = torchrun(3, "--load", checkpoints["gpt2"]["tp1"], "--prompt", PROMPT)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("generate.py: error:")]
    assert len(errors) == 1
    assert "at TP 3 (each torchrun process is one tensor-parallel rank)" in errors[0]
    assert "num_attention_heads (4) must be divisible by tensor_model_parallel_size (3)" in errors[0]
