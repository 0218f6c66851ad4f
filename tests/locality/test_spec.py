import json

import pytest

from local_attn_fairseq.locality.spec import (
    MAX_WINDOW,
    HeadSpec,
    LocalitySpec,
    LocalitySpecError,
    preset_names,
)

LAYERS = {"encoder_self": 6, "decoder_self": 6, "decoder_cross": 6}
HEADS = {"encoder_self": 8, "decoder_self": 8, "decoder_cross": 8}
PAPER_PRESETS = [
    "2loc-all6",
    "4loc-all6",
    "8loc-first3",
    "8loc-last3",
    "8loc-all6",
    "4loc4tied-all6",
    "2loc6tied-all6",
    "1loc7tied-all6",
    "1loc7tied-first3",
    "half-tied",
    "fully-tied",
]
ALL7 = ["identity", "identity", "prev-1", "prev-2", "next-1", "next-2", "band-1", "band-2"]


def spec(config):
    return LocalitySpec(config, LAYERS, HEADS)


def masks(s, layer, attn="encoder_self"):
    return [h.mask for h in s.heads(attn, layer)]


def owners(s, layer, attn="encoder_self"):
    return [h.qk_owner for h in s.heads(attn, layer)]


def test_every_paper_configuration_is_shipped():
    assert set(PAPER_PRESETS) <= set(preset_names())


def test_no_config_is_the_plain_transformer():
    s = spec(None)
    assert not s.is_local("encoder_self")
    assert s.heads("encoder_self", 3) == (HeadSpec(),) * 8


def test_preset_layouts_follow_the_paper():
    b = spec("2loc-all6")
    assert all(masks(b, l) == ["band-1", "band-2"] + ["global"] * 6 for l in range(6))
    d, e = spec("8loc-first3"), spec("8loc-last3")
    assert [sorted(masks(d, l)) == sorted(ALL7) for l in range(6)] == [True] * 3 + [False] * 3
    assert [sorted(masks(e, l)) == sorted(ALL7) for l in range(6)] == [False] * 3 + [True] * 3
    g = spec("4loc4tied-all6")
    assert owners(g, 2) == [None, (2, 0), None, (2, 2), None, (2, 4), None, (2, 6)]
    assert masks(g, 2) == ["identity", "band-2"] * 4
    h = spec("2loc6tied-all6")
    assert owners(h, 1) == [None, (1, 0), (1, 0), (1, 0), None, (1, 4), (1, 4), (1, 4)]
    assert masks(h, 1) == ["identity", "band-2", "prev-1", "next-1"] * 2
    i = spec("1loc7tied-all6")
    assert all(owners(i, l) == [None] + [(l, 0)] * 7 for l in range(6))
    assert sorted(masks(i, 4)) == sorted(ALL7)
    k = spec("half-tied")
    assert owners(k, 0) == [None] + [(0, 0)] * 7
    assert owners(k, 2) == [(0, 0)] * 8 and masks(k, 4) == ["global"] * 8
    l_ = spec("fully-tied")
    assert all(owners(l_, l) == [(0, 0)] * 8 for l in range(1, 6))


def test_chains_of_ties_resolve_to_the_owner():
    s = spec(
        {
            "encoder_self": {
                "0": ["global", "band-1@0", "band-2@1"] + ["global"] * 5,
                "1": ["identity@0.2"] + ["global"] * 7,
            }
        }
    )
    assert owners(s, 0)[:3] == [None, (0, 0), (0, 0)]
    assert owners(s, 1)[0] == (0, 0)


def test_inline_yaml_and_file_and_canonical_json(tmp_path):
    inline = (
        "{encoder_self: {0-1: [band-1, band-2, global, global, global, global, global, global]}}"
    )
    a = spec(inline)
    path = tmp_path / "mine.yaml"
    path.write_text(
        "encoder_self:\n  0-1: band-1 band-2 global global global global global global\n"
    )
    b = spec(str(path))
    c = spec(a.to_json())
    for s in (a, b, c):
        assert masks(s, 1)[:2] == ["band-1", "band-2"] and masks(s, 2) == ["global"] * 8
    assert json.loads(a.to_json()) == a.config


def test_decoder_band_and_cross_tying_are_allowed():
    s = spec(
        {
            "decoder_self": {"all": ["band-2", "prev-1"] + ["global"] * 6},
            "decoder_cross": {"all": ["global"] + ["global@0"] * 7},
        }
    )
    assert masks(s, 5, "decoder_self")[:2] == ["band-2", "prev-1"]
    assert owners(s, 5, "decoder_cross") == [None] + [(5, 0)] * 7


@pytest.mark.parametrize(
    "config,message",
    [
        (
            {"encoder_self": {"all": ["bnd-2"] + ["global"] * 7}},
            r"layer 0 head 0: unknown mask 'bnd-2'",
        ),
        ({"encoder_self": {"all": ["band--2"] + ["global"] * 7}}, "negative window"),
        ({"encoder_self": {"all": ["global"] * 6}}, "lists 6 heads but the model has 8"),
        (
            {"encoder_self": {"all": ["band-1@9"] + ["global"] * 7}},
            "ties to head 9, which does not exist",
        ),
        (
            {"encoder_self": {"1": ["band-1@7.0"] + ["global"] * 7}},
            "ties to layer 7, which does not exist",
        ),
        ({"encoder_self": {"7": ["global"] * 8}}, "layer 7 does not exist; the model has 6 layers"),
        ({"encoder_self": {"0": ["global@1", "global@0"] + ["global"] * 6}}, "cycle"),
        ({"encoder_self": {"0": ["band-1@x"] + ["global"] * 7}}, "not H or L.H"),
        ({"encoder_self": {"0-2": ["global"] * 8, "2": ["global"] * 8}}, "given more than once"),
        ({"encoder_self": {"first": ["global"] * 8}}, "layer selector 'first'"),
        ({"decoder_self": {"0": ["next-1"] + ["global"] * 7}}, "future tokens"),
        (
            {"decoder_cross": {"0": ["band-1"] + ["global"] * 7}},
            "cross-attention heads can only be global",
        ),
        ({"encoder": {"0": ["global"] * 8}}, "unknown key"),
        ("no-such-preset", "neither a preset"),
    ],
)
def test_wrong_specs_are_rejected_with_the_problem_named(config, message):
    with pytest.raises(LocalitySpecError, match=message):
        spec(config)


# Each of these selects no layer or attention type (read literally, "2-0" is range(2, 1)): taken
# as given, the model would train the plain Transformer there without a word.
BAND = ["band-1"] * 8
BACKWARDS = "runs backwards and selects no layer"


@pytest.mark.parametrize(
    "config, message",
    [
        ({"encoder_self": {"2-0": BAND}},
         f"encoder_self layer 2-0: layer selector '2-0' {BACKWARDS}; write '0-2'"),
        ({"encoder_self": {"0,4-3": BAND}}, f"layer selector '0,4-3': the range '4-3' {BACKWARDS}"),
        ({"encoder_self": {"": BAND}}, "encoder_self layer : layer selector '' selects no layer"),
        ({"localness": {"layers": {"encoder_self": "2-0"}}},
         f"localness layers encoder_self: layer selector '2-0' {BACKWARDS}"),
        ({"localness": {"layers": {"decoder_self": ""}}},
         "localness layers decoder_self: layer selector '' selects no layer"),
        ({"dynamic_window": {"layers": {"encoder_self": "aw:5-1"}}},
         f"dynamic_window layers encoder_self: layer selector '5-1' {BACKWARDS}"),
        ({"dynamic_window": {"layers": {"encoder_self": "mw:"}}},
         "dynamic_window layers encoder_self: layer selector '' selects no layer"),
        ({"head_gates": {"attention": " , "}},
         "head_gates: attention ' , ' names no attention type"),
        ({"relative_positions": {"max_distance": 4, "attention": []}},
         "relative_positions: attention names no attention type"),
    ],
)  # fmt: skip
def test_selectors_that_select_nothing_are_refused(config, message):
    with pytest.raises(LocalitySpecError) as error:
        spec(config)
    assert message in str(error.value)


def test_layer_selectors_select_what_they_name():
    s = spec(
        {
            "encoder_self": {"0-1": ["band-1"] * 8, "3, 5": ["prev-1"] * 8},
            "localness": {"layers": {"decoder_self": "all"}},
            "dynamic_window": {"layers": {"decoder_cross": "aw:2 - 3"}},
        }
    )  # fmt: skip
    assert [masks(s, layer)[0] for layer in range(6)] == [
        "band-1", "band-1", "global", "prev-1", "global", "prev-1"
    ]  # fmt: skip
    assert all(h.gaussian for layer in range(6) for h in s.heads("decoder_self", layer))
    assert [s.heads("decoder_cross", layer)[0].window for layer in range(6)] == [
        None, None, "aw", "aw", None, None
    ]  # fmt: skip


def test_malformed_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("encoder_self: [unclosed\n")
    with pytest.raises(LocalitySpecError, match="not valid YAML"):
        spec(str(path))


@pytest.mark.parametrize(
    "mask", ["local-100000000000000000000", "band-9223372036854775808", "local-0-2147483648"]
)
def test_windows_beyond_the_limit_are_refused(mask):
    with pytest.raises(LocalitySpecError, match=f"{mask}.*at most {MAX_WINDOW}"):
        spec({"encoder_self": {"all": [mask] + ["global"] * 7}})


def test_the_largest_window_is_accepted():
    widest = [f"band-{MAX_WINDOW}", f"local-{MAX_WINDOW}-0"]
    s = spec({"encoder_self": {"all": widest + ["global"] * 6}})
    assert s.heads("encoder_self", 0)[0].bounds == (-MAX_WINDOW, MAX_WINDOW, False)
    with pytest.raises(LocalitySpecError, match="segment size must be at most"):
        spec({"encoder_self": {"all": [f"aw-seg{MAX_WINDOW + 1}"] + ["global"] * 7}})


def test_duplicate_yaml_keys_are_named_with_their_lines(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text(
        "encoder_self:\n"
        "  0: [band-1, global, global, global, global, global, global, global]\n"
        "  1: [global, global, global, global, global, global, global, global]\n"
        "  0: [band-2, global, global, global, global, global, global, global]\n"
    )
    first = r"twice.yaml: duplicate key 0 on line 4 \(first given on line 2\)"
    with pytest.raises(LocalitySpecError, match=first):
        spec(str(path))
    path.write_text("name: a\nencoder_self: {all: [global]}\nname: b\n")
    with pytest.raises(LocalitySpecError, match="duplicate key 'name' on line 3"):
        spec(str(path))
    with pytest.raises(LocalitySpecError, match="duplicate key 'encoder_self' on line 1"):
        spec("{encoder_self: {all: [global]}, encoder_self: {0: [global]}}")


# -- keep_layers: the spec of a model cut down by fairseq's *_layers_to_keep --------------------


def test_kept_layers_keep_their_heads_with_layer_wide_settings_and_ties_renumbered():
    s = LocalitySpec(
        {
            "encoder_self": {
                "3": ["band-1"] + ["global"] * 7,
                "4": ["global@3.0"] + ["prev-1"] * 7,
            },
            "localness": {"layers": {"encoder_self": "1-2,4"}},
            "dynamic_window": {"layers": {"encoder_self": "aw-seg:0,5"}},
            "heads_kept": {"encoder_self": [8, 8, 8, [0, 1], 8, 2]},
        },
        LAYERS,
        HEADS,
    )
    kept = s.keep_layers({"encoder_self": [5, 1, 3, 4]}, "encoder_layers_to_keep=1,3,4,5")
    assert kept.num_layers["encoder_self"] == 4
    for new, old in enumerate([1, 3, 4, 5]):
        old_heads = s.heads("encoder_self", old)
        new_heads = kept.heads("encoder_self", new)
        assert [(h.mask, h.gaussian, h.window, h.segment) for h in new_heads] == [
            (h.mask, h.gaussian, h.window, h.segment) for h in old_heads
        ]
        assert kept.kept_heads("encoder_self", new) == s.kept_heads("encoder_self", old)
    assert owners(kept, 1) == [None] * 8 and owners(kept, 2)[0] == (1, 0)
    assert kept.config["localness"]["layers"] == {"encoder_self": "0,2"}
    assert kept.config["dynamic_window"]["layers"] == {"encoder_self": "aw-seg:3"}
    assert kept.heads("decoder_self", 0) == s.heads("decoder_self", 0)
    # the stored form rebuilds the same spec
    again = LocalitySpec(json.loads(kept.to_json()), {**LAYERS, "encoder_self": 4}, HEADS)
    assert [again.heads("encoder_self", i) for i in range(4)] == [
        kept.heads("encoder_self", i) for i in range(4)
    ]


def test_keeping_a_borrower_without_its_owner_is_refused_naming_the_tie():
    s = spec("half-tied")
    with pytest.raises(LocalitySpecError, match="layer 1 head 0 uses the Wq/Wk of layer 0 head 0"):
        s.keep_layers({"encoder_self": [1, 2, 3]}, "encoder_layers_to_keep=1,2,3")
    assert owners(s.keep_layers({"encoder_self": [0, 2]}, "x"), 1)[0] == (0, 0)


def test_a_layer_holding_wq_wk_of_pruned_heads_for_removed_layers_is_refused():
    # layer 0's head 1 is pruned but its Wq/Wk stay for layer 1, which borrows them
    s = spec(
        {
            "encoder_self": {"1": ["global@0.1"] + ["global"] * 7},
            "heads_kept": {"encoder_self": [[0], 8, 8, 8, 8, 8]},
        }
    )
    assert s.qk_rows("encoder_self", 0) == (0, 1)
    with pytest.raises(LocalitySpecError, match=r"layer 0 holds the Wq/Wk of pruned heads \[1\]"):
        s.keep_layers({"encoder_self": [0, 2]}, "encoder_layers_to_keep=0,2")


@pytest.mark.parametrize(
    "layers, message",
    [([], "keeps no layer"), ([0, 0], "more than once"), ([6], "layer 6 does not exist")],
)
def test_kept_layers_are_checked(layers, message):
    with pytest.raises(LocalitySpecError, match=message):
        spec({}).keep_layers({"encoder_self": layers}, "encoder_layers_to_keep")
