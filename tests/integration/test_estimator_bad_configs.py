"""tools/estimate_memory.py on garbage Hugging Face configs: each exits 2
in about a second with a message naming the field, never a traceback or a table."""

import json
import os
import time
from pathlib import Path

import pytest
import warm_launch

ROOT = str(Path(__file__).resolve().parents[2])
with open(os.path.join(ROOT, "tools", "configs", "llama-style-27b.json")) as _f:
    BASE = json.load(_f)
FLAGS = ["--world-size", "8", "--tensor-model-parallel-size", "8"]


def _estimate(tmp_path, config_text: str, *extra):
    path = tmp_path / "config.json"
    path.write_text(config_text)
    argv = ["--hf-config", str(path), *FLAGS, *extra]
    return warm_launch.run("tools/estimate_memory.py", argv, timeout=120)


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({**BASE, "num_attention_heads": 0}, "num_attention_heads=0 must be a whole number"),
        ({**BASE, "num_key_value_heads": 0}, "num_key_value_heads=0 must be a whole number"),
        ({**BASE, "hidden_size": "3584"}, "hidden_size='3584' must be a whole number"),
        ({**BASE, "hidden_size": 1e30}, "hidden_size=1e+30 must be a whole number"),
        ({**BASE, "rms_norm_eps": 2.0}, "norm_epsilon must be in (0, 1)"),
        ([1, 2], "holds a JSON object, not a list"),
        ({**BASE, "num_hidden_layers": 5000}, "num_layers must be at most 4096"),
        ({**BASE, "tie_word_embeddings": "false"}, "tie_word_embeddings='false' must be true"),
    ],
    ids=["heads0", "kv-heads0", "string", "huge", "eps", "list", "layers", "tied-string"],
)
def test_a_garbage_config_exits_2_naming_the_field(tmp_path, config, needle):
    t0 = time.perf_counter()
    r = _estimate(tmp_path, json.dumps(config), "--fit")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert time.perf_counter() - t0 < 60


def test_a_nan_rope_theta_is_refused(tmp_path):
    rest = {k: v for k, v in BASE.items() if k != "rope_theta"}
    r = _estimate(tmp_path, json.dumps(rest)[:-1] + ', "rope_theta": NaN}')
    assert r.returncode == 2 and "rotary_base must be a finite positive number" in r.stderr


def test_a_key_given_twice_is_refused(tmp_path):
    r = _estimate(tmp_path, json.dumps(BASE)[:-1] + ', "hidden_size": 4096}')
    assert r.returncode == 2 and "key 'hidden_size' appears twice" in r.stderr, r.stderr


def test_sequence_packing_says_why_it_changes_no_term(tmp_path):
    plain = _estimate(tmp_path, json.dumps(BASE), "--bf16", "--transformer-impl", "local")
    assert plain.returncode == 0, plain.stderr
    assert "--sequence-packing changes no term" not in plain.stdout
    flags = ("--bf16", "--transformer-impl", "transformer_engine", "--sequence-packing")
    packed = _estimate(tmp_path, json.dumps(BASE), *flags)
    assert packed.returncode == 0, packed.stderr
    assert "--sequence-packing changes no term above" in packed.stdout
