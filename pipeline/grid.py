"""`flipguard study RECIPE --grid KEY=V1,V2 [--grid KEY=...]`: the recipe's training settings
varied, every variant's before/after side by side.

A variant is the recipe with one value of each --grid key (the cartesian product of the grids),
planned as a study of its own (study_plan.StudyPlan, in OUT/grid/VARIANT/) whose stages join the one
study: one study.json, one runner, a stage skipped while its fingerprint holds, `--jobs` running
independent stages (the variants' among them) side by side. What a variant's values do not reach
is shared, not recomputed: the base model's runs (the baselines, the prompting mitigations, the
train-split runs) stay in OUT; the pairs and each trainer's train, merge and eval stages stay in
OUT when no grid key reaches them, else go to OUT/grid/<the values that reach them>/, shared by
the variants with those values (a `dpo.beta` grid trains SFT once; a `pairs.*` key gives one pairs
stage per pairs setting). A key reaches the pairs when it is a pairs: key, a trainer when it is
a pairs: key, that trainer's or a top-level one. Each variant's protocols (AFR and stick-or-switch
measure every condition in one run, the baseline among them), comparison and wandb run are its own.

The `grid` stage reads every variant's comparison files (comparison.csv, comparison_protocols.csv,
transfer.csv; nothing recomputed) into one table, a row per trained model: what it removed (the
planted behaviours before -> after, with CIs), what it damaged (what must stay, with the paired
CIs of transfer.csv), the flags the comparison set, and two numbers for the removed-vs-damaged
chart (pipeline/view/grid.py says how they are made; the study's page shows it).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
import re
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import yaml

from flipguard.config import did_you_mean, recipe_keys, trainers, validate_recipe
from flipguard.errors import UserError
from flipguard.eval.dds.metrics import TOTAL_AVG
from flipguard.eval.plots import MIN_FONT, TITLE_FONT, pyplot, save_figure
from flipguard.eval.task_registry import get_task
from flipguard.files import atomic_write_text
from flipguard.pipeline.compare import BASELINE, protocol_flags
from flipguard.pipeline.fingerprints import stage_fingerprints
from flipguard.pipeline.study_plan import Stage, StudyPlan, recipe_trainers
from flipguard.pipeline.transfer import BIAS_METRICS, TRANSFER_CSV
from flipguard.pipeline.view.answer import HEADLINE, PROTOCOLS_CSV
from flipguard.pipeline.view.grid import (
    EVERY_VARIANT,
    GRID_DIR,
    GRID_STAGE,
    VARIANTS_CSV,
    VARIANTS_MD,
    VARIANTS_PNG,
    render_markdown,
    variant_table,
    variant_verdicts,
)
from flipguard.pipeline.view.runs import read_csv
from flipguard.train.utils import PROVENANCE_FILE

GRID_HELP = ("Vary recipe settings: KEY=V1,V2,... (a recipe key, a section's dotted: dpo.beta, dpo.learning_rate, "
             "sft.max_steps, pairs.strategy, pairs.accept_weight, lora_r; values typed as the recipe's YAML: 1.0e-4, not "
             "1e-4, which YAML reads as text). Given "
             "more than once, every combination is a variant. Each variant trains, merges, evaluates and compares "
             "against the one baseline; what its values do not reach (the baseline, the train-split runs, the pairs "
             "without a pairs key, a trainer no key reaches) runs once for all. OUT/grid/variants.md and .csv: what "
             "each trained model removed and damaged, with CIs and flags; OUT/grid/variants.png: removed vs "
             "damaged, also on the study's page.")
# sections a grid does not vary: what every variant shares (its baseline) or how the study reports
NOT_VARIED = {"eval": "every variant is measured by the baseline's evaluation",
              "tracking": "it names where the variants' runs go"}
STUDY_OWN = ("pairs.dir", "pairs.records")  # the study's own folders
# keys (at the top level or in any section) naming a folder a run writes or resumes from: the study sets
# them for each variant's own folders (OUT/grid/VARIANT/...), so a grid of them would run identical variants
FOLDER_KEYS = ("output_dir", "logging_dir", "resume_from_checkpoint")


# ------------------------------------------------------------------ the grid

def value_text(value: Any) -> str:
    """A grid value as a variant's name shows it: its YAML (0.1, flips, [q_proj, v_proj])."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def variant_name(values: dict[str, Any]) -> str:
    return ",".join(f"{k}={value_text(v)}" for k, v in values.items())


def folder_name(values: dict[str, Any]) -> str:
    """A variant's folder (and its stages' prefix): its name with anything but letters, digits and . _ = , + -
    made '_'."""
    return re.sub(r"[^A-Za-z0-9._=,+-]+", "_", variant_name(values))


def with_values(raw: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """The recipe with each dotted key set (`dpo.beta` in the dpo: section, `lora_r` at the top level)."""
    raw = copy.deepcopy(raw)
    for key, value in values.items():
        section, _, sub = key.rpartition(".")
        if section:
            raw[section] = {**(raw.get(section) or {}), sub: value}
        else:
            raw[key] = value
    return raw


def _unknown_key_hint(key: str, keys: list[str], studied: list[str]) -> str:
    """'; did you mean ...?': a section's key named without its section (a trainer's: of the study's
    trainers), else the closest key."""
    sections = [k for k in keys if k.endswith("." + key) and k.split(".")[0] not in set(trainers()) - set(studied)]
    if sections:
        return f"; did you mean {' or '.join(map(repr, sections))}?"
    return did_you_mean(key, keys)


def parse_grid(specs: list[str], raw: dict[str, Any], studied: list[str]) -> list[tuple[str, list[Any]]]:
    """[(key, values)] of the --grid options, each checked as the recipe's own value would be
    (config.validate_recipe: type and bounds), a mistake one line naming the option."""
    keys = recipe_keys(raw)
    grid: list[tuple[str, list[Any]]] = []
    for spec in specs:
        key, sep, text = (part.strip() for part in spec.partition("="))
        if not sep or not key or not text:
            raise UserError(f"--grid {spec}: give KEY=V1,V2,... (a recipe key and its values, e.g. --grid dpo.beta=0.1,0.5)")
        if key not in keys:
            raise UserError(f"--grid {spec}: {key!r} is not a recipe key{_unknown_key_hint(key, keys, studied)}")
        section = key.rpartition(".")[0]
        if section in NOT_VARIED:
            raise UserError(f"--grid {spec}: a grid varies the pairs and the training (a trainer's section, pairs:, "
                            f"the top level), not {section}: ({NOT_VARIED[section]}); set it for the whole study instead")
        if key in STUDY_OWN or key.rpartition(".")[2] in FOLDER_KEYS:
            raise UserError(f"--grid {spec}: {key} names a folder, which the study sets itself (each variant writes "
                            f"under OUT/{GRID_DIR}/VARIANT/); a grid varies settings, not where they are written")
        if section in trainers() and section not in studied:
            raise UserError(f"--grid {spec}: this study trains no {section} (it trains {', '.join(studied)})")
        if key in dict(grid):
            raise UserError(f"--grid {spec}: {key} is given twice; give all its values in one --grid")
        if re.search(r"(^|,)\s*(,|$)", text):  # YAML would drop a trailing one silently
            raise UserError(f"--grid {spec}: an empty value (values are separated by commas)")
        try:
            values = yaml.safe_load(f"[{text}]")
        except yaml.YAMLError as exc:
            raise UserError(f"--grid {spec}: not YAML values ({getattr(exc, 'problem', None) or exc})") from None
        shown = [value_text(v) for v in values]
        if len(set(shown)) < len(shown):
            raise UserError(f"--grid {spec}: a value is given twice")
        for value, as_text in zip(values, shown):
            validate_recipe(with_values(raw, {key: value}), f"--grid {key}={as_text}")
        grid.append((key, values))
    return grid


def reaches(key: str, part: str) -> bool:
    """Whether a grid key changes what `part` reads: the pairs read pairs:, a trainer its section,
    the top level and the pairs."""
    section = key.rpartition(".")[0]
    return section == "pairs" if part == "pairs" else section in ("", "pairs", part)


# ------------------------------------------------------------------ the plan

class GridPlan(StudyPlan):
    """The study of every variant of a grid: each variant's stages, the shared ones once (checked:
    the same fingerprint from every variant), then the `grid` stage."""

    def __init__(self, recipe_path, raw: dict[str, Any], out, *, grid: list[str], print_fn: Callable[[str], None] = print,
                 **kwargs):
        self.recipe_raw = copy.deepcopy(raw)  # before the study's folders are written into it
        # a typo or a refused value is one line before anything else (the plan's checks resolve the model)
        self.grid = parse_grid(list(grid), self.recipe_raw,
                               recipe_trainers(raw, (raw.get("eval") or {}).get("trainers")))
        super().__init__(recipe_path, raw, out, print_fn=print_fn, **kwargs)

    def folder(self, values: dict[str, Any], part: str | None = None) -> Path:
        """Where `part` of a variant writes (None: the variant's own stages): OUT/grid/<the values that reach
        it>, or OUT when none does."""
        reaching = {k: v for k, v in values.items() if part is None or reaches(k, part)}
        return self.out / GRID_DIR / folder_name(reaching) if reaching else self.out

    def stage_name(self, stage: Stage) -> str:
        """A variant's stage as the study names it: prefixed with its grid folder ('dpo.beta=0.1:dpo'),
        a stage that writes in OUT (shared) as it is."""
        rel = stage.clear[0].relative_to(self.out) if stage.clear[0].is_relative_to(self.out) else None
        return f"{rel.parts[1]}:{stage.name}" if rel is not None and rel.parts[0] == GRID_DIR else stage.name

    def build_stages(self) -> list[Stage]:
        if not self.trainers:
            raise UserError(f"{self.recipe_path}: --grid: this study trains nothing (no trainer section, or "
                            "eval.trainers empty): a grid varies the training")
        keys = [k for k, _ in self.grid]
        self.variants = [dict(zip(keys, combo)) for combo in itertools.product(*(v for _, v in self.grid))]
        names = [folder_name(v) for v in self.variants]
        if len(set(names)) < len(names):
            raise UserError(f"--grid: two variants have the same folder name ({names}); give values that differ in "
                            "letters, digits or . _ = , + -")
        stages: dict[str, Stage] = {}
        built: dict[str, tuple[str, dict[str, Any]]] = {}  # stage -> (fingerprint, the variant that built it)
        self.variant_plans: list[StudyPlan] = []
        for values in self.variants:
            homes = {"base": self.out, "pairs": self.folder(values, "pairs"),
                     **{t: self.folder(values, t) for t in self.trainers}}
            plan = StudyPlan(self.recipe_path, with_values(self.recipe_raw, values), self.folder(values),
                             print_fn=self.print, homes=homes, variant=values)
            for key, value in values.items():  # a key the study sets itself would run the same variant twice
                if _value_at(plan.raw, key) != value:
                    raise UserError(f"--grid {key}={value_text(value)}: the study sets {key} itself ("
                                    f"{value_text(_value_at(plan.raw, key))} in this variant); a grid cannot vary it")
            self.variant_plans.append(plan)
            fps = stage_fingerprints(plan.stages)
            renamed = {s.name: self.stage_name(s) for s in plan.stages}
            for stage in plan.stages:
                name = renamed[stage.name]
                if name in built:
                    if built[name][0] != fps[stage.name]:
                        differ = [k for k in keys if built[name][1][k] != values[k]]
                        raise UserError(f"--grid {', '.join(differ)}: changes the stage {name}, which the variants share "
                                        "(a grid varies the pairs and the training: a trainer's section, pairs:, the top "
                                        "level's training and LoRA keys; not the model the baseline measures)")
                    continue
                built[name] = (fps[stage.name], values)
                prefix = name[: -len(stage.name)]
                stages[name] = dataclasses.replace(stage, name=name, inputs=tuple(renamed[i] for i in stage.inputs),
                                                   recorded=_prefixed(stage.recorded, prefix))
        stages[GRID_STAGE] = self.grid_stage([n for n in stages if n.endswith(":compare")])
        return list(stages.values())

    def effective_recipes(self) -> list[tuple[Path, dict[str, Any]]]:
        return [(self.recipe_file, self.raw)] + [(p.recipe_file, p.raw) for p in self.variant_plans]

    def trained_models(self) -> list[dict[str, Any]]:
        """Every model the grid trains, once: its trainer, the grid values that reach it, the comparison that
        measured it (the first variant's with those values) and its adapter."""
        models: dict[tuple[str, Path], dict[str, Any]] = {}
        for plan in self.variant_plans:
            for trainer in plan.trainers:
                home = plan.home(trainer)
                models.setdefault((trainer, home), {"trainer": trainer, "condition": trainers()[trainer].label,
                                         "values": {k: v for k, v in plan.variant.items() if reaches(k, trainer)},
                                         "compare": str(plan.out / "compare"),
                                         "adapter": str(home / "train" / trainer)})
        return sorted(models.values(), key=lambda m: list(trainers()).index(m["trainer"]))  # a trainer's rows together

    def grid_stage(self, compares: list[str]) -> Stage:
        folder = self.out / GRID_DIR
        outputs = tuple(folder / f for f in (VARIANTS_CSV, VARIANTS_MD, VARIANTS_PNG))
        models, keys = self.trained_models(), [k for k, _ in self.grid]
        self.artefacts += [("variant table", folder / VARIANTS_MD), ("removed vs damaged", folder / VARIANTS_PNG)]
        self.artefacts += [(f"comparison: {variant_name(p.variant)}", p.out / "compare" / "comparison.md")
                           for p in self.variant_plans]

        def run() -> None:
            write_grid(folder, keys, models)

        return Stage(GRID_STAGE, f"the {len(models)} trained models side by side: what each removed and damaged "
                             f"({folder / VARIANTS_MD}, {VARIANTS_PNG})",
                     {"keys": keys, "models": json.loads(json.dumps(models, default=str))}, tuple(compares),
                     outputs, outputs, run)


def _value_at(raw: dict[str, Any], key: str) -> Any:
    """The value of a dotted key (`dpo.beta`, `lora_r`) in a recipe."""
    section, _, sub = key.rpartition(".")
    return (raw.get(section) or {}).get(sub) if section else raw.get(key)


def _prefixed(recorded: Callable[[], dict[str, Any]] | None, prefix: str) -> Callable[[], dict[str, Any]] | None:
    """A variant stage's record in study.json under its own names ('dpo.beta=0.1:transfer')."""
    if recorded is None or not prefix:
        return recorded
    return lambda: {prefix + k: v for k, v in recorded().items()}


# ------------------------------------------------------------------ the table

def _read(path: Path) -> pd.DataFrame | None:
    return pd.read_csv(path) if path.is_file() else None


def _x(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _true(value: Any) -> bool:
    return value is True or str(value) == "True"


def model_row(model: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """One trained model's row, from its comparison's files: levels before (the baseline) and after with
    the after's 95% CI, the paired changes (transfer.csv), the flags, removal and damage (pp)."""
    compare, name = Path(model["compare"]), model["condition"]
    row: dict[str, Any] = {"variant": variant_name(model["values"]) or EVERY_VARIANT, "trainer": name,
                           **{k: value_text(model["values"][k]) if k in model["values"] else "" for k in keys},
                           "removal": math.nan, "damage": math.nan, "flags": ""}
    removed: list[float] = []  # drops (pp) of the planted behaviours
    kept: list[float] = []     # drops (pp) of what must stay
    flags: list[str] = []
    dds = _read(compare / "comparison.csv")
    if dds is not None:
        total = dds[dds["dataset"] == TOTAL_AVG].set_index("condition")
        if name in total.index and BASELINE in total.index:
            b, r = total.loc[BASELINE], total.loc[name]
            row.update({"dds.before": _x(b["dds"]), "dds.after": _x(r["dds"]), "dds.ci_low": _x(r["dds_ci_low"]),
                        "dds.ci_high": _x(r["dds_ci_high"])})
            removed.append(abs(row["dds.before"]) - abs(row["dds.after"]))  # towards 0: past it is no removal
            for c in ("own_c1_true", "own_c1_false", "c1_true_change", "c1_false_change"):
                row[c] = _x(r[c])
            kept += [-row["c1_true_change"], -row["c1_false_change"]]
            row["invalid_before"], row["invalid_after"] = _x(b["invalid_judgments"]), _x(r["invalid_judgments"])
            flags += ["†"] * _true(r["over_correction"]) + ["‡"] * _true(r["c1_damage"])
    protocols = _read(compare / PROTOCOLS_CSV)
    if protocols is not None and not protocols.empty:
        marks = protocol_flags(protocols)
        for protocol, rows in protocols.groupby("protocol", sort=False):
            metrics = list(dict.fromkeys(rows["metric"]))
            headline = HEADLINE.get(protocol) if HEADLINE.get(protocol) in metrics else metrics[0]
            base = rows["condition"].iloc[0]  # the first condition the protocol measured: its baseline
            for metric, drops in ((headline, removed), *((m, kept) for m in get_task(protocol).guarded_metrics)):
                sel = rows[rows["metric"] == metric]
                datasets = list(dict.fromkeys(sel["dataset"]))
                for ds in datasets:
                    at = sel[sel["dataset"] == ds]
                    b, r = at[at["condition"] == base], at[at["condition"] == name]
                    if b.empty or r.empty:
                        continue
                    col = f"{protocol}.{metric}" + (f"@{ds}" if len(datasets) > 1 else "")
                    row.update({f"{col}.before": _x(b["value"].iloc[0]), f"{col}.after": _x(r["value"].iloc[0]),
                                f"{col}.ci_low": _x(r["ci_low"].iloc[0]), f"{col}.ci_high": _x(r["ci_high"].iloc[0])})
                    drops.append(row[f"{col}.before"] - row[f"{col}.after"])
            flags += [marks[k] for k in marks if k[0] == name and k[1] == protocol]
    transfer = _read(compare / TRANSFER_CSV)
    if transfer is not None:
        mine = transfer[transfer["condition"] == name]
        bias = mine["metric"].isin(BIAS_METRICS)
        measured = mine["meaningful"].astype(str) == "True"  # a cell without numbers counts neither way
        for protocol, cells in mine[bias & measured & (mine["role"] != "untargeted")].groupby("protocol", sort=False):
            row[f"{protocol}.cells_down"] = int((cells["ci_high"] < 0).sum())
            row[f"{protocol}.cells"] = len(cells)
        for r in mine[~bias & (mine["role"] == "untargeted")].itertuples():
            row.update({f"{r.cell}.change": _x(r.change), f"{r.cell}.ci_low": _x(r.ci_low), f"{r.cell}.ci_high": _x(r.ci_high)})
    removed, kept = [d for d in removed if d == d], [d for d in kept if d == d]
    row["removal"] = sum(removed) / len(removed) if removed else math.nan
    row["damage"] = max(0.0, *kept) if kept else math.nan
    row["flags"] = " ".join(dict.fromkeys("".join(flags)))
    row["train_loss"] = train_loss(Path(model["adapter"]))
    row["chosen_step"], row["budget"] = chosen_step(Path(model["adapter"]))
    row["compare"] = str(compare)
    return row


def train_loss(adapter: Path) -> float:
    """The trainer's mean training loss (its provenance's log history: the Trainer's train_loss)."""
    try:
        history = json.loads((adapter / PROVENANCE_FILE).read_text(encoding="utf-8")).get("log_history") or []
    except (OSError, ValueError):
        return math.nan
    return next((_x(h["train_loss"]) for h in reversed(history) if "train_loss" in h), math.nan)


def chosen_step(adapter: Path) -> tuple[float, float]:
    """(the step whose checkpoint the trainer kept, its max_steps budget) with validation on (its
    provenance's `validation`, train/validation.py); NaN without."""
    try:
        info = json.loads((adapter / PROVENANCE_FILE).read_text(encoding="utf-8")).get("validation") or {}
    except (OSError, ValueError):
        return math.nan, math.nan
    chosen = (info.get("chosen") or {}).get("step")
    return (_x(chosen) if chosen is not None else math.nan), _x(info.get("budget", math.nan))


# where a point's label may go, in points from the point: right/left and above/below first, then further out
LABEL_OFFSETS = [(dx, dy) for r in (1, 2, 3) for dx, dy in ((7, 4), (7, -4), (-7, 4), (-7, -4), (0, 9), (0, -9))
                 for dx, dy in [(dx * r, dy * r)]]
FRAME_MARGIN_PX = 3  # a label keeps this far inside the axes' frame
MIN_SPAN_PP = 5.0  # an axis shows at least this many pp (all models at 0 damage: 0 to 5, not a sliver around 0)
POINT_LABEL = "point-label"  # the gid of a point's label (eval/plots.py lists it with its box in the PNG)


def _axis_limits(values: list[float]) -> tuple[float, float, float]:
    """(low, high, where a point without this coordinate goes): the data and 0 (removal and damage are
    read from 0) with room on both sides, so no point sits on the frame; an unmeasured coordinate goes in
    the room below the data, its own place."""
    finite = [v for v in values if v == v]
    lo, hi = min([0.0, *finite]), max([*finite, 0.0])
    span = max(hi - lo, MIN_SPAN_PP)
    return lo - 0.22 * span, lo + span + 0.14 * span if hi - lo < MIN_SPAN_PP else hi + 0.14 * span, lo - 0.12 * span


def plot_tradeoff(frame: pd.DataFrame, path: Path) -> None:
    """Removed vs damaged: a point per trained model, numbered, the numbers named in a key under the axes.
    Models at one spot share one label ('1, 2'); each label goes where it overlaps no other label, no point
    and not the frame (the first such of LABEL_OFFSETS); a model whose damage or removal could not be
    measured is a hollow point in the room left for it below (or left of) the data on that axis."""
    from matplotlib.lines import Line2D

    plt = pyplot()
    n = len(frame)
    fig, ax = plt.subplots(figsize=(8.0, 4.6 + 0.24 * n))
    xs, ys = [float(v) for v in frame["damage"]], [float(v) for v in frame["removal"]]
    x_lo, x_hi, x_none = _axis_limits(xs)
    y_lo, y_hi, y_none = _axis_limits(ys)
    ax.set_xlim(x_lo, x_hi)
    ax.set_ylim(y_lo, y_hi)
    handles, spots = [], []
    for k, (r, x, y) in enumerate(zip(frame.itertuples(), xs, ys)):
        spot = (x if x == x else x_none, y if y == y else y_none)
        marker = {"SFT": "o", "DPO": "s", "KTO": "^"}.get(r.trainer, "D")
        filled = x == x and y == y
        ax.scatter(*spot, s=60, marker=marker, color=f"C{k % 10}", facecolors=f"C{k % 10}" if filled else "none",
                   zorder=3)
        spots.append(spot)
        handles.append(Line2D([], [], marker=marker, linestyle="", color=f"C{k % 10}",
                              markerfacecolor=f"C{k % 10}" if filled else "none", label=f"{k + 1}  {r.trainer} {r.variant}"))
    ax.axhline(0, color="black", lw=0.6)
    ax.axvline(0, color="black", lw=0.6)
    for axis, values, none, lo in ((ax.yaxis, ys, y_none, y_lo), (ax.xaxis, xs, x_none, x_lo)):
        if any(v != v for v in values):  # the room of the unmeasured: shaded, its tick 'n/m', no number there
            finite_lo = min([0.0, *(v for v in values if v == v)])
            ticks = [t for t in axis.get_ticklocs() if finite_lo - 1e-9 <= t <= axis.get_view_interval()[1]]
            axis.set_ticks([none, *ticks], ["n/m", *(f"{t:g}" for t in ticks)])
            span = (lo, (none + finite_lo) / 2)
            (ax.axhspan if axis is ax.yaxis else ax.axvspan)(*span, color="#eeeeee", zorder=0)
    unknown = [w for w, vs in (("removal", ys), ("damage", xs)) if any(v != v for v in vs)]
    if unknown:
        ax.set_title("Removed vs damaged, per trained model (up and to the left is better)\nhollow: "
                     + " / ".join(unknown) + " not measured or not meaningful (drawn at n/m on that axis)",
                     fontsize=TITLE_FONT)
    else:
        ax.set_title("Removed vs damaged, per trained model (up and to the left is better)", fontsize=TITLE_FONT)
    ax.set_xlabel("damage: largest drop of what must stay (pp)", fontsize=MIN_FONT)
    ax.set_ylabel("removal: mean drop of the planted\nbehaviours (pp)", fontsize=MIN_FONT)
    ax.tick_params(labelsize=MIN_FONT)
    key = fig.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.01, 0.0), fontsize=MIN_FONT, frameon=False)
    for text in key.get_texts():
        text.set_parse_math(False)
    fig.tight_layout(rect=(0, (0.3 + 0.24 * n) / (4.6 + 0.24 * n), 1, 1))
    _label_points(fig, ax, spots)
    save_figure(fig, path)


def _label_points(fig, ax, spots: list[tuple[float, float]]) -> None:
    """One label per spot ('1, 2' for models drawn at one place), each at the first offset whose box stays
    inside the frame and clear of the other labels and of every point."""
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer).padded(-FRAME_MARGIN_PX)
    px = [tuple(ax.transData.transform(s)) for s in spots]
    groups: list[list[int]] = []
    for k, p in enumerate(px):  # models within a marker's width of each other share a label
        home = next((g for g in groups if abs(px[g[0]][0] - p[0]) < 6 and abs(px[g[0]][1] - p[1]) < 6), None)
        if home is None:
            groups.append([k])
        else:
            home.append(k)
    marker_boxes = [(x - 6, y - 6, x + 6, y + 6) for x, y in px]
    placed: list[tuple[float, float, float, float]] = []

    def clear(b) -> bool:
        inside = frame.x0 <= b.x0 and b.x1 <= frame.x1 and frame.y0 <= b.y0 and b.y1 <= frame.y1
        return inside and not any(b.x0 < o[2] and o[0] < b.x1 and b.y0 < o[3] and o[1] < b.y1
                                  for o in [*placed, *marker_boxes])

    for group in groups:
        text = ", ".join(str(k + 1) for k in group)
        color = f"C{group[0] % 10}" if len(group) == 1 else "black"
        best = None
        for dx, dy in LABEL_OFFSETS:
            label = ax.annotate(text, spots[group[0]], xytext=(dx, dy), textcoords="offset points", fontsize=MIN_FONT,
                                fontweight="bold", color=color, ha="left" if dx > 0 else "right" if dx < 0 else "center",
                                va="bottom" if dy > 0 else "top")
            box = label.get_window_extent(renderer)
            if clear(box):
                best = (label, box)
                break
            label.remove()
        if best is None:  # nowhere clear (a crowded chart): beside the point, inside the frame
            label = ax.annotate(text, spots[group[0]], xytext=(7, 4), textcoords="offset points", fontsize=MIN_FONT,
                                fontweight="bold", color=color, va="bottom")
            best = (label, label.get_window_extent(renderer))
        best[0].set_gid(POINT_LABEL)
        placed.append((best[1].x0, best[1].y0, best[1].x1, best[1].y1))


def write_grid(folder: Path, keys: list[str], models: list[dict[str, Any]]) -> pd.DataFrame:
    """variants.csv, then variants.md and variants.png from what the CSV holds (the page and the terminal read it too)."""
    frame = pd.DataFrame([model_row(m, keys) for m in models])
    atomic_write_text(folder / VARIANTS_CSV, frame.to_csv(index=False, float_format="%.4f"))
    rows = read_csv(folder / VARIANTS_CSV)
    atomic_write_text(folder / VARIANTS_MD, render_markdown(rows, keys))
    plot_tradeoff(frame, folder / VARIANTS_PNG)
    return frame


def print_grid(study: Path, stages: dict[str, Any], print_fn: Callable[[str], None] = print) -> None:
    """The grid on the terminal: the answer's line per trained model (the page's, pipeline/view/grid.py), then
    the variant table's first columns as variants.md has them (its cells: '–' and n/m, never nan)."""
    folder = study / GRID_DIR
    if not (folder / VARIANTS_CSV).is_file():
        return
    verdicts, notes = variant_verdicts(study, stages)
    lines = ["\nThe answer, per variant (each against the baseline; the page: view.html):"]
    lines += [f"  {v['text']}" for v in verdicts] + [f"  {n}" for n in notes]
    head, body = variant_table(read_csv(folder / VARIANTS_CSV))
    shown = [head.index(h) for h in ("variant", "trainer", "removal (pp)", "damage (pp)", "flags")]
    widths = [max(len(head[i]), *(len(cells[i]) for cells in body)) + 2 for i in shown]
    lines += [f"\nRecipe grid ({folder / VARIANTS_MD}: every column; the chart: {folder / VARIANTS_PNG}):",
              "".join(f"{head[i]:<{w}}" for i, w in zip(shown, widths)).rstrip()]
    lines += ["".join(f"{cells[i]:<{w}}" for i, w in zip(shown, widths)).rstrip() for cells in body]
    print_fn("\n".join(lines))
