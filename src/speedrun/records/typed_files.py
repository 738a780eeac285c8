"""The JSON that speedrun writes and reads back, each kind one typed model (pydantic v2), and the one loader that
checks parsed JSON against a model: a training result's runs, a sweep report's trials, and a checkpoint's finished
runs and training state (run/resume.py). A saved model's card is typed in run/model_files.py, beside the recipes
and data limits that bound its fields, which this layer may not import.

Every model is strict (a bool is not an int, a string not a number) and ignores keys it does not name, unless its
keys are exact (_Exact). A refusal is one line, the reason alone (its caller names the file and the fix): what the
kind's table of reasons says of the first field refused, in the order the model names its fields. Parsed JSON from
elsewhere is hostile, so what it can make the loader do is bounded: a list of unbounded length stops at its first
bad item (fail_fast: 4 million bad runs in a 64 MiB result are otherwise 4 million errors, 1.4 GB of memory), a
bounded list is refused for its length before its items are read, and a record's keys are checked as one set, so a
million unknown keys are one error. How large and how deep the JSON may be is the reader's to bound before it
parses (result_file.py's parse_result); no validator runs anything the JSON names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Callable, Generic, Mapping, TypeVar, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, TypeAdapter,
                      ValidationError, ValidationInfo, WrapValidator, field_validator, model_validator)
from pydantic_core import PydanticCustomError

T = TypeVar("T")

# What a finished run's value may be: accuracy a fraction, timed seconds up to ten years.
RUN_RANGES = {"accuracy": (0.0, 1.0), "train_seconds": (0.0, 3.2e8)}
# A sweep trial's objective value: its mean accuracy (a fraction), or for the time objective its mean seconds, plus a
# penalty of about 1e6 s times (1 + shortfall) where it missed the target (instruments/sweep.py): far below this.
MAX_SWEEP_TIME_VALUE = 1e10
# Epochs a row of a run's per-epoch table may be at: a batch larger than the data spans several epochs a step, so
# a row's epoch may exceed the run's; a bound against nonsense, far beyond any run.
MAX_ROW_EPOCH = 1e9
# How long a result's lists may be, checked before any item is read: a 64 MiB file of a million runs or rows would
# otherwise be a million objects (about 500 MiB, seconds). A command trains at most 10,000 seeds (run/prepared.py's
# MAX_RUNS), and a run's table has a row per evaluation: at most one per epoch of its 10,000 (MAX_EPOCHS), and one
# at its end.
MAX_RUNS = 10_000
MAX_HISTORY_ROWS = 20_002
_REFUSED = "refused"  # the error type of a validator's own refusal: its message is the whole reason
_KEYS = "keys"  # the error type of a record whose keys are not its fields: its message is the odd key



def _json_number(value: Any) -> Any:
    """Only what JSON parses a number to: strict pydantic still takes any object with __float__ or __index__ (a
    tensor, numpy's scalars, a Decimal), and a checkpoint's training state holds tensors beside its numbers."""
    if type(value) not in (int, float):
        raise PydanticCustomError("float_type", "Input should be a valid number")
    return value


def _json_int(value: Any) -> Any:
    if type(value) is not int:  # a bool, numpy's int64, a one-element tensor: not JSON's integer
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return value


Number = Annotated[float, BeforeValidator(_json_number)]
Integer = Annotated[int, BeforeValidator(_json_int)]
Fraction = Annotated[Number, Field(ge=RUN_RANGES["accuracy"][0], le=RUN_RANGES["accuracy"][1], allow_inf_nan=False)]
Seconds = Annotated[Number, Field(ge=RUN_RANGES["train_seconds"][0], le=RUN_RANGES["train_seconds"][1],
                                  allow_inf_nan=False)]
Finite = Annotated[Number, Field(allow_inf_nan=False)]
Int64 = Annotated[Integer, Field(ge=-2**63, lt=2**63)]
Count = Annotated[Integer, Field(ge=0, lt=2**63)]
Step = Annotated[Integer, Field(ge=0, le=2**62)]
STRICT = ConfigDict(strict=True, extra="ignore")


def refusal(reason: str) -> PydanticCustomError:
    """For a validator to raise: `reason` is the whole one-line message (the field's table entry is not used)."""
    # pydantic holds a message as UTF-8, which a lone surrogate that a reason quotes (JSON's "\udc80") is not: it
    # travels as its UTF-8 bytes (surrogates too) one character each, and checked() reads it back whole
    carried = reason.encode("utf-8", "surrogatepass").decode("latin-1")
    return PydanticCustomError(_REFUSED, "{reason}", {"reason": carried})


@dataclass(frozen=True)
class Refusal:
    """What a reason is told of the field refused."""
    value: Any  # the field as the JSON holds it (None where it is absent)
    at: tuple[int, ...]  # the list positions on the way to it: runs[3].history[0] is (3, 0)
    data: Any  # the whole JSON checked
    error: str  # pydantic's error type: "missing", "int_type", "string_unicode" ...
    detail: str  # pydantic's message; for a record's keys (_Exact), the odd key
    context: Any  # what the caller passed to checked()


Reasons = Mapping[str, Callable[[Refusal], str]]


@dataclass(frozen=True)
class Typed(Generic[T]):
    """A kind of file: the type its JSON must have, and per field the reason a refusal gives, keyed by the field's
    place: "runs.*.seed" (* for any list position). The nearest entry above a field speaks for it: "runs.*" for a
    run that is no record at all, "" for the whole. Union tags are left out of a place (they are no key of the
    JSON), so they must be in `tags`."""
    adapter: TypeAdapter[T]
    reasons: Reasons
    tags: frozenset[str] = frozenset()


def checked(typed: Typed[T], data: Any, error: Callable[[str], Exception] = ValueError, context: Any = None) -> T:
    """`data` (parsed JSON) as `typed`'s type; else `error` with the one-line reason for its first field refused,
    in the order the type names its fields (the reason alone: the caller names the file and the fix)."""
    try:
        return typed.adapter.validate_python(data, strict=True, context=context)
    except ValidationError as e:
        first = e.errors(include_url=False, include_context=False, include_input=False)[0]
    if first["type"] == _REFUSED:
        raise error(first["msg"].encode("latin-1").decode("utf-8", "surrogatepass"))
    path = [part for part in first["loc"] if part not in typed.tags]
    for end in range(len(path), -1, -1):
        reason = typed.reasons.get(".".join("*" if isinstance(p, int) else str(p) for p in path[:end]))
        if reason is not None:
            at = tuple(p for p in path[:end] if isinstance(p, int))
            raise error(reason(Refusal(_value(data, path[:end]), at, data, first["type"], first["msg"], context)))
    raise AssertionError(f"no reason for {path} in {sorted(typed.reasons)}")  # every table has one for ""


def _value(data: Any, path: list) -> Any:
    """The value at `path` (keys and list positions) in `data`; None where there is none."""
    for part in path:
        if isinstance(data, dict) and isinstance(part, str):
            data = data.get(part)
        elif isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data):
            data = data[part]
        else:
            return None
    return data


class _Exact(BaseModel):
    """A record whose keys are its fields: all the required ones, any of the others, none besides. Checked as one
    set before any field: one _KEYS error naming the first odd key (sorted), however many keys there are."""
    model_config = STRICT

    @model_validator(mode="before")
    @classmethod
    def _keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            fields = cls.model_fields
            odd = (data.keys() - fields.keys()) | ({k for k, f in fields.items() if f.is_required()} - data.keys())
            if odd:
                raise PydanticCustomError(_KEYS, "{odd}", {"odd": sorted(map(repr, odd))[0][:40]})
        return data


def _or_none(value: Any, handler: Callable[[Any], Any]) -> Any:
    try:
        return handler(value)
    except ValidationError:
        return None


Lenient = WrapValidator(_or_none)  # a field read where it holds what its type says, else None: never a refusal


# A training result (result_file.check_train_result)

class _Config(BaseModel):
    model_config = STRICT
    target_accuracy: Annotated[Finite | None, Lenient] = None


class _Run(BaseModel):
    model_config = STRICT
    seed: Int64 | None = None
    steps: Int64 | None = None


class FinishedRun(_Run):
    diverged: None = None
    accuracy: Fraction
    train_seconds: Seconds


class DivergedRun(_Run):
    """A diverged run has no accuracy or time to check."""
    diverged: dict


def _run_kind(run: Any) -> str | None:
    diverged = run.get("diverged") if isinstance(run, dict) else 0
    return "finished run" if diverged is None else "diverged run" if isinstance(diverged, dict) else None


class TrainResult(BaseModel):
    """A training result's runs, as every reader of them takes them; what else it holds is its readers' own. Its
    target accuracy is read where it is a finite number (in its config, for older results), else None."""
    model_config = STRICT
    runs: Annotated[list[Annotated[Union[Annotated[FinishedRun, Tag("finished run")],
                                         Annotated[DivergedRun, Tag("diverged run")]], Discriminator(_run_kind)]],
                    Field(fail_fast=True, max_length=MAX_RUNS)]
    target_accuracy: Annotated[Finite | None, Lenient] = None
    config: Annotated[_Config | None, Lenient] = None

    @model_validator(mode="before")
    @classmethod
    def _not_a_report(cls, data: Any) -> Any:
        if isinstance(data, dict) and "benchmark" in data:
            raise refusal(f"a {str(data['benchmark'])[:40]!r} report, not a training result (no runs of its own)")
        return data


def _run_number(key: str, what: str) -> Callable[[Refusal], str]:
    return lambda r: f"run {r.at[0] + 1} has {key}={r.value!r:.40}, {what}"


TRAIN_RESULT: Typed[TrainResult] = Typed(TypeAdapter(TrainResult), {
    "": lambda r: f"a result is a JSON object, found {type(r.value).__name__}",
    "runs": lambda r: (f"'runs' holds {len(r.value):,} runs, more than one command trains ({MAX_RUNS:,})"
                       if isinstance(r.value, list) else
                       f"'runs' is {type(r.value).__name__}, not a list of runs; not a training result"),
    "runs.*": lambda r: f"run {r.at[0] + 1} is not a run record (a dict whose 'diverged' is null or a dict)",
    **{f"runs.*.{key}": _run_number(key, "not an integer") for key in ("seed", "steps")},
    **{f"runs.*.{key}": _run_number(key, f"not a number in [{low:g}, {high:g}]") for key, (low, high)
       in RUN_RANGES.items()},
}, frozenset({"finished run", "diverged run"}))


# A sweep report's trials (result_file.check_sweep_report): its study section draws what a trial states, so an
# impossible one (an accuracy of 1e308, an interval past the mean's range) would be drawn as "inf%" or take the
# chart with it. The ranges are the objective's: a mean and each end of its ci95 in RUN_RANGES, the objective value
# in [0, 1] or [0, MAX_SWEEP_TIME_VALUE], p in [0, 1].
SWEEP_RANGES = {"accuracy": {"mean": RUN_RANGES["accuracy"], "value": (0.0, 1.0), "p": (0.0, 1.0)},
                "time": {"mean": RUN_RANGES["train_seconds"], "value": (0.0, MAX_SWEEP_TIME_VALUE), "p": (0.0, 1.0)}}


def _ordered(interval: list[float]) -> list[float]:
    if interval[0] > interval[1]:
        raise ValueError("low > high")
    return interval


class _Trial(BaseModel):
    model_config = STRICT
    number: Count
    state: str
    params: dict = Field(default_factory=dict)
    n: Count | None = None


class AccuracyTrial(_Trial):
    mean: Fraction | None = None
    value: Fraction | None = None
    p: Fraction | None = None
    ci95: Annotated[list[Fraction], Field(min_length=2, max_length=2), AfterValidator(_ordered)] | None = None


class TimeTrial(_Trial):
    mean: Seconds | None = None
    value: Annotated[Number, Field(ge=0.0, le=MAX_SWEEP_TIME_VALUE, allow_inf_nan=False)] | None = None
    p: Fraction | None = None
    ci95: Annotated[list[Seconds], Field(min_length=2, max_length=2), AfterValidator(_ordered)] | None = None


TrialT = TypeVar("TrialT", AccuracyTrial, TimeTrial)


class Sweep(BaseModel, Generic[TrialT]):
    model_config = STRICT
    trials: Annotated[list[TrialT], Field(fail_fast=True)]
    best: TrialT | None = None


def _objective(report: Any) -> str | None:
    objective = report.get("objective") if isinstance(report, dict) else None
    return f"{objective} objective" if objective in ("accuracy", "time") else None


def _trial_reasons(place: str, where: Callable[[Refusal], str]) -> dict[str, Callable[[Refusal], str]]:
    """The reasons for a trial at `place` ("trials.*" or "best"), which `where` names as the report does."""
    def ranged(key: str) -> Callable[[Refusal], str]:
        def reason(r: Refusal) -> str:
            objective = r.data["objective"]
            low, high = SWEEP_RANGES[objective][key]
            return (f"sweep report field '{where(r)}.{key}' is {r.value!r:.40}, not a number in [{low:g}, {high:g}] "
                    f"({objective} objective)")
        return reason

    def interval(r: Refusal) -> str:
        objective = r.data["objective"]
        low, high = SWEEP_RANGES[objective]["mean"]
        return (f"sweep report field '{where(r)}.ci95' is {r.value!r:.60}, not an interval [low, high] in "
                f"[{low:g}, {high:g}] ({objective} objective)")

    def state(r: Refusal) -> str:
        return f"sweep report field {where(r)!r} has no state (text) or params (a dict) of a trial"

    return {place: lambda r: f"sweep report field {where(r)!r} is {type(r.value).__name__}, not a trial (a dict)",
            f"{place}.number": lambda r: (f"sweep report field '{where(r)}.number' is {r.value!r:.40}, not a trial "
                                          "number (an integer >= 0)"),
            f"{place}.state": state, f"{place}.params": state,
            f"{place}.n": lambda r: f"sweep report field '{where(r)}.n' is {r.value!r:.40}, not a count of runs",
            **{f"{place}.{key}": ranged(key) for key in ("mean", "value", "p")}, f"{place}.ci95": interval}


SWEEP_REPORT: Typed[Sweep[AccuracyTrial] | Sweep[TimeTrial]] = Typed(
    TypeAdapter(Annotated[Union[Annotated[Sweep[AccuracyTrial], Tag("accuracy objective")],
                                Annotated[Sweep[TimeTrial], Tag("time objective")]], Discriminator(_objective)]),
    {"": lambda r: (f"sweep report field 'objective' is {_value(r.data, ['objective'])!r:.40}, not 'accuracy' or "
                    "'time'"),
     "trials": lambda r: f"sweep report field 'trials' is {type(r.value).__name__}, not a list of trials",
     **_trial_reasons("trials.*", lambda r: f"trials[{r.at[0]}]"), **_trial_reasons("best", lambda r: "best")},
    frozenset({"accuracy objective", "time objective"}))


# A checkpoint's finished runs and a result file's runs, as a resumed command adopts them (run/resume.py), and the
# loop's bookkeeping in a checkpoint's training state (engine/loop.py's LoopState.loop_state). Their history rows
# become a result's rows, so every field is checked. A row's step is at most its run's steps (a run's own, or the
# checkpoint's): the caller passes that as context {"steps": ...}, and a run's expected seed as {"seed": ...}.

def _loss(x: float) -> float:  # inf or NaN too: on CUDA the finite-loss check reads each step's loss a step late
    if x < 0:
        raise ValueError("a negative loss")
    return x


class HistoryRow(_Exact):
    """A row of a run's per-epoch table, as the loops write it (engine/loop.py's last_batch_row and Steps.final,
    the families' table_row): where it was taken, the last batch's loss and accuracy (None where a family does not
    count it), the test accuracy (None between epochs, or with eval_each_epoch off) and the timed seconds so far;
    imagenet's rows add the resolution of its ramp."""
    epoch: Annotated[Number, Field(ge=0.0, le=MAX_ROW_EPOCH, allow_inf_nan=False)]
    step: Step
    train_loss: Annotated[Number, AfterValidator(_loss)] | None
    train_acc: Fraction | None
    val_acc: Fraction | None
    train_seconds: Seconds
    res_px: Annotated[Integer, Field(ge=1, le=2**20)] = Field(default=None)  # absent or an integer: never null

    @field_validator("step")
    @classmethod
    def _within_the_run(cls, step: int, info: ValidationInfo) -> int:
        limit = info.context["steps"]
        if type(limit) is not int or step > limit:  # an unusable limit is refused before the rows
            raise ValueError("past the run's steps")
        return step


class Diverged(_Exact):
    """engine/loop.py's Diverged.to_dict: any of its fields, no other. Its texts go into a result, whose database
    row a string UTF-8 cannot encode (JSON's "\\udc80") would lose: pydantic refuses one in a string whose length
    it bounds (error "string_unicode"; tests/test_redteam_outputs_messages.py holds it to that)."""
    step: Step = 0
    total_steps: Step = 0
    loss: Annotated[str, Field(max_length=1000)] = ""
    lr: Number | None = None
    message: Annotated[str, Field(max_length=1000)] = ""


class RunRecord(_Exact):
    """A finished run (engine/loop.py's RunResult.to_dict), checked field by field as a training result's runs
    are (TRAIN_RESULT, RUN_RANGES): its seed the one expected, and a diverged run without accuracy or time."""
    seed: Integer
    accuracy: Fraction | None
    train_seconds: Seconds | None
    epochs: Annotated[Number, Field(ge=0.0, le=MAX_ROW_EPOCH, allow_inf_nan=False)]
    steps: Step
    diverged: Diverged | None = Field(default=None, validate_default=True)  # absent: a finished run
    history: Annotated[list[HistoryRow], Field(fail_fast=True, max_length=MAX_HISTORY_ROWS)]

    @field_validator("seed")
    @classmethod
    def _expected(cls, seed: int, info: ValidationInfo) -> int:
        if seed != info.context["seed"]:
            raise ValueError("another seed")
        return seed

    @field_validator("diverged")
    @classmethod
    def _scored_unless_diverged(cls, diverged: Diverged | None, info: ValidationInfo) -> Diverged | None:
        if any((info.data.get(key) is None) != (diverged is not None) for key in ("accuracy", "train_seconds")):
            raise ValueError("a finished run has an accuracy and a time, a diverged one neither")
        return diverged


class LoopState(BaseModel):
    """The bookkeeping every family's training state holds; the family's own parts (model, optimizers,
    generators) are the family's to check as it loads them (engine/checkpoint.py's restoring)."""
    model_config = STRICT
    step: Step
    seconds: Seconds
    epochs_done: Step
    history: Annotated[list[HistoryRow], Field(fail_fast=True, max_length=MAX_HISTORY_ROWS)]
    last_batch: HistoryRow | None = None

    @field_validator("step")
    @classmethod
    def _the_checkpoints(cls, step: int, info: ValidationInfo) -> int:
        if type(info.context["steps"]) is not int or step != info.context["steps"]:
            raise ValueError("not the checkpoint's step")
        return step


def _row_reasons(place: str, name: Callable[[Refusal], str]) -> dict[str, Callable[[Refusal], str]]:
    """The reasons for a row at `place` ("history.*", "last_batch"), each begun with the row's `name`."""
    def row(r: Refusal) -> str:
        if r.error == _KEYS:
            return f"{name(r)}: not the per-epoch table's columns ({r.detail})"
        return f"{name(r)}: not a row of the per-epoch table"

    def field(key: str) -> Callable[[Refusal], str]:
        return lambda r: f"{name(r)}: {key}={r.value!r:.40} out of range"

    return {place: row, **{f"{place}.{key}": field(key) for key in HistoryRow.model_fields}}


def _history_row(r: Refusal) -> str:
    return f"history row {r.at[-1] + 1}"


_OUT_OF_RANGE = "accuracy, timed seconds, divergence, epochs or steps out of range"


def _diverged_text(key: str) -> Callable[[Refusal], str]:
    return lambda r: (f"the string at diverged.{key} is no text UTF-8 can hold" if r.error == "string_unicode"
                      else _OUT_OF_RANGE)


RUN_RECORD: Typed[RunRecord] = Typed(TypeAdapter(RunRecord), {
    "": lambda r: f"not a run record's fields ({r.detail})" if r.error == _KEYS else "not a run record",
    "seed": lambda r: f"seed={r.value!r:.40}, not {r.context['seed']}",
    **{key: lambda r: _OUT_OF_RANGE for key in ("accuracy", "train_seconds", "epochs", "steps", "diverged")},
    "diverged.loss": _diverged_text("loss"), "diverged.message": _diverged_text("message"),
    "history": lambda r: (f"its history holds {len(r.value):,} rows, more than a run makes ({MAX_HISTORY_ROWS:,})"
                          if isinstance(r.value, list) else "its history is not a list"),
    **_row_reasons("history.*", _history_row),
})

LOOP_STATE: Typed[LoopState] = Typed(TypeAdapter(LoopState), {
    "": lambda r: "not a training state",
    "step": lambda r: f"step {repr(r.value)[:20]}, while the checkpoint is of step {str(r.context['steps'])[:20]}",
    "seconds": lambda r: f"timed seconds {repr(r.value)[:20]} out of range",
    "epochs_done": lambda r: "epochs done out of range",
    "history": lambda r: (f"its history holds {len(r.value):,} rows, more than a run makes ({MAX_HISTORY_ROWS:,})"
                          if isinstance(r.value, list) else "its history is not a list"),
    **_row_reasons("history.*", _history_row), **_row_reasons("last_batch", lambda r: "last batch"),
})
