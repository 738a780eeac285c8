"""`--model MODULE:FUNCTION`: the user's own network through the in-memory recipes (models/custom.py; cifar10-94 and
the rest of the cifar family, cifar10-resnet18), the example network ablated through it, each refusal one line
before any work, and a saved model whose card names a builder that is never imported because of it."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import make_tiny, run_cli
from torch import nn

import speedrun
from speedrun.models import custom
from speedrun.recipes import cifar, cifar_resnet
from speedrun.recipes.cifar import data as cifar_data
from speedrun.recipes.cifar import loop as cifar_loop
from speedrun.recipes.cifar_resnet import loop as resnet_loop
from speedrun.tricks.bn_momentum import set_bn_momentum_
from speedrun.tricks.whitening import patch_whitening_init_

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "mobile_net.py") + ":build"
TINY = ["--dataset", "synthetic:train=128,test=32,shape=3x16x16", "--device", "cpu", "--epochs", "0.5",
        "--set", "batch_size=32", "--set", "whiten_images=32"]

pytestmark = pytest.mark.usefixtures("in_tmp")


def _module(tmp_path: Path, name: str, body: str) -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    return str(tmp_path / f"{name}.py")


TINY_NET = """
    from torch import nn

    def build(in_channels, num_classes, image_px):
        return nn.Sequential(nn.Conv2d(in_channels, 2 * in_channels * 4, 2), nn.GELU(), nn.Conv2d(24, 16, 3),
                             nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(16, num_classes))
"""


@pytest.fixture
def tiny_net(tmp_path) -> str:
    return _module(tmp_path, "tiny_net", TINY_NET) + ":build"


@pytest.fixture
def no_run(monkeypatch):
    """Every run and warm-up of the in-memory families replaced by a recorder: a refusal must come before any."""
    started = []
    for family in (cifar, cifar_resnet):
        monkeypatch.setattr(family, "train_run", lambda *a, **k: started.append(a) or pytest.fail("a run started"))
        monkeypatch.setattr(family, "warmup", lambda *a, **k: started.append(a) or 0.0)
    return started


def test_train_records_the_builder_by_name_and_notes_what_is_off(tiny_net, capsys, tmp_path):
    code, out, err = run_cli(["train", "--model", tiny_net, *TINY, "--json", "r.json"], capsys)
    assert code == 0, err
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["config"]["model"] == "tiny_net:build"  # the name, not the path it was reached by
    note = next(line for line in err.splitlines() if "--model tiny_net:build" in line)
    assert "off for this network" in note and "dirac_init" in note and "whiten_init" not in note, note


def test_a_network_of_lazy_modules_trains(tmp_path, capsys):
    """Lazy modules get their shapes from one forward when the network is built, before the optimizers see them."""
    lazy = _module(tmp_path, "lazy_net", """
        from torch import nn

        def build(in_channels, num_classes, image_px):
            return nn.Sequential(nn.LazyConv2d(8, 3), nn.LazyBatchNorm2d(), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                 nn.Flatten(), nn.LazyLinear(num_classes))
    """) + ":build"
    code, out, err = run_cli(["train", "--model", lazy, *TINY, "--json", "r.json"], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "r.json").read_text())["runs"][0]["diverged"] is None
    net = custom.build("lazy_net:build", 3, 10, 16)
    assert [tuple(p.shape) for p in net.parameters()] == [(8, 3, 3, 3), (8,), (8,), (8,), (10, 8), (10,)]
    assert net.training and int(net[1].num_batches_tracked) == 0  # the shaping forward moved no statistics


def test_the_example_is_ablated_through_model(capsys, tmp_path):
    """The issue's question, for the user's network: which tricks transfer? Each trick that applies is measured;
    those acting inside the recipe's network are listed as not in it."""
    code, out, err = run_cli(["ablate", "cifar10-94", "--model", EXAMPLE, *TINY, "--runs", "1", "--json", "a.json"],
                             capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "a.json").read_text())
    rows = {r["trick"]: r for r in report["tricks"]}
    for key in cifar_data.NETWORK_SETTINGS:
        assert rows[key]["idle"] and not rows[key]["measured"], rows[key]
    for key in ("whiten_init", "label_smoothing", "lookahead", "tta_level", "flip"):  # any network's tricks
        assert rows[key]["measured"] and not rows[key].get("idle"), rows[key]
    assert "not in this network" in out


def test_whitening_and_the_optimizers_follow_the_users_network(tiny_net):
    name = custom.use_builder(tiny_net)
    net = custom.build(name, 3, 10, 16)
    cfg = dataclasses.replace(cifar.cifar10_94(), model=name)
    assert cifar_loop.whitening_conv(cfg, net, 3) is net[0]
    norms, rest = ({id(p) for p in g["params"]} for g in cifar_loop.build_optimizers(cfg, net)[0].param_groups)
    assert id(net[0].bias) in rest  # the whitening bias takes the base lr, as the recipe's own
    assert id(net[3].weight) in norms and id(net[7].bias) in norms and id(net[2].bias) in norms  # < 2 dimensions
    assert id(net[2].weight) in rest and id(net[7].weight) in rest
    padded = nn.Sequential(nn.Conv2d(3, 24, 2, padding=1), nn.Flatten(), nn.LazyLinear(10))
    assert cifar_loop.whitening_conv(cfg, padded, 3) is None  # not the whitening's shape: whiten_init does nothing
    own = cifar.cifar10_94()
    assert cifar_loop.whitening_conv(own, cifar.build_model(own, 3, 10), 3) is not None


def test_the_python_api_takes_the_function(tmp_path):
    def build(in_channels, num_classes, image_px):
        return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_px * image_px, num_classes))

    result = speedrun.train("cifar10-94", "synthetic:train=64,test=16,shape=3x16x16", device="cpu", epochs=0.5,
                            batch_size=32, whiten_images=32, model=build)
    assert result.config["model"].endswith("<locals>.build")
    assert isinstance(result.model[0], nn.Flatten)


@pytest.mark.parametrize("spec, fragment", [
    ("nothing_here.py:build", "is not a file"),
    ("no_such_module_xyz:build", "cannot import no_such_module_xyz (ModuleNotFoundError"),
    ("no_colon", "is not MODULE:FUNCTION"),
    ("{tmp}/broken.py:build", "importing {tmp}/broken.py raised SyntaxError"),
    ("{tmp}/raising.py:build", "raised RuntimeError: import-time failure"),
    ("{tmp}/exits.py:build", "raised SystemExit"),
    ("{tmp}/shapes.py:missing", "has no 'missing'"),
    ("{tmp}/shapes.py:NUMBER", "NUMBER is int, not a function"),
    ("{tmp}/shapes.py:Net", "an nn.Module class, not a function"),
    ("{tmp}/shapes.py:not_a_module", "returned dict, not a torch.nn.Module"),
    ("{tmp}/shapes.py:wrong_shape", "gives shape [2, 7] (training mode) for a batch of 2 3x16x16 images; it must"),
    ("{tmp}/shapes.py:eval_differs", "gives shape [2, 1] (evaluation mode)"),  # probed in both modes
    ("{tmp}/shapes.py:exits_when_built", "building the network for (3, 10, 16) raised SystemExit: 4"),
    ("{tmp}/shapes.py:exits_in_forward", "forward (training mode) on a batch of 2 3x16x16 images raised SystemExit"),
    ("{tmp}/shapes.py:frozen", "has no trainable parameters"),
    ("{tmp}/random.py:build", "a file named random.py would hide the module random"),  # the standard library's
    ("{tmp}/shapes.py:flat_output", "gives shape [2]"),
    ("{tmp}/shapes.py:raises_in_forward", "forward (training mode) on a batch of 2 3x16x16 images raised RuntimeError"),
    ("{tmp}/shapes.py:raises_when_built", "building the network for (3, 10, 16) raised TypeError"),
    ("{tmp}/shapes.py:lazy_spare", "keeps lazy parameters after a forward (a lazy module its forward never calls)"),
    ("{tmp}/shapes.py:lazy_raising", "its lazy modules' first forward, on a batch of 2 3x16x16 zero images, raised"),
])
def test_model_refusals_are_one_line_before_any_work(spec, fragment, capsys, tmp_path, no_run):
    _module(tmp_path, "broken", "def build(:\n")
    _module(tmp_path, "raising", "raise RuntimeError('import-time failure')\n")
    _module(tmp_path, "exits", "import sys\nsys.exit(3)\n")
    _module(tmp_path, "random", "def build(c, k, px):\n    pass\n")
    _module(tmp_path, "shapes", """
        import torch
        from torch import nn
        NUMBER = 3

        class Net(nn.Module):
            pass

        def not_a_module(c, k, px):
            return {}

        def wrong_shape(c, k, px):
            return nn.Sequential(nn.Flatten(), nn.LazyLinear(7))

        def flat_output(c, k, px):
            return nn.Sequential(nn.Flatten(), nn.LazyLinear(1), nn.Flatten(0))

        class Raising(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.zeros(1))

            def forward(self, x):
                raise RuntimeError("no forward")

        class EvalDiffers(nn.Module):
            def __init__(self):
                super().__init__()
                self.head = nn.Sequential(nn.Flatten(), nn.LazyLinear(10))

            def forward(self, x):
                y = self.head(x)
                return y if self.training else y[:, :1]

        def eval_differs(c, k, px):
            return EvalDiffers()

        def exits_when_built(c, k, px):
            import sys
            sys.exit(4)

        class Exits(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.zeros(1))

            def forward(self, x):
                import sys
                sys.exit(5)

        def exits_in_forward(c, k, px):
            return Exits()

        def frozen(c, k, px):
            return nn.Sequential(nn.Flatten(), nn.Linear(c * px * px, k)).requires_grad_(False)

        def raises_in_forward(c, k, px):
            return Raising()

        def raises_when_built(c, k):
            return nn.Identity()

        class LazySpare(nn.Module):
            def __init__(self):
                super().__init__()
                self.head = nn.Sequential(nn.Flatten(), nn.LazyLinear(10))
                self.spare = nn.LazyLinear(3)

            def forward(self, x):
                return self.head(x)

        def lazy_spare(c, k, px):
            return LazySpare()

        def lazy_raising(c, k, px):
            return nn.Sequential(nn.LazyConv2d(4, 3), nn.Conv2d(5, 10, 1))  # 4 channels into a conv of 5
    """)
    spec, fragment = spec.format(tmp=tmp_path), fragment.format(tmp=tmp_path)
    code, out, err = run_cli(["train", "--model", spec, *TINY, "--json", "r.json"], capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("speedrun: error: ") and "Traceback" not in err, err
    assert fragment in err, err
    assert not no_run and not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("argv, fragment", [
    (["train", "--set", "model=tiny_net:build"], "model is set with --model MODULE:FUNCTION"),
    (["train", "imagenet-debug", "--model", "{net}"], "imagenet-debug trains its own network only"),
    (["bench", "--vary", "lookahead=false", "--model", "{tmp}/nothing.py:build"], "is not a file"),
    (["tune", "--model", "{tmp}/nothing.py:build"], "is not a file"),
    (["profile", "--model", "{tmp}/nothing.py:build"], "is not a file"),
    (["sweep", "--space", "label_smoothing=0,0.1", "--model", "{tmp}/nothing.py:build"], "is not a file"),
    (["ablate", "--model", "{tmp}/nothing.py:build"], "is not a file"),
])
def test_every_command_that_trains_takes_model_and_refuses_alike(argv, fragment, tiny_net, capsys, tmp_path,
                                                                  no_run):
    argv = [a.format(net=tiny_net, tmp=tmp_path) for a in argv]
    extra = TINY if argv[0] not in ("train", "profile") or argv[1] != "imagenet-debug" else TINY[:4]
    if argv[0] == "profile":
        extra = TINY[:4]
    code, out, err = run_cli([*argv, *extra], capsys)
    assert code == 2 and err.count("\n") == 1 and fragment in err, err
    assert not no_run


def test_a_saved_model_names_its_builder_and_never_imports_it(tmp_path, capsys, monkeypatch):
    """A card is a file from elsewhere: the builder it names is looked up among those the user gave, never
    imported because the card says so; a card naming another one is refused."""
    net = _module(tmp_path, "tiny_net", TINY_NET) + ":build"
    code, _, err = run_cli(["train", "--model", net, *TINY, "--save", "m"], capsys)
    assert code == 0, err
    card = json.loads((tmp_path / "m.json").read_text())
    assert card["config"]["model"] == "tiny_net:build"
    # A module the card could name, which would leave a mark if it ran.
    _module(tmp_path, "marker", "open('RAN', 'w').close()\ndef build(c, k, px):\n    raise SystemExit\n")
    card["config"]["model"] = "marker:build"
    (tmp_path / "evil.json").write_text(json.dumps(card))
    (tmp_path / "evil.safetensors").write_bytes((tmp_path / "m.safetensors").read_bytes())
    monkeypatch.setattr(custom, "_BUILDERS", {})  # a new process: nothing given yet
    data = "synthetic:train=128,test=32,shape=3x16x16"
    for model, extra, fragment in [("m", [], "built by tiny_net:build, which speedrun does not import by itself"),
                                   ("evil", [], "built by marker:build, which speedrun does not import"),
                                   ("evil", ["--model", net], "was built by marker:build, not by tiny_net:build"),
                                   ("m", ["--model", f"{tmp_path}/marker.py:build"],  # imported: the user named it
                                    "was built by tiny_net:build, not by marker:build")]:
        (tmp_path / "RAN").unlink(missing_ok=True)
        monkeypatch.setattr(custom, "_BUILDERS", {})
        code, _, err = run_cli(["eval", model, "--dataset", data, "--device", "cpu", *extra], capsys)
        assert code == 2 and err.count("\n") == 1 and fragment in err, (model, extra, err)
        assert not (tmp_path / "RAN").exists() or "marker.py" in " ".join(extra)
    monkeypatch.setattr(custom, "_BUILDERS", {})
    code, out, err = run_cli(["eval", "m", "--dataset", data, "--device", "cpu", "--model", net], capsys)
    assert code == 0, err
    with pytest.raises(ValueError, match="which speedrun does not import by itself"):
        monkeypatch.setattr(custom, "_BUILDERS", {})
        speedrun.load(tmp_path / "m")
    assert isinstance(speedrun.load(tmp_path / "m", model=net).net, nn.Module)
    with pytest.raises(ValueError, match="was built by marker:build, not by tiny_net:build"):
        speedrun.load(tmp_path / "evil", model=net)  # in Python the builder given is compared with the card's


def test_off_is_the_recipes_own_network_unchanged():
    """No --model: the recipe's network, its parameter groups by name, exactly as before the option existed."""
    cfg = cifar.cifar10_94()
    assert cfg.model == ""
    net = cifar.build_model(cfg, 3, 10)
    assert isinstance(net, cifar.build_model.__globals__["CifarNet"])
    sgd = cifar_loop.build_optimizers(cfg, net)[0]
    names = {id(p): n for n, p in net.named_parameters()}
    assert [[names[id(p)] for p in g["params"]] for g in sgd.param_groups] == [
        [n for n, p in net.named_parameters() if "norms" in n and p.requires_grad],
        ["whiten.bias"] + [n for n, _ in net.named_parameters() if "convs" in n] + ["head.weight"]]
    assert cifar.idle_tricks(cfg) == []
    with torch.no_grad():
        assert cifar.build_model(cfg, 3, 10, 32).state_dict().keys() == net.state_dict().keys()


def test_a_checkpoint_of_the_users_network_resumes_only_with_it(tiny_net, capsys):
    code, _, err = run_cli(["train", "--model", tiny_net, *TINY, "--checkpoint-dir", "ck"], capsys)
    assert code == 0, err
    code, _, err = run_cli(["train", *TINY, "--checkpoint-dir", "ck", "--resume", "auto"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "model='tiny_net:build'; this run has model='': resume with --model giving 'tiny_net:build'" in err, err
    other = _module(Path.cwd(), "other_net", TINY_NET) + ":build"  # another builder: its note waits for the check
    code, _, err = run_cli(["train", "--model", other, *TINY, "--checkpoint-dir", "ck", "--resume", "auto"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "this run has model='other_net:build'" in err, err


def test_the_users_batchnorm_takes_the_recipes_momentum_and_pytorchs_default_changes_nothing(tiny_net):
    name = custom.use_builder(tiny_net)
    cfg = dataclasses.replace(cifar.cifar10_94(), model=name)
    assert cifar.build_model(cfg, 3, 10, 16)[3].momentum == cfg.bn_momentum == 0.4
    plain = custom.build(name, 3, 10, 16)
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    assert set_bn_momentum_(plain, 0.1) == 1  # PyTorch's default: the network as its builder made it
    assert plain[3].momentum == 0.1 and all(torch.equal(before[k], v) for k, v in plain.state_dict().items())


@pytest.mark.parametrize("argv, fragment", [
    (["bench", "--vary", "model=a:build,b:build"], "--vary model=...: the network is given with --model"),
    (["sweep", "--space", "model=a:build,b:build"], "--space model=...: the network is given with --model"),
])
def test_the_network_is_not_varied_or_searched(argv, fragment, capsys, no_run):
    code, out, err = run_cli([*argv, *TINY], capsys)
    assert code == 2 and err.count("\n") == 1 and fragment in err, err
    assert not no_run


def test_a_saved_model_of_the_recipes_own_network_refuses_a_builder(tiny_net, capsys):
    code, _, err = run_cli(["train", *TINY, "--save", "own"], capsys)
    assert code == 0, err
    code, _, err = run_cli(["eval", "own", "--dataset", TINY[1], "--device", "cpu", "--model", tiny_net], capsys)
    assert code == 2 and "was built as its recipe's own network, not by tiny_net:build; leave out --model" in err


@pytest.mark.parametrize("make, fragment", [
    (lambda: (lambda c, k, px: nn.Linear(1, 1)), "a function defined with def"),
    (lambda: nn.Linear, "a function defined with def"),
    (lambda: __import__("functools").partial(lambda c, k, px: None), "a function defined with def"),
])
def test_the_api_takes_named_functions_only(make, fragment):
    """A lambda, a class or a partial has no name a saved model could record and a later process give again."""
    with pytest.raises(ValueError, match=fragment):
        speedrun.train("cifar10-94", "synthetic:train=64,test=16,shape=3x16x16", device="cpu", epochs=0.5,
                       batch_size=32, model=make())


def test_a_scripts_builder_is_named_by_the_script(tmp_path):
    """`python myscript.py` defining build and training with it records myscript:build, which --model
    myscript.py:build names again when the saved model is evaluated."""
    script = _module(tmp_path, "myscript", """
        import speedrun
        from torch import nn

        def build(c, k, px):
            return nn.Sequential(nn.Flatten(), nn.Linear(c * px * px, k))

        r = speedrun.train("cifar10-94", "synthetic:train=64,test=16,shape=3x16x16", device="cpu", epochs=0.5,
                           batch_size=32, model=build)
        print(r.config["model"])
    """)
    import subprocess
    import sys
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "myscript:build"


@pytest.mark.parametrize("argv", [["bench", "--vary", "label_smoothing=0.1"],
                                  ["sweep", "--space", "label_smoothing=0,0.1", "--trials", "1"]])
def test_every_instrument_names_what_is_off_for_the_network_before_training(argv, tiny_net, capsys):
    """The warning train prints (the tricks that do nothing for the user's network) comes from bench and sweep
    too, before their first run."""
    code, out, err = run_cli([*argv, "--model", tiny_net, *TINY, "--runs", "1"], capsys)
    assert code == 0, err
    lines = (err + out).splitlines()
    warned = next(i for i, line in enumerate(lines) if "--model tiny_net:build" in line and "off for" in line)
    first_run = next(i for i, line in enumerate(lines) if line.startswith(("warm-up", "trial", "round")))
    assert warned < first_run, lines[:12]


# cifar10-resnet18 at a size a 2-core CPU trains in seconds: 2 steps of 16 images
RESNET_TINY = ["--dataset", "synthetic:train=64,test=16,shape=3x16x16", "--device", "cpu", "--epochs", "0.5", "--set",
               "batch_size=16"]


def test_resnet18_trains_the_users_network_and_records_the_builder(capsys, tmp_path):
    code, out, err = run_cli(["train", "cifar10-resnet18", "--model", EXAMPLE, *RESNET_TINY, "--json", "r.json"],
                             capsys)
    assert code == 0, err
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["config"]["model"] == "mobile_net:build" and result["runs"][0]["steps"] == 2
    assert result["flops"]["train_step"] > 0  # the example builds on the meta device: counted
    note = next(line for line in err.splitlines() if "--model mobile_net:build" in line)
    # its first conv takes the whitening (nothing is off), and its BatchNorm keeps the builder's momentum
    assert "981,538 parameters; every trick of the recipe acts on it" in note and "bn_momentum" not in note, note


def test_resnet18_whitens_the_users_first_conv_where_it_fits_and_keeps_its_batchnorm(tiny_net):
    name = custom.use_builder(tiny_net)
    cfg = dataclasses.replace(cifar_resnet.cifar10_resnet18(), model=name)
    hooks = resnet_loop.ResnetHooks(cfg)
    net = hooks.build(make_tiny(n_train=32, n_test=8, shape=(3, 16, 16)))
    assert net[3].momentum == 0.1  # the builder's (PyTorch's default), as ResNet-18's own; cifar sets its 0.4
    images = torch.randn(8, 3, 16, 16)
    hooks.whiten(net, lambda: images)
    expected = patch_whitening_init_(nn.Conv2d(3, 24, 2), images, cfg.whiten_eps).weight
    assert torch.equal(net[0].weight, expected) and net[0].weight.requires_grad  # trained on from there, as the stem
    assert cifar_resnet.idle_tricks(cfg, net, 3) == [] and cifar_resnet.idle_tricks(cfg) == []

    def padded(c, k, px):
        return nn.Sequential(nn.Conv2d(c, 8, 3, padding=1), nn.Flatten(), nn.LazyLinear(k))

    cfg = dataclasses.replace(cfg, model=custom.register(padded))
    hooks = resnet_loop.ResnetHooks(cfg)
    net = hooks.build(make_tiny(n_train=32, n_test=8, shape=(3, 16, 16)))
    before = net[0].weight.clone()
    hooks.whiten(net, lambda: pytest.fail("no conv to whiten: no sample is drawn"))
    assert torch.equal(net[0].weight, before)
    assert cifar_resnet.idle_tricks(cfg, net, 3) == ["whiten_init"]
    own = cifar_resnet.cifar10_resnet18()
    assert cifar_resnet.idle_tricks(own, cifar_resnet.build_model(own, 3, 10), 3) == []


def test_resnet18_is_ablated_through_model_naming_what_does_nothing_for_the_network(tmp_path, capsys):
    """ablate asks before any data is read, so every trick is measured; the note before the first run names the
    whitening as off for a network whose first conv cannot take it."""
    net = _module(tmp_path, "padnet", """
        from torch import nn

        def build(in_channels, num_classes, image_px):
            return nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes))
    """) + ":build"
    code, out, err = run_cli(["ablate", "cifar10-resnet18", "--model", net, *RESNET_TINY, "--runs", "1", "--json",
                              "a.json"], capsys)
    assert code == 0, err
    lines = (err + out).splitlines()
    warned = next(i for i, line in enumerate(lines) if "--model padnet:build" in line)
    assert lines[warned].endswith("off for this network (they act inside the recipe's own): whiten_init"), lines
    assert warned < next(i for i, line in enumerate(lines) if line.startswith(("warm-up", "round")))
    report = json.loads((tmp_path / "a.json").read_text())
    assert {r["config"]["model"] for r in report["results"]} == {"padnet:build"}  # every variant trains it
    rows = {r["trick"]: r for r in report["tricks"]}
    assert set(rows) == {key for key, _, _ in cifar_resnet.TRICKS}
    for key in ("whiten_init", "label_smoothing", "lookahead", "tta_level", "lr_schedule", "nesterov"):
        assert rows[key]["measured"], rows[key]


@pytest.mark.parametrize("body, spec, fragment", [
    (None, "no_such_module_xyz:build", "cannot import no_such_module_xyz (ModuleNotFoundError"),
    ("def build(c, k, px):\n    return {}\n", "{tmp}/bad.py:build", "returned dict, not a torch.nn.Module"),
    ("from torch import nn\n\ndef build(c, k, px):\n    return nn.Sequential(nn.Flatten(), nn.LazyLinear(7))\n",
     "{tmp}/bad.py:build", "gives shape [2, 7] (training mode) for a batch of 2 3x16x16 images; it must"),
])
def test_resnet18_refuses_a_bad_model_in_one_line_before_any_work(body, spec, fragment, capsys, tmp_path, no_run):
    if body is not None:
        _module(tmp_path, "bad", body)
    code, out, err = run_cli(["train", "cifar10-resnet18", "--model", spec.format(tmp=tmp_path), *RESNET_TINY,
                              "--json", "r.json"], capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("speedrun: error: ") and "Traceback" not in err, err
    assert fragment in err, err
    assert not no_run and not (tmp_path / "r.json").exists()


def test_tune_refuses_a_network_of_the_wrong_shape_once_before_trying_any_setting(tmp_path, capsys, no_run):
    spec = _module(tmp_path, "wide", """
        import torch

        def build(c, k, px):
            return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(c * px * px, k + 1))
    """) + ":build"
    code, out, err = run_cli(["tune", "--model", spec, *TINY], capsys)
    assert code == 2 and "must give logits" in err and "run here?" not in err, err
    assert err.count("speedrun: error:") == 1 and not no_run


def test_a_network_that_fails_mid_training_is_named_as_the_users_error(tmp_path, capsys):
    """Not "internal error ... a bug: please report it": the user's forward raised, so the line names the builder,
    the file, line and function of the user's code that raised, and what it said; exit 2."""
    spec = _module(tmp_path, "breaks", """
        from torch import nn


        class Net(nn.Module):
            def __init__(self, c, k):
                super().__init__()
                self.conv, self.head, self.calls = nn.Conv2d(c, 8, 3, padding=1), nn.Linear(8, k), 0

            def forward(self, x):
                self.calls += 1
                if self.calls > 4:  # past the check's two probes and a step or two
                    raise RuntimeError("my layer broke")
                return self.head(self.conv(x).mean((2, 3)))


        def build(c, k, px):
            return Net(c, k)
    """) + ":build"
    code, _, err = run_cli(["train", "--model", spec, *TINY, "--json", "r.json"], capsys)
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("speedrun: error: the network of --model breaks:build raised RuntimeError at "
                           "breaks.py:"), err
    assert "in forward: my layer broke" in last and "internal error" not in err, err
