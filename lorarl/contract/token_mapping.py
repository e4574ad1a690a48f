"""Whether two models read the same token ids the same way: a full-model teacher scores the student's sampled token
ids as they are (on-policy distillation), so its tokenizer must map every id to the same token and mark the same
ends. A model with another vocabulary would score tokens it never meant — silently wrong logprobs, not an error —
so the job is refused before anything starts (AReaL fingerprints the tokenizer for the same reason)."""

from __future__ import annotations

from pathlib import Path

#: The special tokens whose ids must agree besides the vocabulary (the end of a completion above all).
SPECIAL = ("eos_token_id", "bos_token_id", "pad_token_id")


def token_mapping(model_dir: str | Path) -> tuple[dict[str, int], dict[str, int | None]]:
    """The model's tokenizer's token -> id mapping (added tokens included) and its special tokens' ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return dict(tokenizer.get_vocab()), {name: getattr(tokenizer, name, None) for name in SPECIAL}


def token_mapping_mismatch(model_dir: str | Path, other_dir: str | Path) -> str:
    """'' when the two models' tokenizers map ids alike; else what differs, in words a person can check."""
    vocab, special = token_mapping(model_dir)
    other_vocab, other_special = token_mapping(other_dir)
    if vocab != other_vocab:
        by_id = {i: t for t, i in vocab.items()}
        other_by_id = {i: t for t, i in other_vocab.items()}
        differing = sorted(i for i in set(by_id) | set(other_by_id) if by_id.get(i) != other_by_id.get(i))
        if not differing:  # the same ids, one of them named twice in a vocabulary
            return f"their vocabularies differ ({len(vocab):,} and {len(other_vocab):,} entries over the same ids)"
        first = differing[0]
        return (f"their vocabularies differ ({len(vocab):,} and {len(other_vocab):,} tokens; {len(differing):,} ids "
                f"map differently, the first {first}: {by_id.get(first)!r} and {other_by_id.get(first)!r})")
    for name in SPECIAL:
        if special[name] != other_special[name]:
            return f"their {name} differ ({special[name]} and {other_special[name]})"
    return ""
