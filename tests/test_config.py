import pytest
import yaml

from captioning.config import (
    Config,
    config_from_dict,
    config_to_dict,
    load_config,
    save_config,
)
from captioning.errors import ConfigError


def test_defaults_are_paper_settings():
    cfg = Config()
    assert cfg.model.attention == "soft"
    assert cfg.model.score == "additive"
    assert cfg.model.gate == "scalar"
    assert cfg.model.deep_output is True
    assert cfg.model.init_state == "tanh"
    assert cfg.train.doubly_stochastic_weight == 1.0
    assert cfg.train.baseline_decay == 0.9
    assert cfg.train.semi_sampling_p == 0.5


def test_yaml_holds_differences_and_overrides_win(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  epochs: 7\n  lr: 1e-3\nmodel:\n  attention: hard\n")
    cfg = load_config(path, ["train.epochs=3", "data.root=/somewhere/else"])
    assert cfg.train.epochs == 3
    assert cfg.train.lr == pytest.approx(1e-3)  # YAML reads 1e-3 as a string: coerced
    assert cfg.model.attention == "hard"
    assert cfg.data.root == "/somewhere/else"
    assert cfg.train.batch_size == Config().train.batch_size


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.epoch=3", "did you mean train.epochs"),
        ("trian.epochs=3", "did you mean train"),
        ("epochs=3", "did you mean train.epochs"),
        ("model.attention=hrad", "did you mean 'hard'"),
        ("train.epochs=three", "must be an integer"),
        ("train.lr=fast", "must be a number"),
        ("model.deep_output=maybe", "true or false"),
        ("model.fine_tune=last2", "last_N"),
        ("train.epochs=0", "at least 1"),
        ("noequals", "section.key=value"),
    ],
)
def test_bad_keys_and_values_name_the_problem(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_unknown_key_in_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("decode:\n  beam_sise: 3\n")
    with pytest.raises(ConfigError, match="decode.beam_sise; did you mean decode.beam_size"):
        load_config(path)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("3\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(scalar)


def test_union_and_container_types():
    cfg = load_config(None, ["data.max_images=10", "data.categories=[dog, cat]"])
    assert cfg.data.max_images == 10 and cfg.data.categories == ["dog", "cat"]
    cfg = load_config(None, ["data.max_images={train: 5, val: 2}", "model.grid_size=null"])
    assert cfg.data.max_images == {"train": 5, "val": 2} and cfg.model.grid_size is None
    with pytest.raises(ConfigError):
        load_config(None, ["data.max_images=many"])


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(None, ["train.epochs=2", "model.positional=learned"])
    save_config(cfg, tmp_path / "config.yaml")
    again = config_from_dict(yaml.safe_load((tmp_path / "config.yaml").read_text()))
    assert again == cfg
    assert config_to_dict(again)["model"]["positional"] == "learned"


def test_shipped_configs_load():
    from pathlib import Path

    configs = sorted(Path(__file__).parent.parent.glob("configs/*.yaml"))
    assert configs, "no configs shipped"
    for path in configs:
        load_config(path)
