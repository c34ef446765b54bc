"""Pipeline layout strings (Megatron grammar), the automatic balanced layout and the pipeline config keys.

Pure Python, no torch: expected layouts are written out by hand.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moespec.config import ConfigError, load_config
from moespec.layout import (LayoutError, auto_layout, layer_costs, parse_layout, split_layout,
                                     uniform_layout)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("text, stages", [
    ("Et|tt|tt|tL", [["E", "t"], ["t", "t"], ["t", "t"], ["t", "L"]]),
    ("Et*3|(tt|)*2,tL", [["E", "t", "t", "t"], ["t", "t"], ["t", "t"], ["t", "L"]]),  # Megatron's example shape
    ("E,t|t,L", [["E", "t"], ["t", "L"]]),                      # commas are cosmetic
    ("(Et|)*1t*2L", [["E", "t"], ["t", "t", "L"]]),
    ("Et|*2tL", [["E", "t"], [], ["t", "L"]]),                  # '|*2' unrolls to '||' (grammar only)
    ("Et*0|tL", [["E"], ["t", "L"]]),                           # *0 repeats nothing, as in Megatron
    ("Et*12|L", [["E"] + ["t"] * 12, ["L"]]),                   # multi-digit counts
    ("  Et|tL ", [["E", "t"], ["t", "L"]]),                     # surrounding blanks ignored
])
def test_grammar_unrolls_like_megatron(text, stages):
    assert split_layout(text) == stages


def test_megatron_deepseek_v3_example_has_32_stages():
    # "Et*3|(tt|)*29,m|L" (DeepSeek-V3, PP16 x VPP2): 1 + 29 + 1 + 1 stages, 3 + 58 t, one m
    stages = split_layout("Et*3|(tt|)*29,m|L")
    assert len(stages) == 32
    assert sum(s.count("t") for s in stages) == 61 and stages[-2] == ["m"] and stages[-1] == ["L"]
    with pytest.raises(LayoutError, match="MTP layers"):
        parse_layout("Et*3|(tt|)*29,m|L", n_layers=61, pp=16, vpp=2)


@pytest.mark.parametrize("text, message", [
    ("Et|tx|L", "invalid character 'x'"),
    ("Et|(tt|tL", "unmatched '\\('"),
    ("Et|tt)|tL", "unmatched '\\)'"),
    ("E(t(t)*2)*2|L", "nested parentheses"),
    ("E(tt)|tL", "must be followed by '\\*<count>'"),
    ("E()*2t|tL", "empty group"),
    ("Et*|tL", "must be followed by a count"),
    ("*2Et|tL", "nothing to repeat"),
    ("", "non-empty layout string"),
])
def test_grammar_errors_are_one_line(text, message):
    with pytest.raises(LayoutError, match=message) as err:
        split_layout(text) if text else parse_layout(text, 2, 2)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text, n_layers, pp, vpp, message", [
    ("Et|tt|tL", 4, 2, 1, "3 stages but pp\\*vpp = 2\\*1 = 2"),
    ("Et|t|t|tL", 4, 2, 1, "4 stages but pp\\*vpp = 2\\*1 = 2 \\(with pp=2 it would mean vpp=2\\)"),
    ("Et|tt|tL", 5, 3, 1, "4 transformer layers \\('t'\\) but n_layers=5"),
    ("tE|ttL", 3, 2, 1, "'E' \\(embedding\\) must be the first piece of stage 0"),
    ("t|EttL", 3, 2, 1, "'E' \\(embedding\\) must be the first piece of stage 0, found in stage 1"),
    ("EtL|tt", 3, 2, 1, "'L' \\(loss\\) must be the last piece of the last stage \\(1\\), found in stage 0"),
    ("Et|tLL", 2, 2, 1, "exactly one 'L'"),
    ("EEt|tL", 2, 2, 1, "exactly one 'E'"),
    ("Ett||tL", 3, 3, 1, "stage 1 is empty"),
])
def test_layout_validation_errors(text, n_layers, pp, vpp, message):
    with pytest.raises(LayoutError, match=message) as err:
        parse_layout(text, n_layers, pp, vpp)
    assert str(err.value).startswith(repr(text)) and "\n" not in str(err.value)


def test_parsed_layout_numbers_layers_and_names_modules():
    lay = parse_layout("Ett|(tt|)*2ttL", n_layers=8, pp=2, vpp=2)
    assert lay.n_stages == 4
    assert lay.stage_layers == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.stage_modules[0] == ["embedding", "layer0", "layer1"]
    assert lay.stage_modules[3] == ["layer6", "layer7", "loss"]
    assert lay.to_string() == "Ett|tt|tt|ttL"
    assert parse_layout(lay.to_string(), 8, 4).stages == lay.stages  # round trip


def test_uniform_layout_and_its_divisibility_error():
    assert uniform_layout(8, 2, 2).to_string() == "Ett|tt|tt|ttL"
    with pytest.raises(LayoutError, match="n_layers=6 is not divisible by pp\\*vpp = 2\\*2 = 4"):
        uniform_layout(6, 2, 2)


def _cfg(**kw):
    return load_config("tiny", kw)


def test_layer_costs_by_hand():
    cfg = _cfg(n_layers=3, first_k_dense=1)  # tiny: d 64, 4 heads of 16, 2 KV heads, V 128, S 64
    e, layers, loss = layer_costs(cfg)
    attn = 6 * (64 * 64 * 2 + 2 * 64 * 2 * 16) + 3 * 64 * 4 * (16 + 16)
    dense = 6 * 3 * 64 * 128
    moe = 6 * ((2 + 1) * 3 * 64 * 32 + 64 * 8)  # top-2 + 1 shared expert of ff 32, gate 64x8
    assert e == 0 and loss == 6 * 64 * 128
    assert layers == [attn + dense, attn + moe, attn + moe]


def test_auto_layout_balances_the_flop_model():
    # 8 equal MoE layers on 4 stages: 2 each (the small head cost does not move a layer)
    assert auto_layout(_cfg(n_layers=8, first_k_dense=0), 4).to_string() == "Ett|tt|tt|ttL"
    # tiny's first layer is dense and heavier than the MoE layers: with 6 layers on 4 stages the
    # heavy layer stays alone on stage 0
    assert auto_layout(_cfg(n_layers=6), 4).to_string() == "Et|tt|tt|tL"


def test_auto_layout_from_measured_costs():
    cfg = _cfg(n_layers=6)
    # a slow last layer (5 ms vs 1 ms): 5 layers then 1 minimise the largest stage (5 ms)
    assert auto_layout(cfg, 2, costs=[1, 1, 1, 1, 1, 5]).to_string() == "Ettttt|tL"
    # embedding / loss costs given as the first and last of n_layers + 2 values
    assert auto_layout(cfg, 2, costs=[0, 1, 1, 1, 1, 1, 1, 3]).to_string() == "Etttt|ttL"
    with pytest.raises(LayoutError, match="n_layers=6 or n_layers\\+2=8 values"):
        auto_layout(cfg, 2, costs=[1, 2, 3])
    with pytest.raises(LayoutError, match="at least one transformer layer per stage"):
        auto_layout(_cfg(n_layers=3), 2, 2)


@pytest.mark.parametrize("overrides, key, message", [
    ({"pp": 4, "microbatches": 8}, "pipeline_layout", "n_layers=3 < pp\\*vpp = 4\\*1 = 4"),
    ({"pp": 2, "microbatches": 8, "pipeline_layout": "Et|tt|L"}, "pipeline_layout", "3 stages but pp\\*vpp"),
    ({"pp": 2, "microbatches": 8, "pipeline_layout": "Et|t(t|L"}, "pipeline_layout", "unmatched '\\('"),
    ({"pp": 2, "vpp": 2, "n_layers": 6, "microbatches": 8, "pipeline_schedule": "vpp",
      "pipeline_layout": "uniform"}, "pipeline_layout", "not divisible by pp\\*vpp = 2\\*2 = 4"),
    ({"pp": 4, "n_layers": 4, "microbatches": 3}, "microbatches", "microbatches=3 is fewer than the 4"),
    ({"pp": 2, "vpp": 2, "n_layers": 4, "microbatches": 8}, "pipeline_schedule", "vpp must be 1"),
    ({"pp": 2, "n_layers": 4, "microbatches": 4, "pipeline_schedule": "zbv"}, "vpp", "exactly 2 stages per rank"),
    ({"pp": 2, "vpp": 2, "n_layers": 4, "microbatches": 4, "pipeline_schedule": "zb1p"}, "dp_mode",
     "splits the backward"),
    ({"pp": 2, "vpp": 2, "n_layers": 4, "microbatches": 5, "pipeline_schedule": "vpp"}, "microbatches",
     "multiple of max\\(1, microbatches // pp\\) = 2"),
    ({"pp": 2, "microbatches": 4, "tie_embeddings": True}, "tie_embeddings", "pp > 1"),
    ({"vpp": 2}, "vpp", "needs pipeline parallelism"),
    ({"pipeline_layout": "Et|tL"}, "pipeline_layout", "needs pipeline parallelism"),
    ({"pp": 0}, "pp", "must be >= 1"),
    ({"microbatches": 0}, "microbatches", "must be >= 1"),
    ({"pp": 2, "microbatches": 2, "pipeline_schedule": "2f2b"}, "pipeline_schedule", "is not one of"),
    ({"pp": 2, "microbatches": 2, "pipeline_layer_costs": "fast"}, "pipeline_layer_costs", "list of numbers"),
    ({"pp": 2, "microbatches": 2, "pipeline_layer_costs": [1, 2]}, "pipeline_layer_costs", "n_layers=3"),
])
def test_pipeline_config_errors_name_the_key(overrides, key, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config("tiny", overrides)
    assert err.value.key == key and "\n" not in str(err.value)


def test_pipeline_config_accepts_good_layouts():
    cfg = load_config("tiny", {"pp": 2, "microbatches": 4, "pipeline_layout": "Et|ttL"})
    assert cfg["pipeline_layout"] == "Et|ttL"
    load_config("tiny", {"pp": 2, "vpp": 2, "n_layers": 4, "microbatches": 8, "pipeline_schedule": "zbv",
                         "dp_mode": "ddp"})


def test_world_size_includes_pp():
    from moespec.config import resolve_world

    cfg = load_config("tiny", {"pp": 2, "n_layers": 4, "microbatches": 4})
    assert resolve_world(cfg, 4) == (2, 1)
    with pytest.raises(ConfigError, match=r"world size 3 is not a multiple of pp\*ep = 2\*1: no whole dp \(pp\*dp\*ep"):
        resolve_world(cfg, 3)
    with pytest.raises(ConfigError, match=r"world size 4 != pp\*dp\*ep = 2\*1\*1"):  # a dp given that the world does not hold
        resolve_world({**cfg, "dp": 1}, 4)


def test_cli_flags_and_launcher_reject_bad_layout_in_one_line():
    r = subprocess.run([sys.executable, "-m", "trainer.launch", "--config", "tiny", "--nproc", "2", "--pp", "2",
                        "--microbatches", "4", "--pipeline-layout", "Et|tt"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip() == "config error: pipeline_layout: 'Et|tt': needs exactly one 'L' (loss), found 0"
