"""What `flipguard study` and a task's `study_run` hand each other (eval/task.py `Task.study_run`),
so a task needs nothing of the study's own code, which sits above eval/ (pipeline/study.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class StudyCondition:
    """One condition of a study as a protocol measures it: a model, with or without a prompting mitigation."""

    name: str                 # its name in the comparison ("Baseline", "Be Honest", "SFT")
    model: str                # the base model's name, or a merged model's folder
    mitigation: str = "none"  # a prompting mitigation (eval.mitigations), applied to the base model


@dataclasses.dataclass
class StudyContext:
    """What `flipguard study` hands a task's `study_run`: the recipe's eval: settings that every
    protocol shares, so a task needs nothing of the study's own code."""

    name: str                 # the stage's name: the task's, "-train" added on the train split
    out: Path                 # the stage's folder (its run directory, or a folder of them)
    config: str | None        # the recipe's eval.<task>_config, resolved; None: the task's own default
    conditions: list[StudyCondition]  # in comparison order, the baseline first; the train split: the base model alone
    split: str                # "test", or "train" (eval.train_protocols: conversations for the pairs)
    backend: str              # eval.backend
    limit: int | None         # eval.limit: items per dataset / run
    device: str | None        # "cpu" where the study runs without a GPU, else None (the backend's choice)
    recipe_path: str
    backend_args: str = "{}"  # eval.backend_args as the JSON --backend_args takes (vLLM parallelism, ...)

    @property
    def train(self) -> bool:
        return self.split == "train"


@dataclasses.dataclass
class StudyRun:
    """A task's stage, as its `study_run` describes it; the study adds the base model's identity
    to `params`, orders it after the fine-tuned models and skips it while its fingerprint holds."""

    title: str
    params: dict[str, Any]    # exactly what it reads, JSON-able: a change redoes the stage
    run: Callable[[], None]
    outputs: tuple[Path, ...]  # all present = the stage finished
    # (condition, "RUN_DIR[@system]") pairs whose Task.comparison_rows go to the comparison
    comparison: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    report: Path | None = None  # listed among the study's artefacts
