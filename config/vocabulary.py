"""The flag vocabulary: one word for one setting, meaning one thing in every command that takes it
(`flipguard eval`, `afr`, `sos`, and the study's eval: section), and the old words, which are refused
with the word to use, never read in its place.

docs/cli.md states VOCABULARY once, in one table (docs/gen_cli.py renders it); a protocol's argument
class says what it lacks of it (`LACKS`), so that a shared word it does not take is refused in one
line naming the protocol, not read as a typo.
"""

from __future__ import annotations

# word -> what it means, in every command that takes it
VOCABULARY: dict[str, str] = {
    "model": "One or several models, each [label=][backend:]model[|adapter] (a hub id, a folder, a .gguf file, "
             "flipguard:organism or flipguard:tiny); repeatable. Default flipguard:tiny. A DDS run judges one.",
    "backend": "hf | vllm | openai: the models' engine, unless a model's spec names one. Default hf.",
    "backend_args": "JSON of the backend's own settings (vLLM engine arguments, the openai base_url ...).",
    "device": "hf backend device (default cuda when there is one).",
    "batch_size": "hf backend batch size. Default 8.",
    "datasets": "A comma list of datasets (or a group: all, bench). Default: the protocol's own (eval all, afr mmlu, "
                "sos medqa); afr and sos measure one per run.",
    "limit": "At most N items per dataset, drawn with --seed (the same seed, the same items), kept in the dataset's "
             "order: a seeded sample (eval, sos); afr takes its seeded --per_subject sample round robin over subjects, "
             "so that they stay even. Default: every item.",
    "seed": "The item sample of --limit, the protocol's orders and positions, decoding seeds, the bootstrap. "
            "Default 0.",
    "mitigations": "System-prompt mitigations: none, be_honest, dehumanizing (a DDS run judges one).",
    "out": "The run folder. Default runs/<protocol>/<model>/<dataset>-<a fingerprint of the settings>: "
           "other settings, another folder.",
    "report": "Write the report when the run finishes (true | false). Default true.",
    "threads": "CPU threads of this process.",
    "subjects": "A comma list of MMLU subjects the items are restricted to (afr, sos). Default: every subject.",
}

# options whose values are lists of words: a comma list in every command (`--mitigations be_honest,dehumanizing`,
# `--subjects anatomy,astronomy`), on the command line and as a run config's string; values given one by one
# (`--k_values 1 5`) are read too. Not the lists of paths, runs or model specs, whose values may hold a comma.
COMMA_LISTS = frozenset({
    "mitigations", "subjects", "scenarios", "targets", "sources", "k_values", "eval_plan_mitigations",
    "eval_plan_trainers", "eval_plan_extra_modes", "eval_plan_protocols", "eval_plan_train_protocols",
    "pairs_framings", "tracking_tags"})


def comma_items(value: str) -> list[str]:
    """The words of a comma list ('a, b,c' -> ['a', 'b', 'c'])."""
    return [v.strip() for v in str(value).split(",") if v.strip()]

# an old or another tool's word -> the word of the vocabulary: refused in every command, naming the word
LEGACY: dict[str, str] = {
    "n_items": "limit", "num_items": "limit", "max_items": "limit", "models": "model", "dataset": "datasets",
    "tasks": "datasets", "mitigation": "mitigations", "output": "out", "output_dir": "out", "output_path": "out",
    "num_threads": "threads", "model_name_or_path": "model",
}


def legacy_word(name: str) -> str | None:
    """The word of the vocabulary an old word (a flag without its dashes, or a run config's key) stands
    for, or None."""
    return LEGACY.get(name.lstrip("-").replace("-", "_"))
