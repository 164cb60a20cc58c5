import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from captioning.config import (
    Config,
    ModelConfig,
    config_from_dict,
    config_to_dict,
    load_config,
    save_config,
)
from captioning.errors import ConfigError

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


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
        ("model.gate=scaler", "did you mean 'scalar'"),
        ("train.epochs=three", "must be an integer"),
        ("train.lr=fast", "must be a number"),
        ("model.deep_output=maybe", "true or false"),
        ("model.fine_tune=last2", "last_N"),
        ("train.epochs=0", "at least 1"),
        ("noequals", "section.key=value"),
        ("train.label_smoothing=1", r"in \[0, 1\)"),
    ],
)
def test_bad_keys_and_values_name_the_problem(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize("setting", ["model.attention=hard", "train.objective=scst"])
def test_label_smoothing_is_refused_where_it_would_be_ignored(setting):
    with pytest.raises(ConfigError, match="label_smoothing smooths the cross-entropy"):
        load_config(None, ["train.label_smoothing=0.1", setting])


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


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.log_every=0", "train.log_every must be at least 1, got 0"),
        ("train.lr_factor=1.5", "train.lr_factor must be in (0, 1), got 1.5"),
        ("train.lr_factor=1", "train.lr_factor must be in (0, 1), got 1.0"),
        ("data.num_workers=-1", "data.num_workers must be at least 0, got -1"),
        ("train.threads=-2", "train.threads must be at least 1, got -2"),
        ("train.lr=-1", "train.lr must be more than 0, got -1.0"),
        ("train.lr=nan", "train.lr must be more than 0, got nan"),
        ("train.encoder_lr=-1e-4", "train.encoder_lr must be at least 0, got -0.0001"),
        ("data.max_images=-5", "data.max_images must be at least 1, got -5"),
        ("data.max_images={train: 0}", "data.max_images must be at least 1, got {'train': 0}"),
        ("model.cnn_channels=[8, 0]", "model.cnn_channels must be at least 1, got [8, 0]"),
        ("model.cnn_channels=[]", "model.cnn_channels must list at least one channel count"),
        (
            "model.cnn_channels=[16, 8]",
            "model.cnn_block=preact needs model.cnn_channels that "
            "never shrink, got [16, 8]; widen the later entries or use model.cnn_block=residual",
        ),
        ("model.dropout=1", "model.dropout must be in [0, 1), got 1.0"),
        ("decode.temperature=0", "decode.temperature must be more than 0, got 0.0"),
        ("decode.min_length=30", "decode.min_length=30 must not exceed decode.max_length=20"),
        ("train.seed=-3", "train.seed must be in [0, 9223372036854775807], got -3"),
        ("train.device=tpu9", "train.device must be auto, cpu, cuda, cuda:N or mps, got 'tpu9'"),
        ("train.grad_clip=-1", "train.grad_clip must be at least 0, got -1.0"),
        ("data.max_caption_length=0", "data.max_caption_length must be at least 1, got 0"),
        ("model.grid_layers=-1", "model.grid_layers must be at least 0, got -1"),
    ],
)
def test_every_numeric_key_has_a_range(override, message):
    with pytest.raises(ConfigError) as caught:
        load_config(None, [override])
    assert str(caught.value) == message


def test_every_numeric_key_is_in_the_range_table():
    import dataclasses
    import typing

    from captioning.config import _RANGES, Config

    numeric = set()
    for section in dataclasses.fields(Config):
        for name, tp in typing.get_type_hints(section.default_factory).items():
            if {int, float} & {tp, *typing.get_args(tp), *map(typing.get_origin, [tp])}:
                numeric.add(f"{section.name}.{name}")
            elif any(int in typing.get_args(a) for a in typing.get_args(tp)):
                numeric.add(f"{section.name}.{name}")  # list[int] | None, dict[str, int]
    numeric.discard("data.subset_seed")  # any integer seeds random.Random
    assert numeric <= set(_RANGES), sorted(numeric - set(_RANGES))


def test_a_section_given_as_a_scalar_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train: [1, 2]\n")
    with pytest.raises(
        ConfigError, match=r"section 'train' must be a mapping of keys, got \[1, 2\]"
    ):
        load_config(path, ["train.quiet=true"])
    path.write_text("train:\nmodel: {hidden_dim: 8}\n")  # an empty section is no section
    assert load_config(path).model.hidden_dim == 8


def test_a_yaml_alias_bomb_is_refused_in_one_short_line(tmp_path):
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for name, previous in zip("bcdefg", "abcdef"):
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{previous}"] * 9) + "]")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines + ["train: {epochs: *g}"]) + "\n")
    assert path.stat().st_size < 600
    with pytest.raises(ConfigError, match="holds more than 100,000 values") as caught:
        load_config(path)
    assert len(str(caught.value)) < 200
    with pytest.raises(ConfigError, match="holds more than 100,000 values"):
        load_config(
            None,
            [
                "train.epochs="
                + "\n".join(lines[:6]).replace("\n", ", ").replace("a: ", "{a: ", 1)
                + "}"
            ],
        )


def test_error_messages_quote_values_within_bounds():
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["train.epochs=" + "x" * 100_000])
    assert len(str(caught.value)) < 200
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["train.epochs=[" + ", ".join(["[1, 2, 3]"] * 10_000) + "]"])
    assert len(str(caught.value)) < 200


def test_a_utf16_config_file_is_read(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  epochs: 3\n", encoding="utf-16")
    assert load_config(path).train.epochs == 3
    path.write_bytes(b"train:\n  epochs: \xff\xfe3\n")
    with pytest.raises(ConfigError, match="is not UTF-8"):
        load_config(path)


def test_an_image_size_too_small_for_the_encoder_is_a_config_error():
    from captioning.models import build_model

    cfg = load_config(CONFIGS / "test_tiny.yaml", ["model.image_size=2"])
    with pytest.raises(ConfigError, match="model.image_size=2 is too small for this encoder"):
        build_model(cfg.model, 10)


def test_a_config_extends_the_base_it_names(tmp_path):
    (tmp_path / "bases").mkdir()
    (tmp_path / "bases" / "root.yaml").write_text(
        "model:\n  encoder: small_cnn\n  hidden_dim: 64\n  dropout: 0.2\ntrain:\n  lr: 1e-3\n"
    )
    (tmp_path / "bases" / "middle.yaml").write_text(
        "base: root.yaml\nmodel:\n  hidden_dim: 96\ndecode:\n  beam_size: 5\n"
    )
    (tmp_path / "stage.yaml").write_text("base: bases/middle.yaml\ntrain:\n  epochs: 3\n")
    cfg = load_config(tmp_path / "stage.yaml", ["model.dropout=0.4"])
    # the file's own keys win over its base's, which win over theirs; overrides win last
    assert cfg.model.encoder == "small_cnn" and cfg.model.hidden_dim == 96
    assert cfg.train.lr == 1e-3 and cfg.train.epochs == 3 and cfg.decode.beam_size == 5
    assert cfg.model.dropout == 0.4
    # a key of the base that the file does not name keeps the base's value, not the default
    assert cfg.model.embed_dim == ModelConfig().embed_dim


@pytest.mark.parametrize(
    "files, message",
    [
        ({"a.yaml": "base: b.yaml\n", "b.yaml": "base: a.yaml\n"}, "its bases come back to"),
        ({"a.yaml": "base: a.yaml\n"}, "its bases come back to"),
        ({"a.yaml": "base: missing.yaml\n"}, "its base missing.yaml .* does not exist"),
        ({"a.yaml": "base: [b.yaml, 3]\n", "b.yaml": ""}, "base must be the path of a config file"),
        ({"a.yaml": "base: []\n"}, "base must be the path of a config file or a list"),
        (
            {"a.yaml": "base: [b.yaml]\n", "b.yaml": "base: [c.yaml, a.yaml]\n", "c.yaml": ""},
            "its bases come back to",
        ),
        (
            {"a.yaml": "base: b.yaml\n", "b.yaml": "model:\n  hiden_dim: 3\n"},
            "unknown config key model.hiden_dim",
        ),
    ],
)
def test_a_broken_base_is_one_line_that_names_it(tmp_path, files, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=message) as caught:
        load_config(tmp_path / "a.yaml")
    assert "\n" not in str(caught.value)


def write_bases(path, bases):
    """A config file at ``path`` that is only ``bases``: what a config's bases give it."""
    path = Path(path)
    path.write_text(yaml.safe_dump({"base": bases}))
    return path


def test_a_config_merges_the_list_of_bases_it_names_in_order(tmp_path):
    (tmp_path / "data.yaml").write_text(
        "data:\n  root: here\n  min_count: 3\nmodel:\n  dropout: 0.1\n"
    )
    (tmp_path / "model.yaml").write_text("model:\n  hidden_dim: 96\n  dropout: 0.2\n")
    (tmp_path / "stage.yaml").write_text("train:\n  epochs: 3\n  lr: 1e-4\n")
    (tmp_path / "run.yaml").write_text(
        "base: [data.yaml, model.yaml, stage.yaml]\ntrain:\n  lr: 5e-5\n"
    )
    cfg = load_config(tmp_path / "run.yaml")
    assert (cfg.data.root, cfg.data.min_count, cfg.model.hidden_dim) == ("here", 3, 96)
    assert cfg.model.dropout == 0.2  # a later base wins over an earlier one
    assert (cfg.train.epochs, cfg.train.lr) == (3, 5e-5)  # and the file over them all
    # a diamond (two bases that share one) is no loop
    (tmp_path / "top.yaml").write_text("base: [run.yaml, data.yaml]\n")
    assert load_config(tmp_path / "top.yaml").model.dropout == 0.1


def test_every_shipped_config_resolves_as_recorded():
    """Each file of configs/ resolves to what tests/data/resolved_configs.json records: a
    change to a base that reaches a recipe shows here, recipe by recipe (regenerate the
    file with the recipes' new values when the change is meant)."""
    configs = Path(__file__).parent.parent / "configs"
    recorded = json.loads((Path(__file__).parent / "data" / "resolved_configs.json").read_text())
    resolved = {p.name: config_to_dict(load_config(p)) for p in sorted(configs.glob("*.yaml"))}
    assert resolved.keys() == recorded.keys()
    for name, values in resolved.items():
        assert values == recorded[name], name


def test_each_second_stage_keeps_its_first_stages_model(tmp_path):
    """--init refuses another architecture: a stage that extends its first stage must
    resolve to the same model section, and its data to the same data."""
    from pathlib import Path

    configs = Path(__file__).parent.parent / "configs"
    pairs = [
        ("photos_scst", "photos_xe"),
        ("flickr8k_scst", "flickr8k_mobilenet"),
        ("flickr8k_hard_exact", "flickr8k_hard"),
        ("flickr8k_best_scst", "flickr8k_best"),
    ]
    for stage, first in pairs:
        a, b = load_config(configs / f"{stage}.yaml"), load_config(configs / f"{first}.yaml")
        assert a.model == b.model and a.data == b.data, stage
    soft, hard = (load_config(configs / f"flickr8k_{n}.yaml") for n in ("mobilenet", "hard"))
    assert hard.model.attention == "hard" and soft.model.attention == "soft"
    assert dataclasses.replace(hard.model, attention="soft") == soft.model
    # no shipped recipe repeats its base: every key it sets changes the base's value
    for path in configs.glob("*.yaml"):
        own = yaml.safe_load(path.read_text())
        if "base" not in own:
            continue
        bases = own.pop("base")
        bases = [bases] if isinstance(bases, str) else bases
        absolute = [str((path.parent / b).resolve()) for b in bases]
        base = config_to_dict(load_config(write_bases(tmp_path / path.name, absolute)))
        resolved = config_to_dict(load_config(path))
        for section, keys in own.items():
            for key in keys:
                assert resolved[section][key] != base[section][key], (
                    f"{path.name} repeats its base's {section}.{key}"
                )


def test_the_retired_suppress_unk_key_names_its_replacement(tmp_path):
    with pytest.raises(ConfigError, match="replaced by decode.allow_unk"):
        load_config(None, ["decode.suppress_unk=true"])
    assert not load_config(None).decode.allow_unk
    assert load_config(None, ["decode.allow_unk=true"]).decode.allow_unk
