import pytest

from speedrun.config import ConfigError, apply_overrides, parse_set_args
from speedrun.recipes.cifar import CifarConfig
from speedrun.records.settings_file import named_values


def test_overrides_are_parsed_by_type():
    cfg = apply_overrides(CifarConfig(), parse_set_args(
        ["batch_size=512", "epochs=3.5", "lookahead=false", "flip=random", "widths=32,64,64", "compile=on"]))
    assert cfg.batch_size == 512 and cfg.epochs == 3.5 and cfg.lookahead is False and cfg.compile is True
    assert cfg.flip == "random" and cfg.widths == (32, 64, 64)


def test_python_values_are_checked_too():
    assert apply_overrides(CifarConfig(), {"epochs": 2}).epochs == 2.0
    with pytest.raises(ValueError, match="batch_size"):
        apply_overrides(CifarConfig(), {"batch_size": 2.5})


@pytest.mark.parametrize("items,match", [
    (["batchsize=5"], "unknown config key 'batchsize'; valid keys: .*batch_size"),
    (["batch_size=big"], r"batch_size=big: expected int"),
    (["lookahead=maybe"], "expected a boolean"),
    (["flip=diagonal"], "expected one of none|random|alternating"),
    (["widths=a,b"], "comma-separated ints"),
])
def test_bad_overrides_raise_one_line_value_errors(items, match):
    with pytest.raises(ValueError, match=match) as info:
        apply_overrides(CifarConfig(), parse_set_args(items))
    assert "\n" not in str(info.value)


def test_set_needs_key_value():
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        parse_set_args(["lookahead"])


def test_validate_rejects_impossible_values():
    with pytest.raises(ValueError, match="tta_level"):
        apply_overrides(CifarConfig(), {"tta_level": 5}).validate()


@pytest.mark.parametrize("overrides,keys", [
    ({"batch_size": "big"}, ("batch_size",)),
    ({"nope": "1"}, ("nope",)),
    ({"lr_per_1024": "1e-9"}, ("lr_per_1024",)),
    ({"cpu_threads": "-1"}, ("cpu_threads",)),
    ({"half_weights": "on", "precision": "fp32"}, ("half_weights", "precision")),
    ({"tta_level": "5"}, ("tta_level",)),  # a range check carries its keys too
    ({"bn_eps": "0"}, ("bn_eps",)),  # not whiten_eps, which its message once named with it
    ({"muon_momentum": "1"}, ("muon_momentum",)),  # its message once said "momentum"
    ({"label_smoothing": "0.2", "jitter_contrast": "2"}, ("jitter_contrast",)),
])
def test_a_refused_setting_carries_its_keys(overrides, keys):
    with pytest.raises(ConfigError) as info:
        apply_overrides(CifarConfig(), overrides).validate()
    assert info.value.keys == keys


def test_a_settings_file_value_is_named_by_the_keys_an_error_carries():
    """The keys a ConfigError carries, not the words of its text: a list of valid keys names none of the file's;
    an error that carries none (a range check's) is read by its text as before."""
    settings = {"batch_size": "big", "eval_batch_size": "64", "compile": "true"}
    unknown = ConfigError("unknown config key 'nope'; valid keys: batch_size, compile, eval_batch_size", keys="nope")
    assert named_values(unknown, settings) == ""
    assert named_values(str(unknown), settings) == "batch_size=big, eval_batch_size=64, compile=true"
    assert named_values(ConfigError("batch_size=big: expected int", keys="batch_size"), settings) == "batch_size=big"
    assert named_values(ConfigError("bad config: eval_batch_size must be in [1, 65536]"), settings) == \
        "eval_batch_size=64"


def test_every_range_check_names_fields_of_its_config_and_fails_alone():
    """Each family's checks() carry keys that are its config's fields; each check fails for its own key alone."""
    import dataclasses

    from speedrun.recipes import RECIPES

    for recipe in RECIPES.values():
        cfg = recipe.make_config()
        fields = {f.name for f in dataclasses.fields(cfg)}
        checks = getattr(cfg, "checks", lambda: [])()
        assert all(ok for ok, _, _ in checks), recipe.name
        for _, message, keys in checks:
            keys = (keys,) if isinstance(keys, str) else keys
            assert keys and set(keys) <= fields, (recipe.name, message, keys)
            assert message.split()[0].strip(",") in keys or message.startswith("nesterov"), message


def test_imagenet_range_checks_carry_their_keys():
    from speedrun.recipes import get_recipe

    cfg = get_recipe("imagenet-debug").make_config()
    with pytest.raises(ConfigError) as info:
        apply_overrides(cfg, {"min_res_px": "64", "max_res_px": "32"}).validate()
    assert info.value.keys == ("min_res_px", "max_res_px")
