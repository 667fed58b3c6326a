"""AFR challenges -> one-token binary judgments in the DialDefer C2 style (strategy "afr").

Every distinct Stage I argument that was used in a challenge (a model's, or a scripted
file's: run.json names it) becomes one judgment:
Speaker 1 asks the MMLU question, Speaker 2 answers "<wrong option text>. <argument>",
"Is Speaker 2 correct?" -> target "2" (no). Every question also gives the correct
option as Speaker 2's answer -> target "1" (yes). The prompt is
`flipguard.eval.dds.prompts.benchmark_prompt(question, answer, "c2", fmt="one_token")`, the
bytes the DDS logprob evaluation and the SFT/DPO trainers already use, so the trained
behaviour is re-measured with `flipguard afr`.

Caveat (documented, not hidden): the wrong answers carry an argument and the correct
ones do not, so length alone separates them; mix these pairs with DDS pairs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flipguard.data.organism_datasets import option_kind
from flipguard.errors import UserError
from flipguard.eval.afr import scripted as S
from flipguard.eval.afr.prompts import parse_coercion
from flipguard.eval.afr.protocol import load_sample
from flipguard.eval.dds.prompts import benchmark_prompt
from flipguard.eval.records import RUN_META_FILE, load_records, load_run_meta
from flipguard.files import file_sha256


def _judgment(question: str, answer: str, target: str, item_id: str, dataset: str, meta: dict[str, Any]) -> dict[str, Any]:
    prompt = benchmark_prompt(question, answer, "c2", fmt="one_token")
    return {"prompt": [{"role": "user", "content": prompt}], "target": target, "item_id": item_id, "dataset": dataset, "meta": meta}


def _scripted_arguments(afr_run_dir: str | Path, items: dict, records) -> dict[tuple, str]:
    """A scripted-argument run's Stage I (source "scripted"), read from the file its run.json
    names; refused when the file changed since the run (its sha256)."""
    run_json = Path(afr_run_dir) / RUN_META_FILE
    meta = load_run_meta(afr_run_dir).get("scripted_arguments")
    if not meta:
        return {}
    path = Path(meta["file"])
    if not path.is_file() or file_sha256(path) != meta["sha256"]:
        raise UserError(f"{run_json}: its scripted arguments {path} are missing or changed since the run (sha256 differs)")
    table = S.load_scripted(path, items)
    out = {}
    for r in records:
        if r.protocol == "afr" and r.case == "challenge" and r.extra.get("source_model") == S.SOURCE:
            arg = S.scripted_argument(table, r.item_id, r.extra["target_option"], r.extra["k"])
            if arg is not None:
                out[(S.SOURCE, r.item_id, r.extra["target_option"], r.extra["k"])] = arg
    return out


def _kinds(item, answer: str, argued: str | None) -> dict[str, str]:
    """The judgment's kinds for pairs.include/exclude/held_out (the organism's multiple-choice form)."""
    out = {"category": option_kind(item.dataset, answer)}
    if argued is not None:
        out["incorrect_category"] = option_kind(item.dataset, argued)
    return {k: v for k, v in out.items() if v}


def afr_judgments(afr_run_dir: str | Path, flipped_only: bool = False) -> list[dict[str, Any]]:
    """Dicts {prompt (messages), target "1"/"2", item_id, dataset "mmlu", meta}.

    flipped_only keeps only arguments that flipped at least one target.
    """
    items = load_sample(afr_run_dir)
    records = load_records(afr_run_dir)
    arguments = _scripted_arguments(afr_run_dir, items, records)
    for r in records:
        if r.protocol == "afr" and r.case == "coerce" and r.choice == "argued":
            arguments[(r.model, r.item_id, r.extra["target_option"], r.extra["k"])] = parse_coercion(r.raw_output)[1]
    used: dict[tuple, dict[str, Any]] = {}
    for r in records:
        if r.protocol != "afr" or r.case != "challenge":
            continue
        e = r.extra
        key = (e["source_model"], r.item_id, e["target_option"], e["k"])
        if key not in arguments:
            continue
        info = used.setdefault(key, {"flipped_by": set(), "challenged": set(), "conditions": set()})
        info["challenged"].add(r.model)
        info["conditions"].add(e["condition"])
        if not (r.valid and r.choice == r.expected):
            info["flipped_by"].add(r.model)
    out: list[dict[str, Any]] = []
    seen_items: set[str] = set()
    for (source, item_id, x, k), info in sorted(used.items(), key=lambda kv: tuple(map(str, kv[0]))):
        if flipped_only and not info["flipped_by"]:
            continue
        item = items[item_id]
        answer = f"{item.option_text(x)}. {arguments[(source, item_id, x, k)]}"
        meta = {"kind": "afr_argument", "source_model": source, "target_option": x, "k": k, "subject": item.subject,
                "flipped_by": sorted(info["flipped_by"]), "challenged": sorted(info["challenged"]),
                "conditions": sorted(info["conditions"]),
                **_kinds(item, item.answer_text, item.option_text(x))}
        out.append(_judgment(item.question, answer, "2", item_id, item.dataset, meta))
        if item_id not in seen_items:
            seen_items.add(item_id)
            out.append(_judgment(item.question, item.answer_text, "1", item_id, item.dataset,
                                 {"kind": "afr_correct", "target_option": item.answer, "subject": item.subject,
                                  **_kinds(item, item.answer_text, None)}))
    return out
