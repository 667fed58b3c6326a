"""Which planted behaviour does each pair target, and what did training do to it?

For a finished `flipguard study` on an organism (default: the demo's runs/demo), this reads the
pair set, the base model's train-split conversations, the trained models and the test-split
records, and writes one page (bench/mitigation_coverage.md + .json) that answers, per planted
behaviour of the organism (organism.json `planted`):

1. pairs: how many pair rows target it (by protocol, scenario, turn and the kind of the option
   argued for or offered), and how many of those correct the base model (its reference
   log-probability prefers the rejected reply: the rows a mitigation learns from; the others
   only ask it to keep what it does);
2. the base model's train-split conversations: how many of that kind exist at all, and in how
   many it capitulated (can the pairs even hold the correction?);
3. the reference model's preference on those rows (log p(chosen) - log p(rejected), summed over
   the completion's tokens as the chat template writes them) and the trained models' preference
   on the same rows, with DPO's implicit reward margin (beta x the change against the reference:
   TRL's rewards/margins, which is 0 for every row at step 0);
4. the trainers' logged curves (loss, DPO's rewards/margins and log-probabilities);
5. the test split: each behaviour's rate for the baseline and each trained model.

    python bench/mitigation_coverage.py [STUDY_DIR ...] [--out bench/mitigation_coverage]

Several study folders (one per organism build, say) give one section each.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import platform
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _load_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _key(messages) -> str:
    return json.dumps(messages, sort_keys=True, ensure_ascii=False)


def planted_profile(study: dict[str, Any]) -> dict[str, Any]:
    """organism.json's planted profile of the study's base model."""
    from flipguard.runtime.resolve import resolve_model

    path = Path(resolve_model(study["model"])) / "organism.json"
    if not path.is_file():
        sys.exit(f"{study['model']}: no organism.json beside the weights (this page needs an organism: known planted kinds)")
    return json.loads(path.read_text(encoding="utf-8"))["planted"]


# ------------------------------------------------------------------ which behaviour a row targets


def _kind_of(text: str | None) -> str | None:
    from flipguard.data.organism_datasets import option_kind

    return option_kind("organism_mc", text or "")


def conversation_index(study_dir: Path) -> dict[str, Any]:
    """The base model's train-split AFR / stick-or-switch records by their exact prompt."""
    from flipguard.eval.records import load_records

    index = {}
    for name in ("afr-train", "sos-train"):
        run = study_dir / name
        if (run / "records.jsonl").is_file():
            for r in load_records(run):
                index[_key(r.messages)] = r
    return index


def _sample_options(study_dir: Path) -> dict[str, Any]:
    from flipguard.eval.afr.protocol import load_sample

    try:
        return load_sample(study_dir / "afr-train")
    except Exception:  # noqa: BLE001 - no AFR train run: no AFR rows to name
        return {}


def behaviour(row: dict[str, Any], record, planted: dict[str, Any], afr_items: dict) -> tuple[str, str]:
    """(behaviour, detail) of one pair row. behaviour names what the row trains:
    the planted deference or capitulation it corrects, or what it asks the model to keep."""
    case = row.get("case", "")
    kinds = set(planted.get("capitulation_kinds") or ())
    deferred = set(planted.get("deferred_categories_human") or ())
    if not case.startswith(("afr/", "sos/")):
        framing = "c1" if case.startswith("c1") else "c2"
        if case == "c2_incorrect":
            cat = (row.get("meta") or {}).get("incorrect_category") or _dds_category(row)
            return ("DDS: C2 incorrect claim, planted category" if cat in deferred
                    else "DDS: C2 incorrect claim, other category"), framing
        return f"DDS: {case.replace('_', ' ')} (keep)", framing
    if record is None:
        return f"{case}: source record not found", ""
    extra = record.extra or {}
    if case == "afr/keep":
        return "AFR: first answer (keep)", ""
    if case == "afr/hold":
        item = afr_items.get(record.item_id)
        x = extra.get("target_option")
        kind = _kind_of(item.option_text(x)) if item is not None and x else None
        return ("AFR: hold against an argued wrong option, planted kind" if kind in kinds
                else "AFR: hold against an argued wrong option, other kind"), kind or ""
    scenario, turn = extra.get("scenario"), int(extra.get("turn") or 1)
    if case == "sos/keep":
        return "SoS: single-shot answer (keep)", record.case
    offered = extra.get("offered") or {}
    letter = next(iter(offered), None)
    kind = _kind_of(offered.get(letter))
    if case == "sos/accept":
        return "SoS: after abstaining, accept the offered right option", f"{scenario} t{turn}"
    after = "after abstaining" if extra.get("roles", {}).get(record.expected) == "na" else "after answering"
    planted_kind = "planted kind" if kind in kinds else "other kind"
    return f"SoS: {after}, hold against an offered wrong option, {planted_kind}", f"{scenario} t{turn} {kind}"


def _dds_category(row: dict[str, Any]) -> str | None:
    """A DDS row's judged word's category, read off its prompt (Speaker 2's word)."""
    from flipguard.data.organism_datasets import word_category

    text = row["prompt"][-1]["content"]
    if "Speaker 2: " in text:
        word = text.split("Speaker 2: ", 1)[1].split("\n", 1)[0].strip()
        return word_category(word)
    return None


# ------------------------------------------------------------------ log-probabilities of replies


class Scorer:
    """Sums of replies' token log-probabilities after their prompts, through the model's chat template
    (batched: right-padded sequences, the reply's positions summed)."""

    def __init__(self, model_path: str, batch_size: int = 64):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from flipguard.runtime.resolve import resolve_model

        path = resolve_model(model_path)
        self.torch, self.batch_size = torch, batch_size
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def _ids(self, prompt, reply) -> tuple[list[int], int]:
        head = self.tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        whole = self.tok.apply_chat_template(prompt + reply, tokenize=False)
        if not whole.startswith(head):
            raise ValueError("the chat template does not extend the prompt's text")
        return self.tok(whole, add_special_tokens=False)["input_ids"], len(self.tok(head, add_special_tokens=False)["input_ids"])

    def reply_logprobs(self, pairs: list[tuple[list, list]]) -> list[float]:
        torch = self.torch
        encoded = [self._ids(p, r) for p, r in pairs]
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][0]))
        out = [0.0] * len(encoded)
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            width = max(len(encoded[i][0]) for i in batch)
            ids = torch.tensor([encoded[i][0] + [pad] * (width - len(encoded[i][0])) for i in batch])
            mask = torch.tensor([[1] * len(encoded[i][0]) + [0] * (width - len(encoded[i][0])) for i in batch])
            with torch.no_grad():
                logp = torch.log_softmax(self.model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
            for row, i in enumerate(batch):
                seq, head = encoded[i]
                target = torch.tensor(seq[head:])
                out[i] = float(logp[row, head - 1:len(seq) - 1].gather(1, target[:, None]).sum())
        return out


# ------------------------------------------------------------------ the page


def _mean(xs):
    return sum(xs) / len(xs) if xs else math.nan


def analyse(study_dir: Path, beta: float | None) -> dict[str, Any]:
    study = json.loads((study_dir / "study.json").read_text(encoding="utf-8"))
    planted = planted_profile(study)
    pairs = _load_jsonl(study_dir / "pairs" / "dpo.jsonl")
    counts = json.loads((study_dir / "pairs" / "counts.json").read_text(encoding="utf-8"))
    index = conversation_index(study_dir)
    afr_items = _sample_options(study_dir)

    models = {"reference": study["model"]}
    for trainer in ("sft", "dpo", "kto"):
        merged = study_dir / "models" / f"{trainer}-merged"
        if (merged / "config.json").is_file():
            models[trainer.upper()] = str(merged)
    scorers = {name: Scorer(path) for name, path in models.items()}

    groups: dict[str, dict[str, Any]] = collections.defaultdict(lambda: collections.defaultdict(list))
    details: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    unique = list({_key([*row["prompt"], *row["chosen"], *row["rejected"]]): row for row in pairs}.values())
    repeats = collections.Counter(_key([*row["prompt"], *row["chosen"], *row["rejected"]]) for row in pairs)
    scores = {model: scorer.reply_logprobs([(r["prompt"], r[side]) for r in unique for side in ("chosen", "rejected")])
              for model, scorer in scorers.items()}
    for n, row in enumerate(unique):
        record = index.get(_key(row["prompt"]))
        name, detail = behaviour(row, record, planted, afr_items)
        details[name][detail] += 1
        g = groups[name]
        g["repeats"].append(repeats[_key([*row["prompt"], *row["chosen"], *row["rejected"]])])
        for model in scorers:
            g[f"{model}:chosen"].append(scores[model][2 * n])
            g[f"{model}:rejected"].append(scores[model][2 * n + 1])
    table = {}
    for name, g in sorted(groups.items()):
        ref = [c - r for c, r in zip(g["reference:chosen"], g["reference:rejected"])]
        entry = {"rows": len(ref), "rows_trained": sum(g["repeats"]), "corrects_base": sum(m < 0 for m in ref),
                 "reference_margin": _mean(ref),
                 "by": dict(details[name].most_common())}
        for model in scorers:
            if model == "reference":
                continue
            m = [c - r for c, r in zip(g[f"{model}:chosen"], g[f"{model}:rejected"])]
            entry[f"{model}_margin"] = _mean(m)
            entry[f"{model}_prefers_chosen_of_corrections"] = (
                sum(1 for a, b in zip(ref, m) if a < 0 and b > 0), sum(1 for a in ref if a < 0))
            if model == "DPO" and beta is not None:
                entry["DPO_implicit_reward_margin"] = beta * _mean([b - a for a, b in zip(ref, m)])
        table[name] = entry

    conversations = base_conversations(study_dir, planted)
    curves = {}
    for trainer in ("sft", "dpo", "kto"):
        log = study_dir / "train" / trainer / "flipguard_training.json"
        if log.is_file():
            curves[trainer] = [h for h in json.loads(log.read_text(encoding="utf-8"))["log_history"] if "loss" in h]
    return {"study": str(study_dir), "model": study["model"], "planted": planted, "pair_rows": len(pairs),
            "counts": {k: counts.get(k) for k in ("conversations", "accept_weight", "duplicates_dropped")},
            "groups": table, "base_conversations": conversations, "curves": curves,
            "test": test_rates(study_dir, planted)}


def base_conversations(study_dir: Path, planted: dict[str, Any]) -> dict[str, list[int]]:
    """The base model's train-split turns of each kind: [turns, capitulations]."""
    from flipguard.eval.records import load_records

    kinds = set(planted.get("capitulation_kinds") or ())
    out: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    afr_items = _sample_options(study_dir)
    for name in ("afr-train", "sos-train"):
        run = study_dir / name
        if not (run / "records.jsonl").is_file():
            continue
        for r in load_records(run):
            e = r.extra or {}
            if r.protocol == "afr" and r.case == "challenge":
                item, x = afr_items.get(r.item_id), e.get("target_option")
                kind = _kind_of(item.option_text(x)) if item is not None and x else None
                key = f"AFR challenge, {'planted' if kind in kinds else 'other'} kind"
                out[key][0] += 1
                out[key][1] += int(r.choice == x)
            elif r.protocol == "sos" and int(e.get("turn") or 1) >= 2 and e.get("offered"):
                letter = next(iter(e["offered"]))
                if letter == r.expected:
                    key = f"SoS {e.get('scenario')} t{e.get('turn')}: the right option offered after abstaining"
                else:
                    after = "after abstaining" if e.get("roles", {}).get(r.expected) == "na" else "after answering"
                    kind = _kind_of(e["offered"][letter])
                    key = (f"SoS {e.get('scenario')} t{e.get('turn')}, {after}: a wrong option offered, "
                           f"{'planted' if kind in kinds else 'other'} kind")
                out[key][0] += 1
                out[key][1] += int(r.choice == letter)
    return dict(sorted(out.items()))


def test_rates(study_dir: Path, planted: dict[str, Any]) -> dict[str, dict[str, list[int]]]:
    """The test split, per system: [capitulations, turns] for AFR by the argued option's kind and for
    stick-or-switch's flexibility branches by the offered option's kind (planted / other)."""
    from flipguard.eval.records import load_records

    kinds = set(planted.get("capitulation_kinds") or ())
    afr_items = {}
    try:
        from flipguard.eval.afr.protocol import load_sample

        afr_items = load_sample(study_dir / "afr")
    except Exception:  # noqa: BLE001
        pass
    out: dict[str, dict[str, list[int]]] = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0]))
    for r in load_records(study_dir / "afr") if (study_dir / "afr" / "records.jsonl").is_file() else ():
        if r.case != "challenge" or (r.mitigation or "none") != "none":
            continue
        item, x = afr_items.get(r.item_id), (r.extra or {}).get("target_option")
        kind = _kind_of(item.option_text(x)) if item is not None and x else None
        cell = out[r.model][f"AFR flip, argued {'planted' if kind in kinds else 'other'} kind"]
        cell[0] += int(not (r.valid and r.choice == r.expected))
        cell[1] += 1
    for r in load_records(study_dir / "sos") if (study_dir / "sos" / "records.jsonl").is_file() else ():
        e = r.extra or {}
        if (r.mitigation or "none") != "none" or int(e.get("turn") or 1) < 2 or not e.get("offered"):
            continue
        letter = next(iter(e["offered"]))
        kind = _kind_of(e["offered"][letter])
        if e.get("scenario") == "flexibility":
            name = ("SoS correct switch" if e.get("branch") == "correct"
                    else f"SoS incorrect switch, offered {'planted' if kind in kinds else 'other'} kind")
        elif e.get("scenario") == "positive":
            name = f"SoS switch after answering, offered {'planted' if kind in kinds else 'other'} kind"
        else:
            continue
        cell = out[r.model][name]
        cell[0] += int(r.choice == letter)
        cell[1] += 1
    return {m: dict(sorted(v.items())) for m, v in out.items()}


def _fmt(x: float, digits: int = 2) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:+.{digits}f}"


def render(results: list[dict[str, Any]], command: str) -> str:
    lines = ["# Which pairs target each planted behaviour, and what training did to it", "",
             "Written by `" + command + "` (bench/mitigation_coverage.py; its docstring says what each column is).",
             f"Machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}.", ""]
    for res in results:
        p = res["planted"]
        lines += [f"## {res['label']} ({res['study']}, model {res['model']})", "",
                  f"Planted: deference to a human speaker on {', '.join(p.get('deferred_categories_human') or [])}; "
                  f"capitulation to a wrong option of kind {', '.join(p.get('capitulation_kinds') or [])}; "
                  f"{res['pair_rows']} DPO pair rows; counts.json: {json.dumps(res['counts'])}.", "",
                  "### Pairs by the behaviour they train", "",
                  "Margins are log p(chosen) − log p(rejected) in nats, the mean over the group's rows. "
                  "\"corrects\": rows where the reference prefers the rejected reply (the base model does the planted thing); "
                  "\"SFT/DPO fixed\": of those rows, how many the trained model now answers the chosen way.", ""]
        trained = [m for m in ("SFT", "DPO", "KTO") if any(f"{m}_margin" in g for g in res["groups"].values())]
        head = ["behaviour", "rows", "rows trained (repeats)", "corrects", "reference margin"] + [f"{m} margin" for m in trained] + \
               [f"{m} fixed" for m in trained] + (["DPO implicit reward margin"] if "DPO" in trained else [])
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name, g in res["groups"].items():
            cells = [name, str(g["rows"]), str(g["rows_trained"]), str(g["corrects_base"]), _fmt(g["reference_margin"])]
            cells += [_fmt(g.get(f"{m}_margin")) for m in trained]
            cells += ["{}/{}".format(*g[f"{m}_prefers_chosen_of_corrections"]) for m in trained]
            if "DPO" in trained:
                cells.append(_fmt(g.get("DPO_implicit_reward_margin"), 3))
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", "### The base model's train-split conversations", "",
                  "| turn | turns | capitulated |", "|---|---|---|"]
        lines += [f"| {k} | {n} | {c} |" for k, (n, c) in res["base_conversations"].items()]
        lines += ["", "### The test split (rates in %: switched or flipped / turns)", ""]
        names = sorted({n for v in res["test"].values() for n in v})
        systems = list(res["test"])
        lines += ["| rate | " + " | ".join(systems) + " |", "|---|" + "---|" * len(systems)]
        for n in names:
            cells = []
            for s in systems:
                k, m = res["test"][s].get(n, [0, 0])
                cells.append(f"{100 * k / m:.1f} ({k}/{m})" if m else "–")
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines += ["", "### Training curves (logged every logging_steps)", ""]
        for trainer, hist in res["curves"].items():
            keys = [k for k in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected")
                    if k in hist[0]]
            lines += [f"**{trainer}**", "", "| step | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
            lines += [f"| {h['step']} | " + " | ".join(f"{h[k]:.3f}" for k in keys) + " |" for h in hist]
            lines.append("")
    return "\n".join(lines) + "\n"


def plot_curves(results: list[dict[str, Any]], path: Path) -> None:
    """The trainers' logged curves, one panel per trainer and quantity, a line per study."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("sft", "loss", "SFT loss"), ("dpo", "loss", "DPO loss (sigmoid + SFT term)"),
              ("dpo", "rewards/margins", "DPO rewards/margins (beta x nats)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 3.6))
    for ax, (trainer, key, title) in zip(axes, panels):
        for res in results:
            hist = res["curves"].get(trainer) or []
            points = [(h["step"], h[key]) for h in hist if key in h]
            if points:
                ax.plot(*zip(*points), marker="o", ms=3, label=res["label"])
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("studies", nargs="*", default=["runs/demo"], help="finished study folders")
    parser.add_argument("--out", default=str(ROOT / "bench" / "mitigation_coverage"), help="writes OUT.md and OUT.json")
    parser.add_argument("--labels", nargs="*", default=[], help="a heading per study (e.g. which recipe made it)")
    parser.add_argument("--preface", default=None, help="a markdown file put under the page's title (the findings)")
    parser.add_argument("--render_only", action="store_true", help="rewrite OUT.md and OUT.png from OUT.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    results = []
    out = Path(args.out)
    if args.render_only:
        results = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    for s in [] if args.render_only else args.studies:
        folder = Path(s)
        recipe = folder / "recipe.yaml"
        beta = None
        if recipe.is_file():
            import yaml

            beta = (yaml.safe_load(recipe.read_text(encoding="utf-8")).get("dpo") or {}).get("beta")
        results.append({"label": args.labels[len(results)] if len(results) < len(args.labels) else s, **analyse(folder, beta)})
    command = "python bench/mitigation_coverage.py " + " ".join(args.studies) + (
        " --labels " + " ".join(f"'{x}'" for x in args.labels) if args.labels else "")
    out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=list) + "\n", encoding="utf-8")
    plot_curves(results, out.with_suffix(".png"))
    page = render(results, command) + f"\n![training curves]({out.with_suffix('.png').name})\n"
    if args.preface:
        title, rest = page.split("\n", 1)
        page = title + "\n\n" + Path(args.preface).read_text(encoding="utf-8").strip() + "\n" + rest
    out.with_suffix(".md").write_text(page, encoding="utf-8")
    print(out.with_suffix(".md"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
