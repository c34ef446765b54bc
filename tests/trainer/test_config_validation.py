"""Bad configs end in one line naming the key, exit 2, before anything is built: impossible numbers,
unbounded sizes, layout strings that would unroll without end, and YAML that is not plain data."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from moespec.config import ConfigError, load_config
from moespec.layout import MAX_UNROLLED, LayoutError, auto_layout, parse_layout, split_layout

REPO = Path(__file__).resolve().parents[2]
PP2 = ["--set", "pp=2", "--set", "n_layers=4", "--set", "microbatches=2"]


def _files(d: Path) -> dict[str, Path]:
    files = {
        # a YAML tag that would run a command under yaml.load (never under safe_load)
        "python_tag.yaml": f'vocab_size: !!python/object/apply:os.system ["touch {d / "PWNED"}"]\n',
        "python_name.yaml": "lr: !!python/name:os.system\n",
        "binary_value.yaml": 'vocab_size: !!binary "AAAA"\n',
        "unclosed.yaml": "lr: [1\nseed: 3\n",
        "tabs.yaml": "lr:\t1\n\t- x\n",
        "list.yaml": "- lr\n- 3\n",
        "deep.yaml": "lr: " + "[" * 5000 + "]" * 5000 + "\n",
        "laughs.yaml": f"env: {{A: {LAUGHS}}}\n",
    }
    out = {}
    for name, text in files.items():
        out[name] = d / name
        out[name].write_text(text)
    out["random.yaml"] = d / "random.yaml"
    out["random.yaml"].write_bytes(bytes([0x86, 0xFF, 0x00, 0x13]) * 64)
    return out


# a "billion laughs" value: 9 levels of 9 aliases of the level below, 387,420,489 leaves in ~400 bytes
LAUGHS = "[&a [" + ",".join(["lol"] * 9) + "], " + ", ".join(
    f"&{n} [" + ",".join([f"*{p}"] * 9) + "]" for p, n in zip("abcdefgh", "bcdefghi")) + "]"


# (arguments after --config, key named in the error)
CASES = [
    (["tiny", "--set", "lr=-1"], "lr"),
    (["tiny", "--set", "lr=.nan"], "lr"),
    (["tiny", "--set", "lr=nan"], "lr"),
    (["tiny", "--set", "lr=.inf"], "lr"),
    (["tiny", "--set", "lr=1e400"], "lr"),
    (["tiny", "--set", "vocab_size=100000000000000000000"], "vocab_size"),
    (["tiny", "--set", "vocab_size=1e20"], "vocab_size"),
    (["tiny", "--set", "seed=-1"], "seed"),
    (["tiny", "--set", f"seed={2**70}"], "seed"),
    (["tiny", "--set", "d_model=.nan"], "d_model"),
    (["tiny", "--set", "micro_batch_size=1000000000000"], "micro_batch_size"),
    (["tiny", "--set", "adam_beta1=1.5"], "adam_beta1"),
    (["tiny", "--set", "rope_theta=0"], "rope_theta"),
    (["tiny", "--set", "recompute_layer_ids=[0,0]"], "recompute_layer_ids"),
    (["tiny", "--set", "env={A: [1]}"], "env"),
    (["tiny", "--set", "lr=!!python/name:os.system"], "lr"),
    (["tiny", "--set", "lr=[1"], "lr"),
    (["tiny", *PP2, "--set", "pipeline_layout=Et|(tt|)*1000000000L"], "pipeline_layout"),
    (["tiny", *PP2, "--set", "pipeline_layout=E*99999999999999999999"], "pipeline_layout"),
    (["tiny", *PP2, "--set", "pipeline_layout=(t*99999999|)*99999999"], "pipeline_layout"),
    (["tiny", *PP2, "--set", "pipeline_layout=Et|((t)|tL"], "pipeline_layout"),
    (["tiny", *PP2, "--set", "pipeline_layout=Et|tt)|tL"], "pipeline_layout"),
    (["tiny", *PP2, "--set", "pipeline_layout=Et|t*|tL"], "pipeline_layout"),
    (["tiny", *PP2, "--set", "pipeline_layer_costs=[1, .nan, 1, 1]"], "pipeline_layer_costs"),
    (["tiny", "--set", "pp=100", "--set", "n_layers=5000", "--set", "microbatches=100", "--set", "dp_mode=ddp"],
     "pipeline_layout"),
    (["@python_tag.yaml"], "config"),
    (["@python_name.yaml"], "config"),
    (["@binary_value.yaml"], "vocab_size"),
    (["@unclosed.yaml"], "config"),
    (["@tabs.yaml"], "config"),
    (["@list.yaml"], "config"),
    (["@deep.yaml"], "config"),
    (["@random.yaml"], "config"),
    (["/dev/zero"], "config"),
    (["@"], "config"),  # a directory
    (["tiny", "--set", "seed=" + "9" * 5000], "seed"),  # an integer PyYAML cannot convert (a bare ValueError)
    (["tiny", "--set", "recompute_layer_ids=" + LAUGHS], "recompute_layer_ids"),  # billion laughs: 9**9 leaves
    (["@laughs.yaml"], "config"),
]


def _argv(tmp_path: Path, args: list[str]) -> list[str]:
    files = _files(tmp_path)
    args = [str(files[a[1:]]) if a.startswith("@") and a[1:] in files else (str(tmp_path) if a == "@" else a)
            for a in args]
    return ["--nproc", "1", "--config", *args, "-o", str(tmp_path / "run")]


def _check_one_line(tmp_path, rc, out, err, key):
    lines = err.strip().splitlines()
    assert rc == 2, err[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"config error: {key}: "), err[-2000:]
    assert "Traceback" not in err and out == ""
    assert len(lines[0]) < 600
    assert not (tmp_path / "PWNED").exists()  # no YAML tag ran anything
    assert not (tmp_path / "run").exists()  # rejected before the run dir was touched


@pytest.mark.parametrize("args, key", CASES, ids=[" ".join(a)[-60:] for a, _ in CASES])
def test_bad_config_is_one_line_exit_2(tmp_path, capsys, args, key):
    from trainer.launch import main

    t0 = time.process_time()  # this process's CPU time: what other processes on the machine do not change
    rc = main(_argv(tmp_path, args))
    assert time.process_time() - t0 < 10  # bounded: no multi-GB unrolling, no hang
    out, err = capsys.readouterr()
    _check_one_line(tmp_path, rc, out, err, key)


SUBPROCESS = [CASES[0], CASES[5], CASES[8], CASES[17], CASES[25], CASES[32]]


@pytest.mark.parametrize("args, key", SUBPROCESS, ids=[" ".join(a)[-60:] for a, _ in SUBPROCESS])
def test_bad_config_exits_2_from_the_command_line(tmp_path, args, key):
    r = subprocess.run([sys.executable, "-m", "trainer.launch", *_argv(tmp_path, args)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    _check_one_line(tmp_path, r.returncode, r.stdout, r.stderr, key)


def test_bad_config_under_torchrun_is_rejected_before_it_starts(tmp_path):
    r = subprocess.run([sys.executable, "-m", "trainer.launch", "--nproc", "2", "--config", "tiny", "--set", "lr=.nan",
                        "-o", str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == ["config error: lr: must be a finite number, got nan"]


@pytest.mark.parametrize("key, value", [
    ("lr", 0.0), ("weight_decay", 0.1), ("adam_beta2", 0.999), ("seed", 2**63 - 1), ("grad_clip", 0.0),
    ("vocab_size", 2**17), ("init_std", 0.0),
])
def test_values_inside_the_bounds_are_accepted(key, value):
    assert load_config("tiny", {key: value})[key] == value


def test_the_shipped_configs_are_inside_the_bounds():
    for f in sorted((REPO / "trainer" / "configs").glob("*.yaml")):
        load_config(f)


@pytest.mark.parametrize("text", [
    "Et|(tt|)*1000000000L", "E*99999999999999999999", "(t*99999999|)*99999999", "t*" + "9" * 5000,
    "Et|" + "t" * (MAX_UNROLLED + 1) + "|L", "(" + "t" * 1000 + "|)*2000",
])
def test_layout_unrolling_is_bounded(text):
    t0 = time.thread_time()  # this thread's CPU time: neither other processes nor a worker's other threads count
    with pytest.raises(LayoutError) as e:
        split_layout(text)
    assert time.thread_time() - t0 < 1.0
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400


def test_layout_grammar_still_unrolls():
    assert parse_layout("Et|(tt|)*2tL", 6, 4).to_string() == "Et|tt|tt|tL"
    assert parse_layout("E,t*3|t*3L", 6, 2).to_string() == "Ettt|tttL"


def test_auto_layout_refuses_a_search_too_large_to_finish():
    cfg = load_config("tiny")
    cfg = {**cfg, "n_layers": 5000}
    t0 = time.thread_time()
    with pytest.raises(LayoutError, match="too large to search"):
        auto_layout(cfg, 100, 1)
    assert time.thread_time() - t0 < 1.0


def test_config_error_is_a_value_error_naming_the_key():
    with pytest.raises(ConfigError) as e:
        load_config("tiny", {"lr": float("inf")})
    assert e.value.key == "lr" and str(e.value) == "config error: lr: must be a finite number, got inf"


@pytest.mark.parametrize("text", ["[]\n", "false\n", "0\n", "''\n"])
def test_a_config_file_that_is_not_a_mapping_is_refused_even_when_falsy(tmp_path, capsys, text):
    """A config file holding `[]`, `false`, `0` or `''` was read as an empty mapping: the run trained the
    defaults (exit 0). Like any other non-mapping (`- a`) it is refused; an empty file still means no keys."""
    from trainer.launch import main

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(text)
    rc = main(["--config", str(cfg), "-o", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    assert rc == 2 and err == f"config error: config: {cfg} must hold a mapping\n" and out == ""
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_tracelens_memory_refuses_a_falsy_config_file_in_one_line(tmp_path):
    from click.testing import CliRunner

    from tracelens.cli import main

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("[]\n")
    res = CliRunner().invoke(main, ["memory", str(cfg)])
    assert res.exit_code == 2, res.output
    assert res.stderr == f"tracelens: error: {cfg}: config error: config: {cfg} must hold a mapping\n"
