import pytest

from speedrun.config import apply_overrides, parse_set_args
from speedrun.recipes.cifar import CifarConfig


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
