"""``--config FILE.yaml``: every problem of the file exits with status 2 and one line naming
the file, the line and the key; what it holds is typed like the flags it stands for."""

import pytest

from loggra_megatron.arguments import build_parser, read_sections


def _read(tmp_path, text: str | bytes):
    config = tmp_path / "run.yaml"
    if isinstance(text, bytes):
        config.write_bytes(text)
    else:
        config.write_text(text)
    sections, _ = read_sections(build_parser(), ["--config", str(config)], host_files=False)
    return sections


def _refused(tmp_path, capsys, text: str | bytes) -> str:
    """The one line of stderr of a refused file (its path shortened to ``run.yaml``)."""
    with pytest.raises(SystemExit) as refused:
        _read(tmp_path, text)
    err = capsys.readouterr().err
    assert refused.value.code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("pretrain_rl.py: error: --config: "), err
    return err.strip().replace(str(tmp_path / "run.yaml"), "run.yaml")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "lr: 0.1\nseed: 3\n--lr: 0.2\n",
            "run.yaml:3: gives 'lr' (line 1) and '--lr' (line 3), both --lr: keep one",
        ),
        (
            "kl_coef: 0.1\nkl-coef: 0.2\n",
            "run.yaml:2: gives 'kl_coef' (line 1) and 'kl-coef' (line 2), both --kl-coef: keep one",
        ),
        ("lr: 0.1\nlr: 0.2\n", "run.yaml:2: gives 'lr' twice (lines 1 and 2): keep one"),
    ],
)
def test_a_flag_given_twice_in_any_spelling_is_refused(tmp_path, capsys, text, message):
    assert _refused(tmp_path, capsys, text).endswith(message)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("seed: 3\nkl_coef: yes\n", "run.yaml:2: 'kl_coef' must be a number, got the YAML "),
        ("num-layers: on\n", "run.yaml:1: 'num-layers' must be an integer, got the YAML "),
        ("wandb-project: no\n", "run.yaml:1: 'wandb-project' must be a string or null, got "),
    ],
)
def test_a_yaml_boolean_is_refused_for_a_flag_that_is_not_one(tmp_path, capsys, text, message):
    line = _refused(tmp_path, capsys, text)
    assert message in line and "boolean" in line and "quote" in line, line


def test_null_is_refused_where_the_flag_takes_no_none(tmp_path, capsys):
    line = _refused(tmp_path, capsys, "seed: 3\nkl_coef: null\n")
    assert line.endswith(
        "run.yaml:2: 'kl_coef' must be a number, got null; drop the key for the default"
    )
    sections = _read(tmp_path, "wandb_project: null\nkl_coef: 0.5\n")  # an optional flag: None
    assert sections["logging"].wandb_project is None and sections["grpo"].kl_coef == 0.5


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("seed: 3\n? [a, b]\n: 1\n", "run.yaml:2: a key must be a flag name, got a sequence"),
        ("{lr: 1}: 2\n", "run.yaml:1: a key must be a flag name, got a mapping"),
        ("lr: [0.1, 0.2]\n", "run.yaml:1: 'lr' must be a number, got a list"),
        ("lr: {a: 1}\n", "run.yaml:1: 'lr' must be a number, got a dict"),
        ("wandb-run-name: [a]\n", "run.yaml:1: 'wandb-run-name' must be a string or null, got"),
        ("num-layers: 2.5\n", "run.yaml:1: 'num-layers' must be an integer, got '2.5'"),
        ("lr: fast\n", "run.yaml:1: 'lr' must be a number, got 'fast'"),
        ("seed: 1\nlr: !!float abc\n", "run.yaml:2: 'lr' must be a number, got 'abc'"),
        ("seed: 1\nno-such-flag: 1\n", "run.yaml:2: unknown key 'no-such-flag': no flag "),
        ("- lr\n- 1\n", "run.yaml:1: must hold a mapping of flag names to values"),
        ("lr: [0.1,\nseed: 3\n", "run.yaml:3: is not valid YAML: expected ',' or ']'"),
        (b"seed: 1\nlr: 0.\xff\n", "run.yaml:2: is not UTF-8 text"),
        ("seed: 1\nlr: a\x01\n", "run.yaml:2: is not valid YAML: special characters"),
    ],
)
def test_keys_and_values_of_the_wrong_kind_name_their_line(tmp_path, capsys, text, message):
    line = _refused(tmp_path, capsys, text)
    assert message in line, line


def test_a_renamed_flag_is_hinted_as_on_the_command_line(tmp_path, capsys):
    line = _refused(tmp_path, capsys, "seed: 3\nkl-coef-target: 0.1\n")
    assert line.endswith("run.yaml:2: 'kl-coef-target' was renamed --kl-ref-target"), line
    line = _refused(tmp_path, capsys, "kl_coef_target: 0.1\n")
    assert line.endswith("run.yaml:1: 'kl_coef_target' was renamed --kl-ref-target"), line


def test_values_are_typed_like_the_flags(tmp_path):
    sections = _read(
        tmp_path,
        "lr: 1e-5\nbf16: true\nseed: 7.0\n--num-layers: 3\nkl-coef: 1\nwandb_run_name: 12\n",
    )
    assert sections["optimizer"].lr == 1e-5  # YAML 1.1 reads 1e-5 as text: converted
    assert sections["model"].bf16 is True and sections["model"].num_layers == 3
    assert sections["training"].seed == 7 and isinstance(sections["training"].seed, int)
    assert sections["grpo"].kl_coef == 1.0 and sections["logging"].wandb_run_name == "12"
    assert _read(tmp_path, "") == _read(tmp_path, "# nothing\n")  # an empty file: no settings
