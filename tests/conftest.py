import dataclasses
import importlib.util
import os
import signal
import sys
import threading
from pathlib import Path

import pytest
import torch

from speedrun.data.dataset import Dataset


def make_tiny(n_train=256, n_test=64, shape=(3, 32, 32), classes=10, seed=0) -> Dataset:
    """Noisy uint8 images whose labels are learnable: each class adds its own colour (grey level for C=1).

    Colour, not position, carries the class: the nets end in a global max pool, which discards position.
    """
    g = torch.Generator().manual_seed(seed)
    c, h, w = shape
    colours = torch.randint(0, 128, (classes, c), generator=g, dtype=torch.uint8)
    if c == 1:
        colours[:, 0] = torch.arange(classes, dtype=torch.uint8) * (128 // classes)

    def split(n):
        y = torch.randint(0, classes, (n,), generator=g)
        x = torch.randint(0, 128, (n, c, h, w), generator=g, dtype=torch.uint8) + colours[y].view(n, c, 1, 1)
        return x, y

    (xtr, ytr), (xte, yte) = split(n_train), split(n_test)
    return Dataset("tiny", xtr, ytr, xte, yte, [f"c{i}" for i in range(classes)])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The test order's seed, even under -q (which hides pytest-randomly's header line): a failure that depends on
    what ran before it is repeated with the same order."""
    seed = getattr(config.option, "randomly_seed", None)
    if isinstance(seed, int) and config.pluginmanager.has_plugin("randomly"):
        terminalreporter.write_line(f"test order: random, repeat it with --randomly-seed={seed}")


@pytest.fixture(autouse=True)
def _machine_peak_cache_unread(tmp_path_factory, monkeypatch):
    """A test that names no data folder of its own (SPEEDRUN_DATA) reads no measured-peak cache of the machine's
    (~/.cache/speedrun/peak.json): a peak measured there under load, below what a test's run achieves, would give
    that run a warning (an MFU over 100%, not reported) that depends on the machine. In-process commands only."""
    from speedrun.engine import peak
    from speedrun.paths import data_root

    own = tmp_path_factory.mktemp("peak") / "peak.json"
    monkeypatch.setattr(peak, "cache_path", lambda: data_root() / "peak.json" if os.environ.get("SPEEDRUN_DATA")
                        else own)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    """A test's results folder, data cache, results database and working folder, all in its own tmp_path (for a
    file of CLI tests: `pytestmark = pytest.mark.usefixtures("in_tmp")`)."""
    monkeypatch.setenv("SPEEDRUN_RESULTS", str(tmp_path / "results"))
    monkeypatch.setenv("SPEEDRUN_DATA", str(tmp_path / "cache"))
    monkeypatch.setenv("SPEEDRUN_DB", str(tmp_path / "results.db"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def tiny() -> Dataset:
    return make_tiny()


def run_cli(argv, capsys) -> tuple[int, str, str]:
    """`speedrun ARGV` in this process: (exit code, stdout, stderr); argparse's own exits counted as codes."""
    from speedrun.cli.program import main

    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def save_tiny_cifar_models(root: Path, cfg, dataset: str, seeds) -> tuple[list[Path], Dataset]:
    """One cifar-family model per seed, trained on `dataset` (synthetic: ...) with `cfg` and saved as `train --save`
    saves it (root/m<seed>); returns the stems and the data."""
    from speedrun.recipes import cifar
    from speedrun.run import export

    data = cifar.load_data(dataset, data_dir=None, image_size=None, log=lambda line: None)
    stems = []
    for seed in seeds:
        run = cifar.train_run(cfg, data, torch.device("cpu"), seed=seed)
        card = {"recipe": "cifar10-94", "family": "cifar", "config": dataclasses.asdict(cfg),
                **cifar.model_card(cfg, data), "dataset": dataset, "accuracy": run.accuracy, "seed": seed}
        export.save_model(root / f"m{seed}", run.model.eval(), card)
        stems.append(root / f"m{seed}")
    return stems, data


_ROOT = Path(__file__).resolve().parents[1]
for _folder in (_ROOT / "src", _ROOT / "benchmarks"):  # where the benchmark scripts look for speedrun and each other:
    if str(_folder) not in sys.path:                   # here once, before any test, so loading one changes nothing
        sys.path.append(str(_folder))


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (the scripts are not a package)."""
    path = _ROOT / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_PEAK_PRELUDE = """
import resource, sys, json
import numpy, torch, PIL.Image
import speedrun.data.sources, speedrun.cli.program
_base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
def _report(outcome):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - _base
    print("PEAK_KB", peak, file=sys.stderr)
    print("OUTCOME", json.dumps(outcome), file=sys.stderr)
try:
"""


def run_peak(body: str, env: dict | None = None, cwd=None) -> tuple[int, str]:
    """Run `body` (indented code) in a fresh Python after the heavy imports; return (peak growth in bytes, stderr).

    ru_maxrss is a high-water mark: taking it after torch, numpy, Pillow and speedrun are imported and subtracting
    it from the mark after `body` gives an upper bound of what `body` itself added at its peak.
    """
    import os
    import subprocess
    import sys
    import textwrap

    code = (_PEAK_PRELUDE + textwrap.indent(textwrap.dedent(body), "    ")
            + "\nexcept BaseException as e:\n    _report(type(e).__name__ + ': ' + str(e))\nelse:\n    _report('ok')\n")
    full_env = {**os.environ, **(env or {})}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, cwd=cwd,
                          timeout=600)
    peak = [line for line in done.stderr.splitlines() if line.startswith("PEAK_KB")]
    assert peak, done.stderr[-3000:]
    return int(peak[-1].split()[1]) * 1024, done.stderr


def rest_of(proc, timeout_s: float) -> tuple[str, str]:
    """What a child writes from here to its exit (stdout, stderr), after lines were read through proc.stdout or
    proc.stderr: communicate() reads the pipes' descriptors, not the file objects, and would lose what they had
    read ahead (a last line that came with the one the test waited for). Kills the child after timeout_s."""
    out: list[str] = []
    drain = threading.Thread(target=lambda: out.append(proc.stdout.read() if proc.stdout else ""), daemon=True)
    drain.start()
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    try:
        err = proc.stderr.read() if proc.stderr else ""
        drain.join()
        proc.wait()
    finally:
        timer.cancel()
    return out[0] if out else "", err


def snapshot(*roots) -> set[str]:
    """Every file path under `roots` (to assert that nothing was written outside the cache and result dirs)."""
    import os

    found = set()
    for root in roots:
        for d, _, files in os.walk(root):
            found.update(os.path.join(d, f) for f in files)
    return found


@pytest.fixture(autouse=True, scope="session")
def _default_cpu_threads_read_first():
    """tricks/precision.py's default_cpu_threads() keeps the count it first reads, as a process's first run reads
    it before any run sets another. Read here, before any test sets one (the one-thread fixtures): read inside such
    a fixture, every later run of the session would take 1 thread for the default, and tests of the default fail
    in some orders."""
    from speedrun.tricks.precision import default_cpu_threads
    default_cpu_threads()


@pytest.fixture(autouse=True)
def _torch_threads_as_they_were():
    """torch's intra-op thread count is process-wide: a run with cpu_threads=1 leaves it at 1 until the next run
    sets it (a command's process ends there). Put back after each test, so that no test starts from another's."""
    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="session")
def _results_database_in_a_temp_folder(tmp_path_factory):
    """Commands write their results into a database (db.py); the tests' own, never the user's. Set in os.environ so
    that the subprocesses of tests (torchrun, the CLI) inherit it."""
    import os

    previous = os.environ.get("SPEEDRUN_DB")
    os.environ["SPEEDRUN_DB"] = str(tmp_path_factory.mktemp("db") / "results.db")
    yield
    if previous is None:
        os.environ.pop("SPEEDRUN_DB", None)
    else:
        os.environ["SPEEDRUN_DB"] = previous


# What a test's process hands to every later test and to the programs they start: a test that leaves one changed
# makes a later test's result depend on the order (a SIGTERM test whose child inherited another test's RANK, say).
# Session-scoped fixtures set these keys once, on purpose; torch's compiler sets its own (TORCHINDUCTOR_CACHE_DIR, ...)
# at its first use in a process, whichever test that is.
_SESSION_ENV = frozenset({"SPEEDRUN_DB"})
_LIBRARY_ENV = ("TORCHINDUCTOR_", "_TORCHINDUCTOR_")
# SIGCHLD is not among the signals: torch's DataLoader sets its handler once per process, at its first worker.
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGALRM)


def _process_state() -> dict:
    umask = os.umask(0o022)
    os.umask(umask)
    return {"environment": {k: v for k, v in os.environ.items()
                            if k not in _SESSION_ENV and not k.startswith(_LIBRARY_ENV)},
            "signal handlers": {s.name: signal.getsignal(s) for s in _SIGNALS},
            "signal mask": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
            # a library may add its vendored packages' folder (setuptools' _vendor) at its first import
            "working folder": os.getcwd(), "sys.path": [p for p in sys.path if "site-packages" not in p],
            "umask": umask, "_whole sys.path": list(sys.path)}  # "_": restored, not compared


def _restore(state: dict) -> None:
    env = state["environment"]
    for k in [k for k in os.environ if k not in _SESSION_ENV and not k.startswith(_LIBRARY_ENV) and k not in env]:
        del os.environ[k]
    os.environ.update(env)
    for name, handler in state["signal handlers"].items():
        signal.signal(getattr(signal, name), signal.SIG_DFL if handler is None else handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, state["signal mask"])
    os.chdir(state["working folder"])
    sys.path[:] = state["_whole sys.path"]
    os.umask(state["umask"])


def _changes(before: dict, after: dict) -> list[str]:
    found = []
    for what in (w for w in before if not w.startswith("_")):
        b, a = before[what], after[what]
        if b == a:
            continue
        if isinstance(b, dict):
            keys = sorted(k for k in set(b) | set(a) if b.get(k) != a.get(k))
            found.append(f"{what}: " + ", ".join(f"{k} {b.get(k)!r} -> {a.get(k)!r}" for k in keys))
        else:
            found.append(f"{what}: {b!r} -> {a!r}")
    return found


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    item.stash[_STATE_KEY] = _process_state()  # before any of the test's fixtures
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield  # every fixture of the test torn down
    before = item.stash.get(_STATE_KEY, None)
    if before is not None:
        changed = _changes(before, _process_state())
        if changed:
            _restore(before)  # the next test starts clean whatever this one did
            raise AssertionError("the test left process state changed (later tests and their child processes "
                                 "would inherit it): " + "; ".join(changed))
    return result


_STATE_KEY = pytest.StashKey[dict]()
