"""`--model MODULE:FUNCTION`: the user's network (models/custom.py), from the flag to the config's `model` field
that train, bench, ablate, tune, profile and sweep hand to the recipe, and to the builder eval and predict load a
saved model with."""

from __future__ import annotations

from speedrun.config import parse_set_args
from speedrun.models import custom
from speedrun.recipes import RECIPES
from speedrun.run import runner


def overrides_of(args) -> dict[str, str]:
    """--set's KEY=VALUE pairs, with `model` set from --model (imported and registered here, before any data is
    read); `--set model=...` is refused: a builder is named by --model, which imports it."""
    overrides = parse_set_args(args.overrides)
    if "model" in overrides:
        raise ValueError("model is set with --model MODULE:FUNCTION (which imports the builder), not --set model=")
    spec = getattr(args, "builder", None)
    if spec is None:
        return overrides
    recipe = runner.get_recipe(args.recipe)
    if not hasattr(recipe.make_config(), "model"):
        raise ValueError(f"--model trains through the in-memory recipes ({', '.join(_taking())}); "
                         f"{recipe.name} trains its own network only")
    overrides["model"] = custom.use_builder(spec)
    return overrides


def _taking() -> list[str]:
    """The recipes whose config has a `model` field (their family takes the user's network)."""
    return [name for name, r in RECIPES.items() if hasattr(r.make_config(), "model")]


def given_builder(args):
    """eval / predict: a context in which the builder of a saved model trained with --model is registered and
    compared with each card's (export.load)."""
    return custom.giving(getattr(args, "builder", None))


def refuse_model_key(keys, flag: str) -> None:
    """--vary and --space name settings to change; the network is not one of them (it is imported by --model)."""
    if "model" in keys:
        raise ValueError(f"{flag} model=...: the network is given with --model MODULE:FUNCTION (one a command), "
                         "not varied or searched")
