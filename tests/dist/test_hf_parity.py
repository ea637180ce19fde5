"""``tools/convert_checkpoint.py --to-hf`` end to end, on four real ranks: ``AutoModelForCausalLM`` on
the exported folder gives the logits of the same checkpoint run at TP2 x PP2, and ``AutoTokenizer``
the ids of our tokenizer (tests/unit/test_hf_parity.py compares the configurations in one process)."""

from __future__ import annotations

import pytest
import torch

from tests.support.hf import (
    CASES,
    ROPE_OFFSET,
    SEQ,
    TEXTS,
    TOL,
    write_trident_checkpoint,
    write_tokenizer_files,
)
from tests.support.pipeline_logits import checkpoint_logits

transformers = pytest.importorskip("transformers")


EXPORTS = {
    # case: (config, tokenizer type)
    "llama-gqa": (CASES["llama-gqa"][0], "Llama2Tokenizer"),
    "llama3-rope-scaling": (CASES["llama3-rope-scaling"][0], "GPTSentencePieceTokenizer"),
    "gpt2": (CASES["gpt2"][0], "GPT2BPETokenizer"),
}


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
        write_trident_checkpoint(tmp_path / case, config, ours.vocab_size, tokenizer_type, files)
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
