"""Byte-level BPE in the Kimi release format (tiktoken.model + tokenizer_config.json).

* Pre-tokenisation: Kimi's pat_str (around-backbone §6.2), verbatim.
* Ranks 0..255: the 256 single bytes in GPT-2 `bytes_to_unicode` order (printable bytes first),
  so rank != byte value, as in real tiktoken files.
* Then plain BPE: merge the most frequent adjacent pair (counted over pre-tokenised words, with
  multiplicity); ties broken by the smaller merged byte string. Each merge is the next rank.
* 256 special ids follow the last rank at Kimi's offsets (§6.3); unnamed ones are
  `<|reserved_token_{id}|>` (absolute id).

Usage: python3 tokenizer_train.py --text work/train.txt --ranks 4096 --out OUTDIR
       python3 tokenizer_train.py --counts COUNTS.json --ranks N --out OUTDIR   (pre-token counts)
"""
import argparse
import base64
import collections
import heapq
import json
import os

import regex

KIMI_PAT = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# offset -> (name, special flag) as in the release tokenizer_config.json (around-backbone §6.3)
NAMED_SPECIALS = {
    0: ("[BOS]", True), 1: ("[EOS]", True), 2: ("<|end_of_msg|>", True), 3: ("<|open|>", True),
    4: ("<|close|>", False), 5: ("<|sep|>", False), 6: ("[start_header_id]", True),
    7: ("[end_header_id]", True), 9: ("[EOT]", True), 18: ("<|media_begin|>", True),
    19: ("<|media_content|>", True), 20: ("<|media_end|>", True), 21: ("<|media_pad|>", True),
    65: ("<osagent_mode>", True), 254: ("[UNK]", True), 255: ("[PAD]", True),
}


def byte_order():
    """GPT-2 bytes_to_unicode order: printable ranges first, then the rest ascending."""
    first = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    rest = [b for b in range(256) if b not in set(first)]
    return first + rest


def special_names(n_ranks):
    names = {}
    for off in range(256):
        i = n_ranks + off
        names[i] = NAMED_SPECIALS[off][0] if off in NAMED_SPECIALS else f"<|reserved_token_{i}|>"
    return names


def train(text, n_ranks):
    pat = regex.compile(KIMI_PAT, flags=regex.V1)
    return train_counts(collections.Counter(pat.findall(text)), n_ranks)


def train_counts(counts, n_ranks):
    """BPE over pre-token counts {pre-token string: count} (k3-chat passes the counts of its
    rendered text segments, which are encoded one by one)."""
    vocab = [bytes([b]) for b in byte_order()]
    words = []  # list of [list of token bytes]
    freqs = []
    for w, c in counts.items():
        words.append([bytes([b]) for b in w.encode("utf-8")])
        freqs.append(c)
    pair_count = collections.Counter()
    where = collections.defaultdict(set)
    for wi, w in enumerate(words):
        for a, b in zip(w, w[1:]):
            pair_count[(a, b)] += freqs[wi]
            where[(a, b)].add(wi)
    # max-heap keyed by (-count, merged bytes); lazily validated
    heap = [(-c, a + b, a, b) for (a, b), c in pair_count.items()]
    heapq.heapify(heap)
    while len(vocab) < n_ranks and heap:
        negc, merged, a, b = heapq.heappop(heap)
        if pair_count.get((a, b), 0) != -negc or -negc <= 0:
            continue
        vocab.append(merged)
        changed = collections.Counter()
        for wi in list(where[(a, b)]):
            w, f = words[wi], freqs[wi]
            i, nw = 0, []
            hit = False
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    nw.append(merged)
                    i += 2
                    hit = True
                else:
                    nw.append(w[i])
                    i += 1
            if not hit:
                continue
            for p in zip(w, w[1:]):
                pair_count[p] -= f
                changed[p] += 0
            for p in zip(nw, nw[1:]):
                pair_count[p] += f
                where[p].add(wi)
                changed[p] += 0
            words[wi] = nw
        del pair_count[(a, b)]
        for p in changed:
            c = pair_count.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, p[0] + p[1], p[0], p[1]))
    assert len(set(vocab)) == len(vocab)
    return vocab


def write(vocab, out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tiktoken.model"), "w") as f:
        for r, tok in enumerate(vocab):
            f.write(f"{base64.b64encode(tok).decode()} {r}\n")
    n = len(vocab)
    atd = {}
    for off, (name, special) in NAMED_SPECIALS.items():
        atd[str(n + off)] = {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                             "single_word": False, "special": special}
    cfg = {
        "added_tokens_decoder": atd,
        "additional_special_tokens": [],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "extra_special_tokens": {},
        "model_max_length": 1048576,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }
    json.dump(cfg, open(os.path.join(out, "tokenizer_config.json"), "w"), indent=2)


def load_encoding(model_dir):
    """A tiktoken Encoding configured as tokenization_kimi.py does (used to encode the corpus)."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    ranks = load_tiktoken_bpe(os.path.join(model_dir, "tiktoken.model"))
    specials = {v: k for k, v in special_names(len(ranks)).items()}
    return tiktoken.Encoding("k3nano", pat_str=KIMI_PAT, mergeable_ranks=ranks, special_tokens=specials)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", default="work/train.txt")
    ap.add_argument("--ranks", type=int, default=4096)
    ap.add_argument("--out", default="work/tok")
    ap.add_argument("--counts", help="JSON {pre-token: count} instead of --text")
    a = ap.parse_args()
    if a.counts:
        counts = json.load(open(a.counts, encoding="utf-8"))
        vocab = train_counts(collections.Counter(counts), a.ranks)
        text = "".join(sorted(counts, key=lambda w: -counts[w])[:5000])
    else:
        text = open(a.text, encoding="utf-8").read()
        vocab = train(text, a.ranks)
    write(vocab, a.out)
    enc = load_encoding(a.out)
    sample = text[:20000]
    ids = enc.encode(sample, disallowed_special=())
    assert enc.decode(ids) == sample
    print(f"{len(vocab)} ranks; sample {len(sample)} chars -> {len(ids)} tokens "
          f"({len(sample) / len(ids):.2f} chars/token); longest: {sorted(vocab, key=len)[-5:]}")


if __name__ == "__main__":
    main()
