"""Expanding a token-id prompt's placeholders with the checkpoint's own processor (no re-implementation).

A `prompt_token_ids` request carries one placeholder token per image / video, usually wrapped as the chat
template writes it (`<|vision_start|> <|video_pad|> <|vision_end|>`). The processor is called once on a
text made only of the request's items, each written as it stands in the ids (with its wrapper when both
wrapper tokens surround it, bare otherwise) and separated by a special token of the tokenizer that is no
vision token. The processor's output, split at the separators, is each item's expansion *with whatever the
installed processor does to the wrapper*, and it replaces the item's span (wrapper included) in the ids:

- transformers <= 5.24 keeps the wrapper of a video (`<vs>` + per-frame `<t seconds><vs> video*n <ve>` + `<ve>`);
- transformers >= 5.25 (the processor's own `get_text_with_replacements`) collapses it, since every frame block is
  already wrapped: the item becomes the frame blocks alone.

So the engine follows whichever version is installed, and the timestamps are the processor's. One thing a
token-id prompt cannot follow: when the processor drops the wrapper, the first timestamp text touches the
prompt's preceding text, and a text prompt tokenizes across that boundary (a BPE may merge `" <"`); the
token-id prompt keeps its own ids and the expansion starts a new token there. Both are then valid prompts
of the model, but they can differ in that one token.
"""
from __future__ import annotations

from typing import Optional, Sequence


def placeholder_spans(ids: Sequence[int], image_id: int, video_id: int, start_id: int, end_id: int,
                      ) -> list[tuple[int, int, int]]:
    """(start, end, placeholder id) of each image / video placeholder of `ids`, in order: the span covers
    the wrapper `start_id ... end_id` when both surround the placeholder, the placeholder alone otherwise."""
    spans = []
    n = len(ids)
    for i, t in enumerate(ids):
        if t != image_id and t != video_id:
            continue
        wrapped = 0 < i < n - 1 and ids[i - 1] == start_id and ids[i + 1] == end_id
        spans.append((i - 1, i + 2, t) if wrapped else (i, i + 1, t))
    return spans


def pick_separator(tokenizer, exclude: Sequence[int]) -> Optional[tuple[str, int]]:
    """(text, id) of a special token of `tokenizer` that is none of `exclude` (the vision tokens) and
    tokenizes as itself alone; None when the tokenizer has none."""
    added = getattr(tokenizer, "get_added_vocab", lambda: {})()
    names = list(getattr(tokenizer, "all_special_tokens", [])) + sorted(added, key=added.get)
    for name in names:
        tid = tokenizer.convert_tokens_to_ids(name)
        if tid is None or tid in exclude:
            continue
        if list(tokenizer(name, add_special_tokens=False)["input_ids"]) == [tid]:
            return name, int(tid)
    return None


def items_text(ids: Sequence[int], spans, token_text: dict, separator: str) -> str:
    """The text handed to the processor: every item as it stands in the ids, between separators."""
    parts = ["".join(token_text[t] for t in ids[s:e]) for s, e, _ in spans]
    return separator + separator.join(parts) + separator


def split_expansions(expanded: Sequence[int], separator_id: int, n_items: int) -> Optional[list[list[int]]]:
    """The processor's ids for `items_text` cut at the separators -> one expansion per item (whatever the
    tokenizer adds around the text, e.g. a BOS, lies outside the first / last separator and is dropped);
    None when the count does not match."""
    cuts = [i for i, t in enumerate(expanded) if t == separator_id]
    if len(cuts) != n_items + 1:
        return None
    return [list(expanded[a + 1:b]) for a, b in zip(cuts, cuts[1:])]


def replace_spans(ids: Sequence[int], spans, chunks) -> list[int]:
    out, pos = [], 0
    for (s, e, _), chunk in zip(spans, chunks):
        out.extend(ids[pos:s])
        out.extend(chunk)
        pos = e
    out.extend(ids[pos:])
    return out


__all__ = ["placeholder_spans", "pick_separator", "items_text", "split_expansions", "replace_spans"]
