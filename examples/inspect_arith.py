"""Two inspect_ai runs of one small task, offline: what docs/interop.md imports and compares.

The task `arith` asks "What is i+i?" (target 2i) and scores each reply with inspect_ai's match() and
includes(). The model is inspect_ai's `mockllm/model`, told what to reply: 2i, or "no idea" for the
questions it is to miss. No network, no model weights: the logs are inspect_ai's own, written by its
`eval()`, exactly as a real model's would be.

    python examples/inspect_arith.py logs    # logs/before/*.eval and logs/after/*.json

tests/test_interop.py makes its logs with `inspect_run`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Callable

N = 40
# the worked example: before misses every third question, after only 10, 20, 30 and 40
BEFORE_WRONG = frozenset(range(3, N + 1, 3))
AFTER_WRONG = frozenset({10, 20, 30, 40})


def inspect_run(log_dir: str | Path, wrong: set[int] | frozenset[int], *, n: int = N, log_format: str = "eval",
                version: int = 1, prompts: dict[int, str] | None = None, targets: dict[int, str] | None = None,
                before_reply: Callable[[int], None] | None = None, **eval_options: Any) -> Path:
    """Run task `arith` (n questions; `prompts` and `targets` replace some) on mockllm/model, which misses
    the questions in `wrong`; returns the log inspect_ai wrote into `log_dir`. `before_reply(i)` runs
    before each reply (an exception there is the model's error, as a provider's would be); a run that
    did not succeed raises unless `eval_options` (inspect_ai's eval() options) allow errors."""
    from inspect_ai import Task
    from inspect_ai import eval as inspect_eval
    from inspect_ai.dataset import Sample
    from inspect_ai.model import ModelOutput, ModelUsage, get_model
    from inspect_ai.scorer import includes, match
    from inspect_ai.solver import generate

    prompts, targets = prompts or {}, targets or {}
    samples = [Sample(id=i, input=prompts.get(i, f"What is {i}+{i}?"), target=targets.get(i, str(2 * i)),
                      metadata={"parity": "even" if i % 2 == 0 else "odd"}) for i in range(1, n + 1)]

    def reply(messages, tools, tool_choice, config):
        i = int(re.search(r"(\d+)\s*\+", messages[-1].text).group(1))
        if before_reply is not None:
            before_reply(i)
        output = ModelOutput.from_content("mockllm/model", "no idea" if i in wrong else str(2 * i))
        # usage given: without it mockllm counts tokens with tiktoken, whose tables are a download
        output.usage = ModelUsage(input_tokens=1, output_tokens=1, total_tokens=2)
        return output

    task = Task(dataset=samples, solver=generate(), scorer=[match(), includes()], name="arith", version=version)
    logs = inspect_eval(task, model=get_model("mockllm/model", custom_outputs=reply), log_dir=str(log_dir),
                        log_format=log_format, display="none", **eval_options)
    if logs[0].status != "success" and before_reply is None:
        raise RuntimeError(f"inspect_ai run failed: {logs[0].error}")
    return Path(logs[0].location)


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else "logs")
    for name, wrong, log_format in (("before", BEFORE_WRONG, "eval"), ("after", AFTER_WRONG, "json")):
        print(inspect_run(out / name, wrong, log_format=log_format))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
