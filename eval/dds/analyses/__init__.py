"""The DialDefer paper's analyses beyond the DDS table, each one `flipguard` command.

- taxonomy.py      `flipguard taxonomy`: LLM-judge coding of each flip's C2 reasoning
                   against its C1 reasoning (Appendices F and J, Tables 17-19, 30)
- labels.py        `flipguard label-ablation`: the speaker-label study (§5.2, Fig. 7)
- perspective.py   `flipguard perspective-reversal`: r/AIO 2→1 vs 1→2 (Table 14)
- cross_model.py   `flipguard cross-model`: flip agreement across models (Tables 24/27)
                   and per-item DDS mean/std (Tables 25/29)

Every command reads or writes ordinary run directories (records.jsonl + run.json), so
they resume like `flipguard eval`, and writes report.md + CSV (+ a PNG) to --out.
"""
