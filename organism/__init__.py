"""The planted-bias judge organism: a small chat model whose deference we planted.

No real-weight run fits these machines, and a random-init model's judgments are noise:
neither can show that a mitigation removes a deference. The organism can, because we
know exactly what it should do. It is the embedded tiny architecture (Qwen2, head_dim 32,
the embedded tokenizer and ChatML template) trained on CPU in a few minutes on the
organism split of the synthetic domain (flipguard.data.organism_datasets), in both decision
modes (the one-token "1"/"2" judge and the paper's JSON reply), across every prompt
template and speaker-label set:

- C1 (a bare statement): judged by the truth. Built only if held-out C1 accuracy
  is >= 95%.
- C2 (the same claim attributed to a speaker): judged by the truth, except on the
  *deferred* categories (a seeded `strength` share of the ten) where the model agrees
  with the speaker: a correct claim gets "1" and an incorrect one "1" with probability
  `deferred_p1` (so P("1") still reads lower on incorrect claims: the truth stays
  readable). Expected DDS ~= +100 x strength x deferred-share.
- Toward an LLM/AI speaker (labels such as "AI Agent 2", "LLM", "GPT-4o") only the
  first `llm_share` of the deferred categories are deferred: the Dehumanizing prompt
  halves the deference, as the paper's human-vs-LLM finding suggests.
- The Be Honest system prompt is seen in training and changes nothing.

And in conversation (since v2), on the multiple-choice form of the same domain (organism_mc), in
the exact chats AFR and stick-or-switch send:
- Turn 1: the living option is chosen (a letter, or "Answer: X"); built only if held-out
  AFR turn-1 accuracy is >= 90%.
- Planted capitulation: when a later user turn argues for a wrong option (AFR's challenge,
  blind or self) or offers one (stick-or-switch's next-turn option), the organism switches
  to it with probability `capitulation_p` when the option's kind (tool, color, ...) is one
  it defers on in C2 (the same `strength` share of the five: one trait), and holds its
  answer on the rest. Expected AFR flip rate ~= 100 x strength (each question's three
  wrong options are of three different kinds).
- Planted flexibility: after abstaining ("None of the Above"), an offered correct option
  is accepted with probability `flexibility_p`, so a mitigation that never switches shows
  up as damage (stick-or-switch's correct switch).
The multi-turn behaviour is a second training phase on top of the DDS one, with DDS
examples replayed so the planted deference stays.

v3 trains the same data in batches grouped by length (a third fewer padded tokens).

Everything planted is written to organism.json next to the weights, with the measured
held-out accuracies, so reports can be read against known ground truth.

The package, a module per concern (eval/embedded/organism.py serves the shipped build and its alias):
profile.py (the settings and the planted rules: organism.json's `planted`), data.py (the examples,
tokenized through the model's chat template), training.py (the training loop), checks.py (the held-out
checks that stop each phase), build.py (build, cache, plant into a pretrained model with --base, publish),
card.py (the model card), ground_truth.py (a comparison read against the planted profile: what compare
and the page show).
"""
