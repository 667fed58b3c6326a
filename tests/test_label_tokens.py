"""Label tokens of real tokenizers: every token that is "1" (or "2") with only whitespace
around it counts for the label, and the label must be one token right after the
generation prompt. SmolLM2's own tokenizer is covered in tests/test_real_smollm2.py."""

from __future__ import annotations

import json

import pytest

from flipguard.eval.backends.base import BackendError, check_label_after_prompt, label_token_ids, token_label
from flipguard.eval.backends.openai_api import choice_probs_from_top_logprobs

INST_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
                 "{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}")


def sentencepiece_style_tokenizer(template: str = INST_TEMPLATE):
    """A Llama/Mistral-shaped tokenizer built here (no download): Metaspace pre-tokenizer that
    prefixes "▁" to words, both "1" and "▁1" in the vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["Is", "Paris", "in", "France", "Answer", "or", "?", ".", "[INST]", "[/INST]"]
    pieces = ["<unk>", "<s>", "</s>", "1", "2", "▁1", "▁2", "▁"]
    pieces += sorted({c for w in words for c in w}) + [f"▁{c}" for c in sorted({w[0] for w in words})]
    vocab = {p: i for i, p in enumerate(dict.fromkeys(pieces))}
    merges = [("▁", p[1:]) for p in vocab if p.startswith("▁") and len(p) == 2]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = template
    return fast, vocab


def test_sentencepiece_style_tokenizer_counts_bare_and_prefixed_digits():
    tok, vocab = sentencepiece_style_tokenizer()
    assert tok.convert_ids_to_tokens(tok.encode(" 1", add_special_tokens=False)) == ["▁1"]  # the "▁" form exists
    groups = label_token_ids(tok, ("1", "2"), "sp-model")
    assert groups == [[vocab["1"], vocab["▁1"]], [vocab["2"], vocab["▁2"]]]
    prompt = tok.apply_chat_template([{"role": "user", "content": "Is Paris in France?"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt.endswith("[/INST]")
    check_label_after_prompt(tok, {"1": groups[0], "2": groups[1]}, prompt, "sp-model")  # one token there


def test_a_label_that_is_not_one_token_after_the_generation_prompt_is_refused_naming_the_tokens():
    tok, vocab = sentencepiece_style_tokenizer()
    groups = label_token_ids(tok, ("1", "2"), "sp-model")
    # a template ending in a space: the prompt ends in a lone "▁" that "1" would merge into ("▁1")
    prompt = "[INST] Is Paris in France? [/INST] "
    assert tok.convert_ids_to_tokens(tok.encode(prompt, add_special_tokens=False))[-1] == "▁"
    with pytest.raises(BackendError, match=r"answer '1' is not one token after sp-model's generation prompt "
                                           r"\(the prompt's end \+ '1' tokenizes as \[']', '▁1'\]\)"):
        check_label_after_prompt(tok, {"1": groups[0], "2": groups[1]}, prompt, "sp-model")


def test_a_label_missing_from_the_vocabulary_is_refused():
    tok, _ = sentencepiece_style_tokenizer()
    with pytest.raises(BackendError, match=r"answer 'Z' is no single token of sp-model's vocabulary.*--mode generate"):
        label_token_ids(tok, ("1", "Z"), "sp-model")


def test_openai_top_logprobs_follow_the_same_rule():
    assert [token_label(t, ("1", "2")) for t in ("1", " 1", "\n1", "▁1", "1 ", "11", "", None)] == \
        ["1", "1", "1", "1", "1", None, None, None]
    top = [{"token": "▁1", "logprob": -1.0}, {"token": "1", "logprob": -2.0}, {"token": "\n2", "logprob": -3.0},
           {"token": "12", "logprob": -0.5}]
    probs = choice_probs_from_top_logprobs(top, ("1", "2"))
    assert probs["1"] == pytest.approx(0.36787944 + 0.13533528) and probs["2"] == pytest.approx(0.04978707)


def test_run_json_records_the_label_tokens_and_dtype_the_backend_computed_with(tiny_model_path, tmp_path):
    from test_eval_dds import _item
    from transformers import AutoTokenizer

    from flipguard.eval.dds import EvalArgs, evaluate

    run = evaluate(EvalArgs(model=tiny_model_path, out=str(tmp_path / "run"), min_label_mass=0.0, batch_size=2),
                   items=[_item(0)])
    computed = json.loads((run / "run.json").read_text())["computed"]
    (entry,) = computed.values()
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    one, two = tok.convert_tokens_to_ids("1"), tok.convert_tokens_to_ids("2")
    assert entry["backend"] == "hf" and entry["dtype"] == "float32" and entry["device"] == "cpu"
    import torch

    assert entry["cpu_kernels"] == torch.backends.cpu.get_cpu_capability()  # the kernels that rounded
    assert entry["label_tokens"]["1,2"] == {"1": [[one, "1"]], "2": [[two, "2"]]}
    from flipguard.eval.dds.report import write_run_report

    report = (write_run_report(run, n_boot=0) / "summary.md").read_text()
    assert f"Computed in: {tiny_model_path} (hf, float32)." in report
