"""Layout strings: Megatron parity (stages, accept/reject), error messages with positions, even split."""

from __future__ import annotations

import random
import re

import pytest

from core.pipeline_parallel.layout import PipelineLayout, even_layout, parse_layout, parse_stages

MEGATRON_EXAMPLE = "Et*3|(tt|)*29,m|L"


def exact(message: str) -> str:
    """A ``pytest.raises(match=...)`` pattern that accepts only this whole message."""
    return "^" + re.escape(message) + "$"


# --------------------------------------------------------------------------------------------------
# Oracles: what Megatron-LM does, restated from megatron/core/transformer/pipeline_parallel_layer_layout.py
# (parse_str_to_list; __init__ + validate_layer_layout; the VPP check in TransformerConfig.__post_init__).
# --------------------------------------------------------------------------------------------------


def megatron_stages(text: str) -> tuple[tuple[str, ...], ...] | None:
    """Megatron's parse: drop commas, expand ``(...)*N`` then ``x*N`` by regex, split on '|'.

    None means Megatron rejects the string (a character other than E, t, m, L is left over).
    """
    flat = text.replace(",", "")
    flat = re.sub(r"\(([^)]+)\)\*(\d+)", lambda g: g[1] * int(g[2]), flat)
    flat = re.sub(r"(.)\*(\d+)", lambda g: g[1] * int(g[2]), flat)
    stages = tuple(tuple(part) for part in flat.split("|"))
    return stages if all(c in "EtmL" for stage in stages for c in stage) else None


def megatron_accepts(stages, pp: int, vpp: int | None, num_layers: int, mtp: int | None) -> bool:
    """Megatron's asserts on parsed stages (an IndexError on an empty layout counts as a rejection)."""
    if len(stages) % pp:
        return False
    detected = len(stages) // pp
    if vpp is not None and vpp != detected:
        return False
    grid = [[stages[v * pp + r] for v in range(detected)] for r in range(pp)]
    flat = [c for stage in stages for c in stage]
    if not flat or flat[0] != "E" or flat[-1] != "L":
        return False
    if flat.count("E") != 1 or flat.count("L") != 1 or flat.count("t") != num_layers:
        return False
    if not (flat.count("m") == mtp or (mtp is None and "m" not in flat)):
        return False
    if "m" in flat and "t" in flat[flat.index("m") :]:
        return False
    if any("m" in grid[r][v] for r in range(pp) for v in range(detected - 1)):
        return False
    if any("m" in grid[r][-1] and grid[r][-1].count("m") != mtp for r in range(pp)):
        return False
    return not any("m" in grid[0][v] for v in range(detected - 1))


# --------------------------------------------------------------------------------------------------
# Megatron's documented example
# --------------------------------------------------------------------------------------------------


def test_megatron_example_gives_32_stages_exactly():
    layout = parse_layout(MEGATRON_EXAMPLE, 16, num_layers=61, mtp_num_layers=1)
    assert (layout.pp_size, layout.vpp_size, layout.num_stages) == (16, 2, 32)
    assert layout.num_decoder_layers == 61 and layout.num_mtp_layers == 1
    for pp in range(16):
        for vpp in range(2):
            if (pp, vpp) == (0, 0):
                expected = ["E", "t", "t", "t"]
            elif (pp, vpp) == (14, 1):
                expected = ["m"]
            elif (pp, vpp) == (15, 1):
                expected = ["L"]
            else:
                expected = ["t", "t"]
            assert layout.stage_layers(pp, vpp) == expected, (pp, vpp)
            assert layout.has_embedding(pp, vpp) == ((pp, vpp) == (0, 0))
            assert layout.has_loss(pp, vpp) == ((pp, vpp) == (15, 1))
            assert layout.has_mtp(pp, vpp) == ((pp, vpp) == (14, 1))
    assert layout.mtp_layers(14, 1) == [0]


def test_megatron_example_numbers_decoder_layers_contiguously_in_stage_order():
    layout = parse_layout(MEGATRON_EXAMPLE, 16)
    numbers = [n for s in range(32) for n in layout.decoder_layers(s % 16, s // 16)]
    assert numbers == list(range(61))
    assert layout.decoder_layers(0, 0) == [0, 1, 2]
    assert layout.decoder_layers(1, 0) == [3, 4]
    assert layout.decoder_layers(15, 0) == [31, 32]
    assert layout.decoder_layers(0, 1) == [33, 34]
    assert layout.decoder_layers(13, 1) == [59, 60]
    assert layout.decoder_layers(14, 1) == [] and layout.decoder_layers(15, 1) == []


def test_table_folds_equal_ranks():
    assert (
        str(parse_layout(MEGATRON_EXAMPLE, 16))
        == "PipelineLayout: pp_size=16, vpp_size=2, 32 stages, 61 decoder layers\n               vpp_rank 0   vpp_rank 1\npp_rank 0      E,t*3        t*2\npp_rank 1-13   t*2          t*2\npp_rank 14     t*2          m\npp_rank 15     t*2          L"
    )
    assert parse_layout("E||t|L", 2).table().splitlines()[2:] == [
        "pp_rank 0   E            t",
        "pp_rank 1   (empty)      L",
    ]


# --------------------------------------------------------------------------------------------------
# Accepted strings (expected stages worked out by hand from Megatron's regexes, then checked by the oracle)
# --------------------------------------------------------------------------------------------------

ACCEPTED = [
    ("E|*3tL", (("E",), (), (), ("t", "L"))),  # '*' repeats '|'
    ("E||t|L", (("E",), (), ("t",), ("L",))),  # an empty stage
    ("|E|tL|", ((), ("E",), ("t", "L"), ())),  # empty stages around E and L
    ("E(t|)*0L", (("E", "L"),)),  # a group repeated zero times vanishes
    ("E|(t|)*0|L", (("E",), (), ("L",))),
    ("Et*0|L", (("E",), ("L",))),
    ("E|t|*0L", (("E",), ("t", "L"))),  # '|*0' removes a stage break
    ("E,t,t|t,L", (("E", "t", "t"), ("t", "L"))),  # commas are cosmetic
    (",E|,|t,|L,", (("E",), (), ("t",), ("L",))),
    ("Et*1,0|L", (("E",) + ("t",) * 10, ("L",))),  # commas go first, even inside a count
    ("Et,*2|L", (("E", "t", "t"), ("L",))),
    ("E|t*03|L", (("E",), ("t", "t", "t"), ("L",))),
    ("E(tt|)*2L", (("E", "t", "t"), ("t", "t"), ("L",))),
    ("(Et|)*1tL", (("E", "t"), ("t", "L"))),
    ("E|(t*2|)*2,L", (("E",), ("t", "t"), ("t", "t"), ("L",))),
    ("E|(t)*3|L", (("E",), ("t", "t", "t"), ("L",))),
    ("E|(|)*2L", (("E",), (), (), ("L",))),
    ("E(|t)*2,tL", (("E",), ("t",), ("t", "t", "L"))),  # Megatron's comment: (|ab)*2,cd -> |ab|abcd
    ("Et,(t|)*2L", (("E", "t", "t"), ("t",), ("L",))),  # ab,(cd|)*2 -> abcd|cd|
    ("E(t|tt|ttt)*2,|L", (("E", "t"), ("t", "t"), ("t", "t", "t", "t"), ("t", "t"), ("t", "t", "t"), ("L",))),
    ("Et|tttL", (("E", "t"), ("t", "t", "t", "L"))),  # TransformerConfig docstring, list form
    ("E|(tt|)*2,(t|)*4,mL", (("E",), ("t", "t"), ("t", "t"), ("t",), ("t",), ("t",), ("t",), ("m", "L"))),
]


@pytest.mark.parametrize("text,stages", ACCEPTED)
def test_accepted_strings_give_megatrons_stages(text, stages):
    assert megatron_stages(text) == stages  # the hand-written expectation is Megatron's reading
    assert parse_stages(text) == stages
    layout = parse_layout(text, 1)
    assert layout.stages == stages and layout.vpp_size == len(stages)


def test_repeated_bar_makes_four_stages():
    layout = parse_layout("E|*3tL", 4, num_layers=1)
    assert layout.vpp_size == 1
    assert [layout.stage_layers(r) for r in range(4)] == [["E"], [], [], ["t", "L"]]
    assert layout.has_embedding(0) and layout.has_loss(3)
    assert layout.decoder_layers(3) == [0] and layout.decoder_layers(1) == []


def test_empty_stage_is_legal_and_holds_nothing():
    layout = parse_layout("E||t|L", 4, num_layers=1)
    assert layout.stage_layers(1) == [] and layout.decoder_layers(2) == [0]


def test_zero_repeat_of_a_group():
    assert parse_layout("E|(t|)*0L", 2).stages == (("E",), ("L",))
    assert parse_layout("E(tt|)*0|L", 2, num_layers=0).num_decoder_layers == 0


def test_commas_change_nothing():
    assert parse_layout("E,t,t|,t,t,|t,L", 3) == parse_layout("Ett|tt|tL", 3)


# --------------------------------------------------------------------------------------------------
# Virtual pipeline size
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pp,vpp", [(1, 4), (2, 2), (4, 1)])
def test_vpp_size_is_inferred_from_the_stage_count(pp, vpp):
    layout = parse_layout("E|t|t|L", pp)
    assert layout.vpp_size == vpp
    assert parse_layout("E|t|t|L", pp, vpp_size=vpp) == layout
    assert layout.has_embedding(0, 0) and layout.has_loss(pp - 1, vpp - 1)


def test_stage_s_runs_on_rank_s_mod_pp_as_chunk_s_div_pp():
    layout = parse_layout("E|t|tt|ttt|tttt|L", 3)
    for s in range(6):
        assert layout.stage_index(s % 3, s // 3) == s
        assert layout.stage_layers(s % 3, s // 3) == list(layout.stages[s])
    assert layout.decoder_layers(0, 1) == [3, 4, 5] and layout.decoder_layers(1, 1) == [6, 7, 8, 9]


def test_given_vpp_size_must_agree():
    with pytest.raises(
        ValueError,
        match=exact(
            "pipeline layout 'E|t|t|L': 4 stages on pipeline-model-parallel size 2 make 2 virtual stages "
            "per rank, but virtual pipeline size 1 was given"
        ),
    ):
        parse_layout("E|t|t|L", 2, vpp_size=1)
    with pytest.raises(ValueError, match="but virtual pipeline size 3 was given"):
        parse_layout("E|t|t|L", 1, vpp_size=3)


def test_vpp_rank_is_required_only_with_virtual_stages():
    assert parse_layout("E|tL", 2).stage_layers(1) == ["t", "L"]
    layout = parse_layout("E|t|t|L", 2)
    with pytest.raises(
        ValueError, match=exact("vpp_rank is required: the layout has 2 virtual stages per rank")
    ):
        layout.stage_layers(0)
    with pytest.raises(
        ValueError, match=exact("pp_rank 2 is out of range for pipeline-model-parallel size 2")
    ):
        layout.decoder_layers(2, 0)
    with pytest.raises(ValueError, match=exact("vpp_rank 2 is out of range for virtual pipeline size 2")):
        layout.has_loss(0, 2)


# --------------------------------------------------------------------------------------------------
# Rejected strings: one ValueError, naming the problem and its position in the original string
# --------------------------------------------------------------------------------------------------

SYNTAX_ERRORS = [
    ("E|t(t|L", "unbalanced '(' at position 3"),
    ("E,|,t,(t|L", "unbalanced '(' at position 6"),  # positions count the commas
    ("E|t)|L", "unbalanced ')' at position 3"),
    ("E|((t)*2)*2|L", "nested '(' at position 3 (groups cannot be nested)"),
    ("E|(t(t)*2)*2|L", "nested '(' at position 4 (groups cannot be nested)"),
    ("E|()*2|L", "empty group '()' at position 2"),
    ("E|(,)*2|L", "empty group '()' at position 2"),
    ("E|(tt)|L", "group opened at position 2 needs a repeat count '*N' after its ')'"),
    ("E|(tt)2|L", "group opened at position 2 needs a repeat count '*N' after its ')'"),
    ("*3E|L", "'*' at position 0 has nothing to repeat"),
    (",*3E|L", "'*' at position 1 has nothing to repeat"),
    ("E|(*3t)*2|L", "'*' at position 3 has nothing to repeat (it follows '(')"),
    ("E|t*|L", "'*' at position 3 is not followed by a repeat count"),
    ("E|t**2|L", "'*' at position 3 is not followed by a repeat count"),
    ("E|(t|)*|L", "'*' at position 6 is not followed by a repeat count"),
    ("E|t3|L", "number at position 3 is not preceded by '*'"),
    ("E|(3t)*2|L", "number at position 3 is not preceded by '*'"),
    ("E|t*-1|L", "negative repeat count at position 4 (counts are whole numbers >= 0)"),
    ("E|t*2*2|L", "second '*' at position 5: a repeat count cannot be repeated"),
    ("E|(tt)*2*3|L", "second '*' at position 8: a repeat count cannot be repeated"),
    ("E|t x|L", "unknown symbol ' ' at position 3 (expected E, t, m, L, '|', '(', ')', '*', digits or ',')"),
    ("E|T|L", "unknown symbol 'T' at position 2 (expected E, t, m, L, '|', '(', ')', '*', digits or ',')"),
    (" E|L", "unknown symbol ' ' at position 0 (expected E, t, m, L, '|', '(', ')', '*', digits or ',')"),
    (
        "E|t\n|L",
        "unknown symbol '\\n' at position 3 (expected E, t, m, L, '|', '(', ')', '*', digits or ',')",
    ),
]


@pytest.mark.parametrize("text,problem", SYNTAX_ERRORS)
def test_malformed_strings_name_the_problem_and_position(text, problem):
    with pytest.raises(ValueError, match=exact(f"pipeline layout '{text}': {problem}")):
        parse_layout(text, 1)
    with pytest.raises(ValueError, match=exact(f"pipeline layout '{text}': {problem}")):
        parse_stages(text)


# (layout, pp_size, keyword arguments, message after "pipeline layout '...': ")
RULE_ERRORS = [
    (
        "E|t|L",
        2,
        {},
        "3 stages are not a multiple of pipeline-model-parallel size 2 (stage s runs on pp_rank s % 2)",
    ),
    ("", 1, {}, "the layout holds no layers; it must start with 'E' and end with 'L'"),
    ("||", 3, {}, "the layout holds no layers; it must start with 'E' and end with 'L'"),
    ("t|E|L", 1, {}, "the first layer must be 'E' (embedding), got 't' (decoder layer) at position 0"),
    ("|(t|)*2E|L", 1, {}, "the first layer must be 'E' (embedding), got 't' (decoder layer) at position 2"),
    ("E|t|Lt", 1, {}, "the last layer must be 'L' (loss), got 't' (decoder layer) at position 5"),
    ("E|tL|m", 1, {}, "the last layer must be 'L' (loss), got 'm' (MTP layer) at position 5"),
    ("E|E|L", 1, {}, "'E' (embedding) must appear exactly once, found 2 (at position 0, at position 2)"),
    ("E*2|L", 1, {}, "'E' (embedding) must appear exactly once, found 2 (at position 0)"),
    ("E|L|tL", 1, {}, "'L' (loss) must appear exactly once, found 2 (at position 2, at position 5)"),
    ("Et*3|L", 2, {"num_layers": 4}, "the layout has 3 decoder layers ('t') but num_layers is 4"),
    ("Et|mL", 2, {"mtp_num_layers": 2}, "the layout has 1 MTP layers ('m') but mtp_num_layers is 2"),
    ("Et|mL", 2, {"mtp_num_layers": 0}, "the layout has 1 MTP layers ('m') but mtp_num_layers is 0"),
    ("Et|tL", 2, {"mtp_num_layers": 1}, "the layout has 0 MTP layers ('m') but mtp_num_layers is 1"),
    (
        "Et|m|t|L",
        4,
        {},
        (
            "decoder layer 't' at position 5 comes after the MTP layer at position 3; "
            "all decoder layers must precede the MTP layers"
        ),
    ),
    (
        "Etmt|L",
        2,
        {"mtp_num_layers": 1},
        (
            "decoder layer 't' at position 3 comes after the MTP layer at position 2; "
            "all decoder layers must precede the MTP layers"
        ),
    ),
    (
        "Et|m||L",
        2,
        {},
        (
            "MTP layer 'm' at position 3 is in stage 1 (pp_rank 1, vpp_rank 0); "
            "MTP layers must be in the last virtual stage of their rank (vpp_rank 1)"
        ),
    ),
    (
        "Et|t|m|mL",
        2,
        {"mtp_num_layers": 2},
        "the MTP layers are split over stages [2, 3]; they must all be in one stage",
    ),
]


@pytest.mark.parametrize("text,pp,kwargs,problem", RULE_ERRORS)
def test_invalid_layouts_name_the_rule(text, pp, kwargs, problem):
    with pytest.raises(ValueError, match=exact(f"pipeline layout '{text}': {problem}")):
        parse_layout(text, pp, **kwargs)


def test_sizes_are_checked():
    with pytest.raises(ValueError, match=exact("pipeline-model-parallel size must be an int >= 1, got 0")):
        parse_layout("E|L", 0)
    with pytest.raises(ValueError, match=exact("virtual pipeline size must be an int >= 1, got 0")):
        parse_layout("E|L", 1, vpp_size=0)
    with pytest.raises(TypeError, match="must be a str"):
        parse_layout(["E", "L"], 1)


def test_mtp_placements_megatron_allows():
    # All on the last stage with the loss, as in Megatron's TransformerConfig docstring.
    assert parse_layout("E|(tt|)*2,(t|)*4,mL", 4, mtp_num_layers=1).has_mtp(3, 1)
    # A standalone MTP stage before the loss rank, as in Megatron's example.
    assert parse_layout("Et|tm|L", 3, mtp_num_layers=1).mtp_layers(1) == [0]
    # Two MTP layers in one stage.
    assert parse_layout("Et|t|t|mmL", 2, mtp_num_layers=2).mtp_layers(1, 1) == [0, 1]
    # Rank 0's last virtual stage: Megatron's "not on the first pp rank" check skips it.
    assert parse_layout("Et|t|m|L", 2, mtp_num_layers=1).has_mtp(0, 1)
    assert parse_layout("Ettm|L", 2, mtp_num_layers=1).has_mtp(0)
    # mtp_num_layers=None leaves the count unchecked (Megatron would read None as 0).
    assert parse_layout(MEGATRON_EXAMPLE, 16).num_mtp_layers == 1


def test_documented_differences_from_megatron_are_rejected():
    # Megatron's regexes accept these by accident; each is a typo here.
    for text, problem in [
        ("Ex*0|L", "unknown symbol 'x' at position 1"),
        ("E(*0|L", "'*' at position 2 has nothing to repeat (it follows '(')"),
        ("E|(tt)*2*3|L", "second '*' at position 8"),
        ("Et*(3)*1|L", "'*' at position 2 is not followed by a repeat count"),
    ]:
        assert megatron_stages(text) is not None
        with pytest.raises(ValueError, match=re.escape(f"pipeline layout '{text}': {problem}")):
            parse_stages(text)


# --------------------------------------------------------------------------------------------------
# Fuzzing against the Megatron oracles (fixed seeds, a few thousand strings, well under a second)
# --------------------------------------------------------------------------------------------------

PIECES = ["E", "t", "t", "m", "L", "|", "|", "(", ")", "*", "0", "1", "2", ",", "x", "*2", "*0", "(t|)", "*3"]
# Strings Megatron's regexes accept outside our grammar all involve one of these (see the module docstring).
ACCIDENTS = re.compile(r"\*0|\)\*\d+\*\d|\*\(|\(\*|\(\d")


def test_fuzz_syntax_matches_megatron():
    rng = random.Random(1234)
    accepted = differ = 0
    for _ in range(4000):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 9)))
        theirs = megatron_stages(text)
        try:
            ours = parse_stages(text)
        except ValueError as err:
            assert str(err).startswith(f"pipeline layout '{text}': ")
            if theirs is not None:
                differ += 1
                assert ACCIDENTS.search(text.replace(",", "")), (text, theirs, str(err))
            continue
        accepted += 1
        assert ours == theirs, text
    assert accepted > 500 and differ < accepted


def _random_layout(rng: random.Random) -> tuple[str, int, int | None, int, int]:
    """A layout string near the valid ones (E first, L last, few m), plus sizes to validate it with."""
    pp = rng.randint(1, 4)
    num_stages = pp * rng.randint(1, 3) + (rng.random() < 0.1)
    stages = [["t"] * rng.randint(0, 3) for _ in range(num_stages)]
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):  # MTP layers, mostly on late stages
        where = rng.randint(max(0, num_stages - pp - 2), num_stages - 1)
        stages[where].insert(
            rng.randint(0, len(stages[where])) if rng.random() < 0.2 else len(stages[where]), "m"
        )
        if rng.random() < 0.7:  # usually no decoder layer after it
            stages[where + 1 :] = [[c for c in stage if c != "t"] for stage in stages[where + 1 :]]
    if rng.random() < 0.9:
        stages[0].insert(0, "E")
    if rng.random() < 0.9:
        stages[-1].append("L")
    if rng.random() < 0.05:
        rng.choice(stages).append(rng.choice("EL"))
    text = "|".join(",".join(stage) for stage in stages)
    num_t = text.count("t") + (rng.random() < 0.1)
    num_m = text.count("m") + (rng.random() < 0.1)
    vpp = rng.choice([None, None, num_stages // pp, num_stages // pp + 1])
    return text, pp, vpp, num_t, num_m


def test_fuzz_validation_matches_megatron():
    rng = random.Random(99)
    accepted = 0
    for _ in range(3000):
        text, pp, vpp, num_t, num_m = _random_layout(rng)
        theirs = megatron_accepts(megatron_stages(text), pp, vpp, num_t, num_m)
        try:
            layout = parse_layout(text, pp, vpp_size=vpp, num_layers=num_t, mtp_num_layers=num_m)
        except ValueError:
            assert not theirs, (text, pp, vpp, num_t, num_m)
            continue
        assert theirs, (text, pp, vpp, num_t, num_m)
        assert layout.stages == megatron_stages(text)
        accepted += 1
    assert accepted > 300


# --------------------------------------------------------------------------------------------------
# The default split
# --------------------------------------------------------------------------------------------------


def test_even_layout_gives_the_remainder_to_the_earliest_stages():
    layout = even_layout(7, 2, 2)
    assert [len(layout.decoder_layers(s % 2, s // 2)) for s in range(4)] == [2, 2, 2, 1]
    assert layout.stages == (("E", "t", "t"), ("t", "t"), ("t", "t"), ("t", "L"))
    assert layout.decoder_layers(1, 0) == [2, 3] and layout.decoder_layers(0, 1) == [4, 5]


def test_even_layout_with_fewer_layers_than_stages_leaves_the_last_ones_empty():
    layout = even_layout(3, 4)
    assert [len(layout.decoder_layers(r)) for r in range(4)] == [1, 1, 1, 0]
    assert layout.stage_layers(3) == ["L"]
    assert even_layout(0, 2).stages == (("E",), ("L",))
    assert even_layout(0, 1).stages == (("E", "L"),)


def test_even_layout_sweep():
    for num_layers in range(14):
        for pp in range(1, 5):
            for vpp in (None, 1, 2, 3):
                layout = even_layout(num_layers, pp, vpp)
                v = vpp or 1
                counts = [len(layout.decoder_layers(s % pp, s // pp)) for s in range(pp * v)]
                assert sum(counts) == num_layers and layout.num_decoder_layers == num_layers
                assert counts == sorted(counts, reverse=True) and max(counts) - min(counts) <= 1
                assert layout.vpp_size == v and layout.num_stages == pp * v
                assert layout.has_embedding(0, 0) and layout.has_loss(pp - 1, v - 1)
                assert sum(layout.has_embedding(s % pp, s // pp) for s in range(pp * v)) == 1
                assert sum(layout.has_loss(s % pp, s // pp) for s in range(pp * v)) == 1
                again = parse_layout(layout.to_string(), pp, vpp_size=vpp, num_layers=num_layers)
                assert again == layout


def test_even_layout_checks_its_arguments():
    with pytest.raises(ValueError, match=exact("num_layers must be an int >= 0, got -1")):
        even_layout(-1, 2)
    with pytest.raises(ValueError, match=exact("virtual pipeline size must be an int >= 1, got 0")):
        even_layout(4, 2, 0)
    with pytest.raises(ValueError, match=exact("pipeline-model-parallel size must be an int >= 1, got 0")):
        even_layout(4, 0)


def test_direct_construction_checks_structure_and_rules():
    assert PipelineLayout((["E", "t"], ["L"]), 2).stages == (("E", "t"), ("L",))
    with pytest.raises(ValueError, match=exact("pipeline layout symbols must be E, t, m or L, got ['x']")):
        PipelineLayout((("E", "x"), ("L",)), 2)
    with pytest.raises(ValueError, match="3 pipeline stages are not a positive multiple"):
        PipelineLayout((("E",), ("t",), ("L",)), 2)
    with pytest.raises(
        ValueError,
        match=exact(
            "pipeline layout 't|E,L': the first layer must be 'E' (embedding), "
            "got 't' (decoder layer) in stage 0"
        ),
    ):
        PipelineLayout((("t",), ("E", "L")), 2)


def test_zbv_places_the_second_chunk_back_up_the_ranks():
    """Under ZBV's V, stage s >= pp runs on rank 2 pp - 1 - s: the first and the last stage share rank 0."""
    layout = parse_layout("Et|t|t|tL", 2, placement="v")
    assert [layout.stage_index(r, v) for r in range(2) for v in range(2)] == [0, 3, 1, 2]
    assert layout.has_embedding(0, 0) and layout.has_loss(0, 1) and not layout.has_loss(1, 1)
    assert layout.decoder_layers(0, 1) == [3] and layout.stage_layers(1, 1) == ["t"]
    assert layout.decoder_layers(1, 0) == [1]
    assert "V placement" in layout.table()
    even = even_layout(8, 4, 2, placement="v")
    assert even.has_embedding(0, 0) and even.has_loss(0, 1)
    assert [even.decoder_layers(3, v) for v in (0, 1)] == [[3], [4]]  # the bottom of the V


def test_zbv_needs_two_stages_per_rank():
    with pytest.raises(
        ValueError, match=r"the V placement \(ZBV\) needs 2 stages per pipeline rank, i\.e\. 4"
    ):
        parse_layout("Et|t|t|t|t|tL", 2, placement="v")
    with pytest.raises(
        ValueError, match="the V placement .ZBV. runs exactly 2 model chunks per pipeline rank"
    ):
        even_layout(4, 2, 1, placement="v")
