"""The pair builder (`flipguard pairs`, the study's pairs stage): a recipe's pair sets from the
base model's train-split records. builder.py (strategies, length policy, writing the set),
conversations.py (multi-turn pairs from AFR / stick-or-switch runs), afr.py (answer-flip
judgments), filters.py (include / exclude / held-out rules). What it writes is
data/pair_sets.py's format; the trainers read that and import nothing here."""
