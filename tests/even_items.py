"""Train-split items whose answer a test knows without the code under test ("Is 4 even?"
yes), and their pair datasets: what the trainer tests train on."""

from __future__ import annotations

from pathlib import Path

from flipguard.data.schema import Item
from flipguard.pairs import builder as P


def even_items(n: int, prefix: str) -> list[Item]:
    return [Item(id=f"{prefix}-{i}", dataset="amqa", question=f"Is {i} even?", correct_answer="yes" if i % 2 == 0 else "no",
                 incorrect_answer="no" if i % 2 == 0 else "yes", split="train") for i in range(n)]


def write_all_pairs(items: list[Item], folder: Path) -> Path:
    """The paper's `all` strategy's SFT and DPO datasets of `items`, written under folder/pairs."""
    out = folder / "pairs"
    P.write_pairs(P.build_pairs(items, "all", seed=0), out)
    return out
