"""The embedded models' cache names promise their builds: what they are trained on is pinned.

`flipguard:tiny` and the organism are cached under a version name (tiny-chat-v2,
organism-v4 when built with other settings) and rebuilt only when it is missing. Their tokenizer is trained on a corpus
(eval/embedded/tiny_model.py `_corpus`: the DDS prompt text, the shipped samples, the
organism's domain); if that corpus changed silently (a template added, a sample edited, the
samples folder not found after a move), a fresh machine would build a different model under
the same name than the one every committed bench number was measured on. The hash below is
the corpus of commit fb044b4 (printed by that commit's code); a deliberate change bumps
TINY_MODEL_VERSION and ORGANISM_VERSION and this pin.
"""

import hashlib

from flipguard.eval.embedded import organism as ob_shipped
from flipguard.eval.embedded import tiny_model
from flipguard.organism import profile as ob_profile

CORPUS_SHA256 = "e94ca15f9435ab70cf530e07651fe4aebbf4dadacbe2e89ece49c0334b7300a6"


def test_the_tokenizer_corpus_is_the_one_the_cached_models_were_built_on():
    corpus = tiny_model._corpus()
    digest = hashlib.sha256("\n".join(corpus).encode()).hexdigest()
    assert (len(corpus), digest) == (10134, CORPUS_SHA256), (
        "the embedded tokenizer's corpus changed: bump TINY_MODEL_VERSION / ORGANISM_VERSION "
        f"(now {tiny_model.TINY_MODEL_VERSION} / {ob_profile.ORGANISM_VERSION}) and this pin")


def test_the_aliases_the_code_names_are_the_declared_model_entry_points():
    """pyproject.toml declares the embedded models; study and demo name them by these constants."""
    from importlib.metadata import entry_points

    declared = {ep.name for ep in entry_points(group="flipguard.models") if ep.value.startswith("flipguard.")}
    assert declared == {*tiny_model.TINY_MODEL_ALIASES, ob_shipped.ORGANISM_ALIAS}
