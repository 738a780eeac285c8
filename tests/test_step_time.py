"""benchmarks/step_time.py: variants built from the recipe's config, interleaved timing, report, errors."""

import json

import pytest

from conftest import load_benchmark

st = load_benchmark("step_time")

TINY = ["--device", "cpu", "--batch-size", "8", "--steps", "3"]


def test_two_variants_end_to_end(tmp_path, capsys):
    out = tmp_path / "st.json"
    rc = st.main(TINY + ["--variant", "widths=8,16,16 channels_last=off",
                         "--variant", "widths=8,16,16 channels_last=on precision=fp32", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    first, second = report["variants"]
    assert first["resolved"] == "widths=8,16,16 channels_last=off [fp32, NCHW]"
    assert second["resolved"].endswith("[fp32, NHWC]")
    for v in (first, second):
        assert len(v["seconds"]) == 3 and all(s > 0 for s in v["seconds"]) and v["summary"]["n"] == 3
    assert second["ratio_to_first"]["value"] == pytest.approx(second["summary"]["mean"] / first["summary"]["mean"])
    assert report["batch_size"] == 8 and report["image_shape"] == [3, 32, 32]
    assert report["environment"]["device_type"] == "cpu"
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 20")]
    assert len(rows) == 2 and rows[0].endswith("| 1 (reference) |") and "[fp32, NHWC] | 3 |" in rows[1]


def test_variant_steps_change_the_weights():
    v = st.Variant("widths=8,16,16", "cifar10-94", st.torch.device("cpu"), 4, (1, 28, 28), 5)
    before = v.model.head.weight.detach().clone()
    assert v.step() > 0
    assert not st.torch.equal(before, v.model.head.weight)  # a real optimizer step, not a forward only


@pytest.mark.parametrize("extra, message", [
    (["--variant", "no_such_key=1"], "unknown config key"),
    (["--variant", "widths=8,16,16", "--image-shape", "3x32"], "--image-shape must be CxHxW"),
])
def test_bad_input_is_one_line_error(capsys, extra, message):
    assert st.main(TINY + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("step_time.py: error:") and message in err[0]


def test_bad_counts_exit_through_argparse():
    with pytest.raises(SystemExit) as e:
        st.main(["--variant", "", "--steps", "1"])
    assert e.value.code == 2
