"""The `speedrun` command line's grammar: every subcommand, flag and help text (cli.py runs what it parses)."""

from __future__ import annotations

import argparse

from speedrun._version import __version__
from speedrun.cli.output import EXIT_USAGE, one_line, other_rank, say
from speedrun.data.download import check_mirror  # urllib only: no torch
from speedrun.recipes import recipe_lines  # a table of names: no torch, no family imported


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        # No prefixes: `--epoch` is a typo, not --epochs, and a new flag must not change what an old command means.
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):  # argparse prints usage + error; we print one line
        if not other_rank():  # under torchrun every process parses the same words: rank 0 says it
            say(f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)")
        raise SystemExit(EXIT_USAGE)

    def _print_message(self, message: str, file=None) -> None:  # --help, --version: rank 0's to show
        if not other_rank():
            super()._print_message(message, file)


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _mirror(text: str) -> str:
    try:
        return check_mirror(text, "--mirror")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _version() -> str:
    return f"speedrun {__version__}"


# The help of the flags many commands share, written once: every flag of every command has a help text
# (tests/test_cli_help.py walks the parser).
RECIPE_HELP = "recipe name (default cifar10-94; `speedrun recipes` lists them)"
DATASET_HELP = ("cifar10, cifar100, mnist, fashion-mnist, kmnist, synthetic[:k=v,...], or a path (image folder "
                "ROOT/{train,test or val}/<class>/, CIFAR batches or archive, IDX files, prepared shards for the "
                "imagenet recipes); default: the recipe's")
DATA_DIR_HELP = "where a named dataset's archive or files already are (default: downloaded into $SPEEDRUN_DATA)"
DEVICE_HELP = "auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:N, mps"
EPOCHS_HELP = "train this many epochs instead of the recipe's; the schedule is compressed to fit"
SEED_HELP = "first seed; run i uses seed + i (default 0)"
IMAGE_SIZE_HELP = "image folders: resize the shorter side to PX and centre-crop PX x PX (mixed sizes)"
MIRROR_HELP = ("a named dataset's download: try this URL first, a folder (the file name is appended) or the file "
               "itself; repeatable, tried in order, then $SPEEDRUN_MIRRORS, then the published URL")
TENSORBOARD_HELP = ("write TensorBoard event files (per-step loss, lr; per-epoch accuracy, images/s; the config as "
                    "hparams) to a new folder DIR/<time>-<recipe>, one run per seed (and setting); needs "
                    "pip install 'speedrun[tensorboard]'")


MODEL_HELP = ("the network to train instead of the recipe's: FUNCTION in MODULE (a .py file or an importable module) "
              "builds an nn.Module from (in_channels, num_classes, image_px); the recipe's data path and every trick "
              "that applies to any network train it")
LOAD_HELP = ("the builder (MODULE:FUNCTION) of a model trained with --model; a saved model never imports its builder "
             "itself")


def _instrument_flags(p: argparse.ArgumentParser, epochs_help: str = EPOCHS_HELP) -> None:
    """The flags ablate and tune share with bench's: the data, the device, the budget, the seed and the outputs."""
    for flag, kwargs in (("--dataset", {"help": DATASET_HELP}), ("--data-dir", {"help": DATA_DIR_HELP}),
                         ("--mirror", {"action": "append", "type": _mirror, "metavar": "URL", "help": MIRROR_HELP}),
                         ("--device", {"default": "auto", "help": DEVICE_HELP}),
                         ("--epochs", {"type": _float, "help": epochs_help}),
                         ("--seed", {"type": int, "default": 0, "help": SEED_HELP}),
                         ("--json", {"help": "report file, never replaced"}),
                         ("--db", {"metavar": "PATH", "help": "results database (default as for train)"})):
        p.add_argument(flag, **{"default": None, **kwargs})


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="speedrun", description="Train neural networks as fast as the hardware allows.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    _add_train(sub)
    _add_results(sub)
    _add_measuring(sub)
    _add_sweep(sub)
    _add_files_and_models(sub)
    return parser


def _add_train(sub) -> None:
    """train and its flags."""
    t = sub.add_parser("train", help="train a recipe for N seeds and report statistics",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="recipes:\n  " + "\n  ".join(recipe_lines()) +
                              "\n\nUnder torchrun (torchrun --nproc_per_node=K -m speedrun train ...) every process "
                              "takes 1/K of each batch; see the README.")
    t.add_argument("recipe", nargs="?", default="cifar10-94", help="recipe name (default cifar10-94; listed below)")
    t.add_argument("--dataset", default=None, help=DATASET_HELP)
    t.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)
    t.add_argument("--mirror", action="append", type=_mirror, metavar="URL", help=MIRROR_HELP)
    t.add_argument("--image-size", type=int, default=None, metavar="PX", help=IMAGE_SIZE_HELP)
    t.add_argument("--device", default="auto", help=DEVICE_HELP)
    t.add_argument("--epochs", type=_float, default=None, help=EPOCHS_HELP)
    t.add_argument("--runs", type=int, default=1, help="number of seeds (default 1)")
    t.add_argument("--seed", type=int, default=0, help=SEED_HELP)
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set lookahead=false (repeatable)")
    t.add_argument("--model", dest="builder", default=None, metavar="MODULE:FUNCTION", help=MODEL_HELP)
    t.add_argument("--json", default=None,
                   help="result file, never replaced (default: a new results/<time>-<recipe>-<dataset>.json)")
    t.add_argument("--smoke", action="store_true",
                   help="pipeline check in seconds: 4 small steps, 256 test images, no TTA; marked as not a result")
    t.add_argument("--quiet", action="store_true", help="print only the result lines (and warnings)")
    t.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="save the training state in DIR (off by default; outside the timed region)")
    t.add_argument("--checkpoint-every", type=int, default=None, metavar="STEPS",
                   help="checkpoint every STEPS steps (default: ten times a run), and always at a run's end")
    t.add_argument("--keep-checkpoints", type=int, default=2, metavar="K", help="keep the newest K (default 2)")
    t.add_argument("--resume", default=None, metavar="PATH|auto",
                   help="continue from a checkpoint file, or 'auto': the newest usable one in --checkpoint-dir")
    t.add_argument("--price-per-hour", type=_float, default=None, metavar="USD",
                   help="dollars per device-hour for the result's cost (default: a table of GPU prices, "
                        "records/cost.py)")
    t.add_argument("--save", default=None, metavar="PATH",
                   help="write the trained network: PATH.safetensors + PATH.json (for eval, predict, speedrun.load)")
    t.add_argument("--db", default=None, metavar="PATH",
                   help="results database (default: $SPEEDRUN_DB, else ~/.local/share/speedrun/results.db)")
    t.add_argument("--strict", action="store_true",
                   help="refuse to run while a debugging switch that slows training is on (anomaly detection, a "
                        "profiler, CUDA_LAUNCH_BLOCKING, ...); without it each is a warning")
    t.add_argument("--settings", default=None, metavar="FILE",
                   help="apply a settings file from `speedrun tune --apply FILE` (default: $SPEEDRUN_SETTINGS); "
                        "--set wins over it; the result records it")
    t.add_argument("--tensorboard", default=None, metavar="DIR", help=TENSORBOARD_HELP)


def _add_results(sub) -> None:
    """results and `results import`: the stored results."""
    r = sub.add_parser("results", help="list stored results (filters, --json, --csv); `results import FILE...`")
    r.add_argument("--recipe", default=None, help="results of this recipe only")
    r.add_argument("--dataset", default=None, help="the dataset as given, or its last path part")
    r.add_argument("--device", default=None, help="a device type (cuda, cpu) or part of the device's name")
    r.add_argument("--since", default=None, metavar="DATE", help="ISO date or time (UTC), inclusive")
    r.add_argument("--until", default=None, metavar="DATE", help="ISO date or time (UTC), inclusive")
    r.add_argument("--command", dest="command_text", default=None, metavar="TEXT",
                   help="results whose command line contains TEXT")
    r.add_argument("--limit", type=int, default=None, metavar="N", help="the newest N only")
    r.add_argument("--json", action="store_true", help="a JSON list instead of a table")
    r.add_argument("--csv", action="store_true", help="CSV instead of a table")
    r.add_argument("--db", default=None, metavar="PATH", help="results database (default as for train)")
    rsub = r.add_subparsers(dest="results_action", parser_class=_Parser)
    ri = rsub.add_parser("import", help="store result JSON files (speedrun train --json, benchmarks/results/)")
    ri.add_argument("files", nargs="+", metavar="FILE", help="result JSON files; each is checked, stored once")
    # SUPPRESS: `results --db X import F` keeps the X given before `import` (a default here would replace it).
    ri.add_argument("--db", default=argparse.SUPPRESS, metavar="PATH", help="results database (default as for train)")


def _add_measuring(sub) -> None:
    """The commands that measure: bench, ablate, tune, profile, peak."""
    b = sub.add_parser("bench", help="settings side by side: --vary KEY=V1,V2 against the baseline, interleaved")
    b.add_argument("recipe", nargs="?", default="cifar10-94", help=RECIPE_HELP)
    b.add_argument("--vary", action="append", required=True, metavar="KEY=V1,V2,...",
                   help="a config key and the values to try, each against the baseline (repeatable)")
    b.add_argument("--runs", type=int, default=3, help="runs per setting (default 3)")
    b.add_argument("--dataset", default=None, help=DATASET_HELP)
    b.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)
    b.add_argument("--mirror", action="append", type=_mirror, metavar="URL", help=MIRROR_HELP)
    b.add_argument("--device", default="auto", help=DEVICE_HELP)
    b.add_argument("--epochs", type=_float, default=None, help=EPOCHS_HELP)
    b.add_argument("--seed", type=int, default=0, help=SEED_HELP)
    b.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="the baseline's config overrides (repeatable)")
    b.add_argument("--model", dest="builder", default=None, metavar="MODULE:FUNCTION", help=MODEL_HELP)
    b.add_argument("--json", default=None, help="report file, never replaced (default: results/<time>-bench-...)")
    b.add_argument("--db", default=None, metavar="PATH", help="results database (default as for train)")
    b.add_argument("--tensorboard", default=None, metavar="DIR", help=TENSORBOARD_HELP)
    b.add_argument("--strict", action="store_true",
                   help="refuse to run while a debugging switch that slows training is on (anomaly detection, a "
                        "profiler, CUDA_LAUNCH_BLOCKING, ...); without it each is a warning")
    a = sub.add_parser("ablate", help="each registered trick switched off alone, sorted by what it buys")
    a.add_argument("recipe", nargs="?", default="cifar10-94", help=RECIPE_HELP)
    a.add_argument("--runs", type=int, default=3, help="runs per variant (default 3)")
    _instrument_flags(a)
    a.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="the baseline's config overrides (repeatable)")
    a.add_argument("--model", dest="builder", default=None, metavar="MODULE:FUNCTION", help=MODEL_HELP)
    a.add_argument("--waterfall", default=None, metavar="ORDER",
                   help="tricks (comma-separated) added one at a time to a plain start, cumulatively")
    a.add_argument("--to-target", action="store_true",
                   help="the epochs (and time) each variant needs to reach the target (target_accuracy), by a "
                        "bounded search")
    a.add_argument("--max-probes", type=int, default=None, metavar="K",
                   help="--to-target: epoch values tried per variant, 2 to 20 (default 5)")
    a.add_argument("--tensorboard", default=None, metavar="DIR", help=TENSORBOARD_HELP)
    a.add_argument("--strict", action="store_true",
                   help="refuse to run while a debugging switch that slows training is on (anomaly detection, a "
                        "profiler, CUDA_LAUNCH_BLOCKING, ...); without it each is a warning")
    tu = sub.add_parser("tune", help="the doctor: the performance guide's settings measured here for this recipe, "
                        "ranked by measured gain; --apply FILE writes the recommended ones for train --settings")
    tu.add_argument("recipe", nargs="?", default="cifar10-94", help=RECIPE_HELP)
    tu.add_argument("--runs", type=int, default=3, help="runs per setting, interleaved (default 3)")
    _instrument_flags(tu, epochs_help="the short budget each run trains (default: the recipe's; 0.25 to 1 is typical)")
    tu.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="the current configuration's overrides, each setting is measured against (repeatable)")
    tu.add_argument("--model", dest="builder", default=None, metavar="MODULE:FUNCTION", help=MODEL_HELP)
    tu.add_argument("--only", default=None, metavar="KEY,...",
                    help="measure only these settings (precision, channels_last, compile, cudnn_benchmark, "
                         "cpu_threads, batch_size, optimizer_kernel, eval_batch_size, workers)")
    tu.add_argument("--apply", default=None, metavar="FILE",
                    help="write the recommended settings to FILE (never replaced) for train --settings FILE")
    tu.add_argument("--strict", action="store_true", help="refuse while a debugging switch that slows training is on")
    pr = sub.add_parser("profile", help="where a training step's time goes: phases, operators by layer type, "
                        "memory, FLOPs and MFU; a trace for Perfetto")
    pr.add_argument("recipe", nargs="?", default="cifar10-94", help=RECIPE_HELP)
    pr.add_argument("--dataset", default=None, help=DATASET_HELP)
    pr.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)
    pr.add_argument("--mirror", action="append", type=_mirror, metavar="URL", help=MIRROR_HELP)
    pr.add_argument("--image-size", type=int, default=None, metavar="PX", help=IMAGE_SIZE_HELP)
    pr.add_argument("--device", default="auto", help=DEVICE_HELP)
    pr.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config overrides, as for train (repeatable)")
    pr.add_argument("--model", dest="builder", default=None, metavar="MODULE:FUNCTION", help=MODEL_HELP)
    pr.add_argument("--steps", type=int, default=5, metavar="N",
                    help="training steps recorded, after 1 skipped and 1 warm-up step (default 5)")
    pr.add_argument("--seed", type=int, default=0, help="the seed of the profiled run (default 0)")
    pr.add_argument("--trace", default=None, metavar="FILE",
                    help="the trace (Chrome trace JSON, never replaced; default results/<time>-profile-...trace.json)")
    pr.add_argument("--json", default=None, metavar="FILE", help="also write the report here (never replaced)")
    pr.add_argument("--strict", action="store_true", help="refuse while a debugging switch that slows training is on")
    pk = sub.add_parser("peak", help="this device's peak FLOP/s per precision, measured (matmul and conv) and cached")
    pk.add_argument("--device", default="auto", help=DEVICE_HELP)
    pk.add_argument("--again", action="store_true", help="measure again, replacing the cached figures")
    pk.add_argument("--threads", type=int, default=None, metavar="N",
                    help="CPU: measure with N intra-op threads, as a run with --set cpu_threads=N uses (default: "
                         "torch's)")


def _add_sweep(sub) -> None:
    """sweep: a hyperparameter search on Optuna (instruments/sweep.py)."""
    s = sub.add_parser("sweep", help="hyperparameter search on Optuna: --space KEY=LOW:HIGH[:log] or KEY=A,B,C, "
                       "--trials N of --runs K seeds each; the study is stored and shown in the report")
    s.add_argument("recipe", nargs="?", default="cifar10-94", help=RECIPE_HELP)
    s.add_argument("--space", action="append", required=True, metavar="KEY=LOW:HIGH[:log]|KEY=A,B,C",
                   help="a config key and its range (int or float field; :log for a log scale) or its values "
                        "(repeatable)")
    s.add_argument("--trials", type=int, default=10, help="trials this process adds to the study (default 10)")
    s.add_argument("--runs", type=int, default=3, help="seeds per trial, the same in every trial (default 3)")
    s.add_argument("--objective", choices=("accuracy", "time"), default="accuracy",
                   help="accuracy: mean final test accuracy, maximized (default); time: mean timed seconds, "
                        "minimized, a trial that does not reach the target by the records rule penalized")
    s.add_argument("--sampler", choices=("tpe", "random", "grid"), default="tpe",
                   help="Optuna's sampler (default tpe, seeded by --seed)")
    s.add_argument("--prune", action=argparse.BooleanOptionalAction, default=None,
                   help="stop trials below the median on per-epoch accuracy (MedianPruner; default: on when the "
                        "recipe evaluates every epoch)")
    s.add_argument("--storage", default=None, metavar="URL",
                   help="Optuna RDB storage, e.g. sqlite:///study.db or postgresql://... (default: "
                        "RESULTS.sweeps.db beside the results database)")
    s.add_argument("--study", default=None, metavar="NAME",
                   help="the study's name (default: derived from the recipe, dataset, objective, budget and space)")
    s.add_argument("--resume", action="store_true",
                   help="add trials to an existing study (several processes may share one: --resume in all "
                        "but the first)")
    s.add_argument("--write-settings", default=None, metavar="FILE",
                   help="write the best trial's configuration to FILE (never replaced) for train --settings FILE")
    s.add_argument("--dataset", default=None, help=DATASET_HELP)
    s.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)
    s.add_argument("--mirror", action="append", type=_mirror, metavar="URL", help=MIRROR_HELP)
    s.add_argument("--device", default="auto", help=DEVICE_HELP)
    s.add_argument("--epochs", type=_float, default=None, help=EPOCHS_HELP)
    s.add_argument("--seed", type=int, default=0, help="first seed of every trial's runs, and the sampler's seed "
                   "(default 0)")
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config overrides under every trial (repeatable)")
    s.add_argument("--model", dest="builder", default=None, metavar="MODULE:FUNCTION", help=MODEL_HELP)
    s.add_argument("--json", default=None,
                   help="report file, never replaced (default: a new results/<time>-sweep-<recipe>-<dataset>.json)")
    s.add_argument("--db", default=None, metavar="PATH", help="results database (default as for train)")
    s.add_argument("--quiet", action="store_true", help="print only the table of trials (and warnings)")
    s.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="write each run's TensorBoard event files under DIR/<time>-<recipe>/trial-N/seed-S "
                        "(pip install 'speedrun[tensorboard]')")


def _add_files_and_models(sub) -> None:
    """compare, eval, predict, report, recipes, data prepare and bench-loader."""
    c = sub.add_parser("compare", help="B against baseline A: differences with 95%% CIs, Welch p, time ratio")
    c.add_argument("a", metavar="A", help="baseline: a stored result's id (`speedrun results`) or a result JSON")
    c.add_argument("b", metavar="B", help="candidate: an id or a result JSON")
    c.add_argument("--json", action="store_true", help="the comparison as JSON")
    c.add_argument("--db", default=None, metavar="PATH", help="results database (default as for train)")
    e = sub.add_parser("eval", help="test accuracy of a saved model (--save) on a dataset")
    e.add_argument("model", nargs="?", help="a saved model (PATH, PATH.safetensors or PATH.json)")
    e.add_argument("--ensemble", nargs="+", default=None, metavar="MODEL",
                   help="instead of MODEL: 2+ saved models of one family and dataset; each one's accuracy and the "
                        "accuracy of their mean softmax, with the evaluation seconds")
    e.add_argument("--dataset", required=True, help="as for train: a name or a path")
    e.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)
    e.add_argument("--mirror", action="append", type=_mirror, metavar="URL", help=MIRROR_HELP)
    e.add_argument("--image-size", type=int, default=None, metavar="PX", help="image folders: resize as for train")
    e.add_argument("--device", default="auto", help=DEVICE_HELP)
    e.add_argument("--json", default=None, help="also write the result to this new file")
    e.add_argument("--quiet", action="store_true", help="print only the result (and warnings): no progress")
    e.add_argument("--model", dest="builder", default=None, metavar="MODULE:FUNCTION", help=LOAD_HELP)
    p = sub.add_parser("predict", help="top classes of image files under a saved model")
    p.add_argument("model", nargs="?", help="a saved model (PATH, PATH.safetensors or PATH.json)")
    p.add_argument("images", nargs="*", metavar="IMAGE", help="image files (PNG, JPEG, ...)")
    p.add_argument("--ensemble", nargs="+", default=None, metavar="MODEL",
                   help="instead of MODEL: the mean softmax of 2+ saved models of one family and dataset; give the "
                        "images before --ensemble or after --")
    p.add_argument("--top", type=int, default=5, help="classes shown per image (default 5)")
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument("--model", dest="builder", default=None, metavar="MODULE:FUNCTION", help=LOAD_HELP)
    o = sub.add_parser("report", help="the results database as one HTML page; --readme/--benchmarks tables")
    o.add_argument("--out", default=None, metavar="FILE",
                   help="the HTML file (default speedrun-report.html; replaces only an earlier report)")
    o.add_argument("--readme", default=None, metavar="FILE",
                   help="rewrite the records table between <!-- records:begin/end --> lines in FILE (README.md)")
    o.add_argument("--benchmarks", default=None, metavar="FILE",
                   help="rewrite the ablation tables between <!-- ablation:begin/end --> lines in FILE (BENCHMARKS.md)")
    o.add_argument("--db", default=None, metavar="PATH", help="results database (default as for train)")
    sub.add_parser("recipes", help="list the recipes")
    d = sub.add_parser("data", help="image data: `data prepare SRC DST` writes an image folder tree as shards")
    dp = d.add_subparsers(dest="data_action", metavar="ACTION", required=True, parser_class=_Parser).add_parser(
        "prepare", help="an image folder tree as shards; a second run redoes only the splits that changed",
        description="SRC: SRC/{train,val,test}/<class>/<image> (ImageNet's layout) or SRC/<class>/<image>. DST gets "
                    "SPLIT-NNNNN.tar shards (WebDataset's layout), SPLIT-index.npy, classes.json, manifest.json.")
    dp.add_argument("src", metavar="SRC", help="the image folder tree (read only)")
    dp.add_argument("dst", metavar="DST", help="the shards' folder, outside SRC (created if missing)")
    dp.add_argument("--max-side-px", type=int, default=256, metavar="PX",
                    help="shrink each image's longer side to PX (default 256: 256x192 for a 4:3 photo covers "
                         "training crops up to 192 px, with 2.4 to 3.8 times fewer pixels to decode than FFCV's "
                         "400-500 px; use 400-512 to evaluate at 224 px)")
    dp.add_argument("--quality", type=int, default=90, help="JPEG quality, 1 to 100 (default 90, FFCV's)")
    dp.add_argument("--workers", type=int, default=None, metavar="N",
                    help="processes that decode and encode (default min(8, CPUs)); 0: in this process")
    dp.add_argument("--on-error", choices=("skip", "stop"), default="skip",
                    help="a file that cannot be used: skip it with a warning (default), or stop, leaving DST as it was")
    bl = sub.add_parser("bench-loader", help="images/s of the input path alone: prepared shards, and a plain "
                        "Pillow + DataLoader baseline over the original JPEGs (--baseline)",
                        description="Times decode + augment + copy: from asking for a batch to holding it on the "
                                    "device, cropped, flipped and standardized, after untimed warm-up batches; "
                                    "worker start-up is reported apart. Settings are measured interleaved.")
    bl.add_argument("dir", metavar="DIR", help="the shards' folder (what `speedrun data prepare SRC DIR` wrote)")
    bl.add_argument("--split", default=None, help="the split to read (default train, or the only split in DIR)")
    bl.add_argument("--workers", default="1,2", metavar="N,N,...", help="DataLoader worker processes (default 1,2)")
    bl.add_argument("--res", default="160,224", metavar="PX,PX,...", help="training resolutions (default 160,224)")
    bl.add_argument("--batch", type=int, default=64, help="images per batch (default 64)")
    bl.add_argument("--batches", type=int, default=30, metavar="N",
                    help="timed batches per measurement (default 30: 4 to 6 s each on a 2-core CPU)")
    bl.add_argument("--runs", type=int, default=5, help="measurements per setting, interleaved (default 5)")
    bl.add_argument("--decode-px", type=int, default=256, metavar="PX",
                    help="ours: the square the workers decode to (default 256)")
    bl.add_argument("--device", default="auto", help="auto, cpu, cuda")
    bl.add_argument("--decoder", choices=("auto", "pillow", "nvjpeg"), default="auto",
                    help="ours: auto decodes with nvJPEG (TorchCodec, the [gpu] extra) on CUDA, else Pillow workers")
    bl.add_argument("--baseline", default=None, metavar="SRC",
                    help="the original JPEGs (class folders or a train/val tree): each setting is also measured "
                         "with Pillow + torch DataLoader over them, and the ratio shown")
    bl.add_argument("--json", default=None, metavar="FILE", help="also write the report here (never replaced)")
