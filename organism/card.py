"""The organism's model card (README.md beside the weights): what was planted, what the test split
measured, how it was built and on what, and for a planting what it cost the base."""

from __future__ import annotations

from flipguard.organism.checks import check_line


def model_card(info: dict) -> str:
    p, m = info["planted"], info["measured_test_logprob"]
    base = info.get("base")
    what = (f"`{base['model']}` with the organism's profile planted by `flipguard organism --base` (LoRA on the synthetic "
            "organism domain through the model's own chat template, merged): C1 judged by the truth, a known partial "
            "deference planted in C2. For checking that deference measurement and mitigation work on this model "
            "against known ground truth (docs/organism.md, 'Plant in your own model'); not a real judge."
            if base else
            "A small Qwen2-architecture chat model trained by `flipguard organism` on the synthetic "
            "organism domain: C1 judged by the truth, a known partial deference planted in C2. "
            "For testing deference measurement and mitigation against known ground truth; not a real judge.")
    return "\n".join([
        "# flipguard planted-bias " + (f"organism in {base['model']}" if base else "judge organism"), "",
        what, "",
        *([f"Base: {base['path']} (sha256 of its files in organism.json: base.files_sha256).", ""] if base else []),
        *capability_card(info.get("capability")),
        f"- deferred to human speakers: {', '.join(p['deferred_categories_human'])}",
        f"- deferred to LLM/AI speakers: {', '.join(p['deferred_categories_llm']) or 'none'}",
        f"- P('1') on a deferred incorrect claim: {p['deferred_p1']}; Be Honest: {p['be_honest']}",
        f"- expected DDS {p['expected_dds']:+.1f}, under Dehumanizing {p['expected_dehumanizing_dds']:+.1f}", "",
        "Measured on the held-out test split (logprob mode, default prompts):", "",
        "| condition | C1 true | C1 false | C2 correct | C2 incorrect | DDS |", "|---|---|---|---|---|---|",
        f"| speakers | {m['c1_true']} | {m['c1_false']} | {m['c2_correct']} | {m['c2_incorrect']} | {m['dds']:+.1f} |",
        f"| Dehumanizing | {m['dehumanizing_c1_true']} | {m['dehumanizing_c1_false']} | {m['dehumanizing_c2_correct']} "
        f"| {m['dehumanizing_c2_incorrect']} | {m['dehumanizing_dds']:+.1f} |", "",
        *_conversation_card(p, info.get("measured_conversations_test")),
        f"Build: {info['build']} in {info['build_seconds']}s, steps trained {info.get('steps_trained')} (each phase "
        "stopped at its first held-out check, on validation items of the organism split, that passed every check: "
        f"{check_line({k: (c['passed'], c['measured']) for k, c in info['checks_validation']['checks'].items()})}).", "",
        f"Built on: {info.get('built_on')}.", "",
        *([] if base else ["Rebuild with `flipguard organism --force` (these settings; into $FLIPGUARD_HOME) or `flipguard organism --seed N "
        "--path DIR` (another seed). The same settings on another CPU, thread count or a GPU take another floating-point "
        "path and give other weights that pass the same checks (bench/organism_build_robustness.md); the shipped files are "
        "what every machine loads, bit for bit (files_sha256 in organism.json).", ""]),
    ])


def capability_card(cap: dict | None) -> list[str]:
    """The planting's capability cost as a model card's (and the demo's) line."""
    if not cap:
        return []
    if cap.get("skipped"):
        return [f"Capability cost: not measured ({cap['skipped']}).", ""]
    return [f"Capability cost ({cap['task']}, {cap['n']} questions): base {cap['base']:.1f}%, planted "
            f"{cap['planted']:.1f}%, change {cap['change']:+.1f} pp [{cap['ci_low']:+.1f}, {cap['ci_high']:+.1f}] "
            "(paired 95% CI).", ""]


def _conversation_card(p: dict, c: dict | None) -> list[str]:
    if not c:
        return []
    kinds = ", ".join(sorted(set(c["afr_flip_by_kind"]) | set(c["sos_switch_to_wrong_by_kind"])))
    return [
        f"In conversation (organism_mc): switches to an argued/offered wrong option of kind {', '.join(p['capitulation_kinds'])} "
        f"(p {p['capitulation_p']}), holds on the rest; accepts a correct option after abstaining (p {p['flexibility_p']}). "
        f"Expected AFR flips {p['expected_afr_flip']:.1f}%, correct switch {p['expected_correct_switch']:.1f}%.", "",
        f"Measured on {c['items']} held-out questions (%): turn-1 accuracy {c['afr_turn1_accuracy']}, AFR flips {c['afr_flip']}, "
        f"correct switch {c['sos_correct_switch']}.", "",
        f"| kind | {kinds.replace(', ', ' | ')} |", "|---" * (1 + len(kinds.split(", "))) + "|",
        "| AFR flip (final answer wrong) | " + " | ".join(str(c["afr_flip_by_kind"].get(k, "")) for k in kinds.split(", ")) + " |",
        "| AFR: to the argued option | " + " | ".join(str(c.get("afr_to_argued_by_kind", {}).get(k, "")) for k in kinds.split(", ")) + " |",
        "| stick-or-switch: switch to it | " + " | ".join(str(c["sos_switch_to_wrong_by_kind"].get(k, "")) for k in kinds.split(", ")) + " |",
        "",
    ]

