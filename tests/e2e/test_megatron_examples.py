"""Megatron-LM's example scripts (tools/megatron_examples.py) run on 4 CPU ranks, or are refused in one line.

What is expected of each flag comes from the coverage table, so these tests pass today and tighten
by themselves as "not supported yet" flags land: a script whose refused flags are all out of scope
must exit at once with one line naming them, and everything else in it must train (the LLaMA-3 8B
script in full: FP8 with its delayed recipe and its weights held in FP8). The CI part parses and
validates every script in process; the torchrun part is slow:

    python -m pytest -q -m slow tests/e2e/test_megatron_examples.py
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.bpe import train_byte_level_bpe
from tests.support.torchrun_jobs import job_env, run_captured, torchrun_command
from tools.megatron_examples import NPROC, SCRIPTS, in_scope, rejected, tokens
from training.arguments.checks import validate_args
from training.arguments.parser import _rejection, parse_args
from training.arguments.schema import NOT_YET, UNSUPPORTED, coverage_of

ROOT = Path(__file__).resolve().parents[2]
OUT_OF_SCOPE = {
    "gpt3_175b": [],
    "gpt3_175b_step": [],
    "llama3_8b": [],
    "mixtral_8x7b": [],
    "llama3_8b_fsdp": [],
    "gpt_345m_mp": [],
}


def _parse_refused(argv: list[str]) -> list[str]:
    """The refused flags the parser names (a works_only value is refused later, by validate_args)."""
    return [r for r in rejected(argv) if coverage_of(r).status in (NOT_YET, UNSUPPORTED)]


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_each_script_is_accepted_or_refused_in_one_line_naming_the_flags(name):
    argv = tokens(name)
    refused = rejected(argv)
    out_of_scope = [r.split(" ")[0] for r in refused if coverage_of(r).status != NOT_YET]
    assert out_of_scope == OUT_OF_SCOPE[name]  # never a flag that Trident means to support
    if _parse_refused(argv):
        with pytest.raises(ValueError) as err:
            parse_args(argv)
        assert str(err.value) == _rejection(_parse_refused(argv)) and "\n" not in str(err.value)
    elif refused:
        with pytest.raises(ValueError, match=f"^{re.escape(refused[0])}: Trident supports only"):
            validate_args(parse_args(argv), NPROC)
    else:
        validate_args(parse_args(argv), NPROC)
    rest = in_scope(argv)
    assert rejected(rest) == [] and len(rest) < len(argv) or not refused
    args = validate_args(parse_args(rest), NPROC)  # everything else in the script is taken as it is
    assert not args.using_default_model and args.train_iters == 3


@pytest.mark.parametrize(
    ("name", "sharding"), [("llama3_8b", "optim"), ("llama3_8b_fsdp", "optim_grads_params")]
)
def test_the_llama3_8b_fp8_scripts_are_taken_whole_with_their_weights_held_in_fp8(name, sharding):
    """Both LLaMA-3 8B scripts: the distributed optimizer's (ZeRO-1) and Megatron-FSDP's (ZeRO-3, built on
    the meta device)."""
    argv = tokens(name)
    assert rejected(argv) == []
    args = validate_args(parse_args(argv), NPROC)
    assert (args.fp8, args.fp8_recipe, args.fp8_param_gather) == ("hybrid", None, True)
    assert args.use_distributed_optimizer and args.data_parallel_sharding_strategy == sharding
    assert args.init_model_with_meta_device == (name == "llama3_8b_fsdp")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """GPT-2 BPE files and a SentencePiece model trained here, and a corpus preprocessed with the BPE."""
    from tests.support.corpus import make_docs, write_jsonl
    from tools import preprocess_data, train_tokenizer

    root = tmp_path_factory.mktemp("examples")
    docs = make_docs(400, seed=5)
    jsonl = write_jsonl(root / "corpus.jsonl", docs)
    train_byte_level_bpe(docs, 500, save_to=root)
    vocab, merges = str(root / "vocab.json"), str(root / "merges.txt")
    argv = ["--input", jsonl, "--output-prefix", str(root / "corpus"), "--append-eod", "--quiet"]
    data = preprocess_data.main([*argv, "--vocab-file", vocab, "--merge-file", merges])[0]
    spm = str(
        train_tokenizer.main(["--input", jsonl, "--model-prefix", str(root / "spm"), "--vocab-size", "400"])
    )
    return {"data": data, "vocab": vocab, "merges": merges, "spm": spm, "root": root}


def _torchrun(argv: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return run_captured(torchrun_command(NPROC, argv), env=job_env(), timeout=timeout, cwd=cwd)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCRIPTS))
def test_each_script_runs_three_iterations_on_four_ranks_or_exits_at_once(name, files, tmp_path):
    paths = {k: files[k] for k in ("data", "vocab", "merges", "spm")}
    paths |= {"ckpt": str(tmp_path / "ckpt"), "tb": str(tmp_path / "tb"), "cache": str(tmp_path / "cache")}
    argv = tokens(name, **paths)
    refused = _parse_refused(argv) or rejected(argv)
    if refused:
        start = time.monotonic()
        done = _torchrun(argv, tmp_path, timeout=300)
        errors = [line for line in done.stderr.splitlines() if ": error: " in line]
        assert done.returncode != 0 and len(errors) == 1, done.stderr[-3000:]
        assert all(flag.split(" ")[0] in errors[0] for flag in refused), errors
        print(f"{name}: refused in {time.monotonic() - start:.1f} s: {errors[0]}")
    done = _torchrun(in_scope(argv), tmp_path, timeout=600)  # the rest of the script trains
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    logged = re.findall(r"\] iteration +(\d+)/ +3 \|.*\| lm loss: (\S+) \|", done.stdout)
    assert [int(i) for i, _ in logged][-1] == 3 and all(float(loss) > 0 for _, loss in logged), done.stdout[
        -3000:
    ]
    if name.startswith("gpt3_175b"):  # the batch ramp, scaled: 2, 4, then 8 samples
        batches = re.findall(r"\] iteration +\d+/ +3 \|.*\| global batch size: +(\d+) \|", done.stdout)
        assert [int(b) for b in batches] == [2, 4, 8], done.stdout[-3000:]
    print(f"{name}: trained 3 iterations without {' '.join(refused) or 'nothing'}")


@pytest.mark.slow
def test_llama3_8b_script_trains_three_iterations_with_context_parallel_size_2(files, tmp_path):
    """The LLaMA-3 8B script as Megatron runs it with ``--context-parallel-size 2`` (CP 2 x DP 2)."""
    paths = {"ckpt": str(tmp_path / "ckpt"), "tb": str(tmp_path / "tb"), "cache": str(tmp_path / "cache")}
    argv = in_scope(tokens("llama3_8b", **paths))
    at = argv.index("--context-parallel-size")
    argv[at + 1] = "2"
    done = _torchrun(argv, tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "TP=1 PP=1 VPP=1 CP=2 DP=2" in done.stdout
    # in FP8, with the delayed recipe the script's flags ask for (16 tokens per rank: FP8 weight gradients)
    assert (
        "FP8: delayed, hybrid (E4M3 forward, E5M2 gradients), amax history 1024 (max), margin 0"
        in done.stdout
    )
    assert "FP8 on pipeline stage 0: 8 linear layers in FP8 in decoder layers 0, 1\n" in done.stdout
    assert "FP8 on pipeline stage 0: 8 weights held in FP8 (--fp8-param-gather)\n" in done.stdout
    logged = re.findall(r"\] iteration +(\d+)/ +3 \|.*\| lm loss: (\S+) \|", done.stdout)
    assert [int(i) for i, _ in logged][-1] == 3 and all(float(loss) > 0 for _, loss in logged), done.stdout[
        -3000:
    ]
