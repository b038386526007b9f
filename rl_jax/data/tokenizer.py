"""Character-level tokenizers for synthetic tasks, built with the ``tokenizers`` library.

Ids are ``<pad>=0, <bos>=1, <eos>=2`` (the first three specials, whatever their spelling), then
any further specials, then one id per alphabet character in alphabet order. The result is an
ordinary ``tokenizers.Tokenizer``: it saves to ``tokenizer.json`` and reloads with
``Tokenizer.from_file``, so checkpoints carry it like any Hugging Face tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

SPECIAL_ROLES = ("pad", "bos", "eos")


def build_char_tokenizer(alphabet: str,
                         specials: Sequence[str] = ("<pad>", "<bos>", "<eos>"),
                         words: Sequence[str] = ()) -> Tokenizer:
    """A tokenizer with one token per character of ``alphabet``.

    Args:
      alphabet: the characters, each once; token ids follow this order.
      specials: special-token strings; the first three play the pad, bos and eos roles.
      words: multi-character strings that are one token each (ids after the alphabet), decoded
        as text like any character (not special: ``skip_special_tokens`` keeps them), as the
        ``<tool_call>`` tokens of Qwen's tokenizers are.

    Returns:
      A ``tokenizers.Tokenizer`` (WordLevel model, a pre-tokenizer isolating every character, a
      ``Fuse`` decoder) with vocabulary size ``len(specials) + len(alphabet)``. It has no unknown
      token: encoding an out-of-alphabet character with it raises; use ``encode`` for a clear error.
    """
    if not alphabet:
        raise ValueError("alphabet is empty")
    repeated = sorted({c for c in alphabet if alphabet.count(c) > 1})
    if repeated:
        raise ValueError(f"alphabet repeats characters {repeated!r}")
    specials = tuple(specials)
    if len(specials) < len(SPECIAL_ROLES):
        raise ValueError(f"need at least {len(SPECIAL_ROLES)} specials ({', '.join(SPECIAL_ROLES)}), "
                         f"got {specials!r}")
    if len(set(specials)) != len(specials):
        raise ValueError(f"specials repeat: {specials!r}")
    clashes = [s for s in specials if len(s) == 1 and s in alphabet]
    if clashes:
        raise ValueError(f"specials {clashes!r} are also alphabet characters")

    vocab = {token: i for i, token in enumerate(specials)}
    for c in alphabet:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))  # "<unk>" is not in vocab on purpose
    # `[\s\S]` rather than `.`: the regex engine's `.` does not match a newline.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(specials))
    words = tuple(words)
    bad = [w for w in words if len(w) < 2 or w in specials or words.count(w) > 1]
    if bad:
        raise ValueError(f"words must be distinct multi-character strings, not specials: {bad!r}")
    if words:
        tok.add_tokens([AddedToken(w, special=False, normalized=False) for w in words])
    return tok


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
    """``{"pad": 0, "bos": 1, "eos": 2}``: ids of the special tokens with pad, bos and eos roles.

    Reads the tokenizer's added special tokens, so it also works on a reloaded ``tokenizer.json``.
    """
    added = {i: t for i, t in tok.get_added_tokens_decoder().items() if t.special}
    ids = {}
    for i, role in enumerate(SPECIAL_ROLES):
        if i not in added:
            raise ValueError(f"tokenizer has no special token with id {i} (the {role} role); "
                             f"special tokens: {{{', '.join(f'{k}: {v.content!r}' for k, v in sorted(added.items()))}}}")
        ids[role] = i
    return ids


def alphabet_of(tok: Tokenizer) -> str:
    """The non-special characters of a character tokenizer, in id order."""
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    vocab = tok.get_vocab(with_added_tokens=False)
    return "".join(t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in special)


def encode(tok: Tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` (one per character; no special tokens are added or recognised).

    Raises:
      ValueError: if ``text`` has characters outside the tokenizer's alphabet, or spells a special
        token (which the tokenizer would otherwise turn into that token).
    """
    vocab = tok.get_vocab(with_added_tokens=False)
    rest = text
    for token in tok.get_added_tokens_decoder().values():
        if not token.special:  # a word: one token, whatever its characters
            rest = rest.replace(token.content, "")
    unknown = sorted(set(rest) - vocab.keys())
    if unknown:
        raise ValueError(f"characters {unknown!r} in {text!r} are not in the tokenizer's alphabet "
                         f"{alphabet_of(tok)!r}")
    encoding = tok.encode(text, add_special_tokens=False)
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    if any(text[a:b] in specials for a, b in encoding.offsets):
        raise ValueError(f"{text!r} contains a special-token string; pass special tokens as ids")
    return encoding.ids


def decode(tok: Tokenizer, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    """The text of ``ids``; special tokens are dropped unless ``skip_special_tokens`` is False."""
    return tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
