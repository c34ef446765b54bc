"""Strict config loading: defaults, overrides, fail-fast errors naming the key, CLI exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moespec.config import CONFIG_DIR, DEFAULTS, ConfigError, load_config, resolve_world

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
def test_shipped_configs_load(name):
    cfg = load_config(name)
    assert set(cfg) == set(DEFAULTS)
    assert cfg["n_routed_experts"] % cfg["ep"] == 0


def test_expected_configs_exist():
    names = {p.stem for p in CONFIG_DIR.glob("*.yaml")}
    assert {"tiny", "gpu_proxy", "deepseek_v2_lite", "deepseek_v2", "proxy_1t", "proxy_2t"} <= names


def test_deepseek_v2_lite_shapes_and_source():
    cfg = load_config("deepseek_v2_lite")
    assert (cfg["n_layers"], cfg["d_model"], cfg["n_routed_experts"], cfg["n_shared_experts"], cfg["top_k"],
            cfg["moe_d_ff"], cfg["kv_lora_rank"]) == (27, 2048, 64, 2, 6, 1408, 512)
    assert "huggingface.co/deepseek-ai/DeepSeek-V2-Lite" in (CONFIG_DIR / "deepseek_v2_lite.yaml").read_text()


def test_overrides_parse_yaml_values():
    cfg = load_config("tiny", ["lr=1e-2", "recompute_layer_ids=[0, 2]", "loss_fusion=true", "dp=null"])
    assert cfg["lr"] == 0.01 and cfg["recompute_layer_ids"] == [0, 2] and cfg["loss_fusion"] is True
    assert cfg["dp"] is None


@pytest.mark.parametrize("override,key", [
    ({"no_such_key": 1}, "no_such_key"),
    ({"ep": 3}, "ep"),                       # 8 experts not divisible by 3
    ({"top_k": 9}, "top_k"),                 # top_k > E
    ({"sync_free_level": 4}, "sync_free_level"),
    ({"grouped_gemm_backend": "cutlass"}, "grouped_gemm_backend"),
    ({"recompute_layer_ids": [7]}, "recompute_layer_ids"),
    ({"n_kv_heads": 3}, "n_kv_heads"),
    ({"topk_group": 3}, "topk_group"),
    ({"steps": "ten"}, "steps"),
    ({"data": "memmap"}, "data_path"),
])
def test_bad_config_fails_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", override)
    assert err.value.key == key
    assert key in str(err.value) and "\n" not in str(err.value)


def test_world_size_must_equal_dp_times_ep():
    cfg = load_config("tiny", {"ep": 2})
    assert resolve_world(cfg, 4) == (2, 2)
    with pytest.raises(ConfigError, match="ep"):
        resolve_world(cfg, 3)
    cfg = load_config("tiny", {"ep": 2, "dp": 2})
    with pytest.raises(ConfigError, match="dp"):
        resolve_world(cfg, 2)


def _run(*args):
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_cli_bad_config_prints_one_line_and_exits_2():
    r = _run("-m", "trainer", "--config", "tiny", "--set", "bogus=1", "-o", "/tmp/never")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["config error: bogus: unknown config key"]
    assert "Traceback" not in r.stderr


def test_launcher_checks_world_size_before_spawning():
    r = _run("-m", "trainer.launch", "--config", "tiny", "--nproc", "3", "--set", "ep=2", "-o", "/tmp/never")
    assert r.returncode == 2
    assert r.stderr.strip() == "config error: ep: world size 3 is not a multiple of ep = 2: no whole dp (dp*ep must be the world size)"
    r = _run("-m", "trainer.launch", "--config", "tiny", "--nproc", "2", "--sync-free-level", "9")
    assert r.returncode == 2 and "sync_free_level" in r.stderr


def test_launch_module_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None; import trainer.launch, moespec.config; "
            "print(trainer.launch.build_command(4, ['--config', 'tiny'])[1:5])")
    r = _run("-c", code)
    assert r.returncode == 0, r.stderr
    assert "torch.distributed.run" in r.stdout


def test_extends_merges_the_base_file_first(tmp_path):
    (tmp_path / "a.yaml").write_text("d_model: 64\nn_layers: 3\nsteps: 7\n")
    (tmp_path / "b.yaml").write_text("extends: a\nn_layers: 5\n")           # a name next to the file
    (tmp_path / "c.yaml").write_text(f"extends: {tmp_path / 'b.yaml'}\nsteps: 9\n")  # a path
    cfg = load_config(tmp_path / "c.yaml", ["steps=11"])
    assert (cfg["d_model"], cfg["n_layers"], cfg["steps"]) == (64, 5, 11)
    assert "extends" not in cfg


@pytest.mark.parametrize("files, words", [
    ({"a.yaml": "extends: b\n", "b.yaml": "extends: a\n"}, "the extends chain returns to this file (a.yaml -> b.yaml -> a.yaml)"),
    ({"a.yaml": "extends: nowhere_xyz\n"}, "file not found: nowhere_xyz"),
    ({"a.yaml": "extends: [1, 2]\n"}, "expected the name or path of another config"),
    ({f"f{i}.yaml": f"extends: f{i + 1}\n" for i in range(9)} | {"f9.yaml": "steps: 2\n"}, "more than 8 files"),
])
def test_bad_extends_is_one_line(tmp_path, files, words):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    first = sorted(files, key=lambda n: (len(n), n))[0]
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / first)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_gpu_proxy_train_is_gpu_proxy_at_the_training_regime():
    """The shipped training-regime config: gpu_proxy's values with its own on top, read here from the two
    YAML files directly."""
    yaml = pytest.importorskip("yaml")
    base = yaml.safe_load((CONFIG_DIR / "gpu_proxy.yaml").read_text())
    own = yaml.safe_load((CONFIG_DIR / "gpu_proxy_train.yaml").read_text())
    assert own.pop("extends") == "gpu_proxy"
    cfg = load_config("gpu_proxy_train", {"device": "auto"})
    for k, v in {**base, **own, "device": "auto"}.items():
        assert cfg[k] == v, k
    assert cfg["micro_batch_size"] * cfg["seq_len"] == 32768 and base["micro_batch_size"] * base["seq_len"] == 4096
