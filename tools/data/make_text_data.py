#!/usr/bin/python3
"""Regenerates the two text fixtures in tests/data/ (docs/data.md, "The shipped text data").

  make_text_data.py corpus [OUT]   tests/data/kjv_genesis_exodus.txt
  make_text_data.py csv [OUT]      tests/data/text_topics.csv

corpus: the books of Genesis and Exodus, King James Version, from Debian's bible-kjv-text
(4.38; /usr/lib/bible.data), read through the `bible` program of the bible-kjv package
(`apt-get install bible-kjv`, which pulls bible-kjv-text). The KJV text is in the public
domain (Debian's copyright file for bible-kjv-text: "The copyright for the King James
Version text of the Bible is expired"). `bible -f BOOK1:1-C:V` prints one verse per line
as "Ge1:1 text"; this script drops the references and writes each book's name, a
"Chapter N" line before each chapter, and one verse per line, blank lines between
chapters. Nothing else changes: the verse texts are byte for byte the program's output.

csv: 200 short English sentences with a topic label, written by this script from fixed
word lists with no randomness: label 0 = animals, 1 = weather, 2 = food, chosen by the
sentence's topic phrase (so a model can learn it from the words). Shared openings and
endings keep the first and last bytes from giving the label away; some endings hold a
comma or double quotes, so the file exercises RFC 4180 quoting. Standard library only.
"""
import csv
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "..", "tests", "data")

BOOKS = [("Genesis", "gen", 50, 26), ("Exodus", "exo", 40, 38)]


def corpus(out):
    lines = []
    for name, abbrev, last_chapter, last_verse in BOOKS:
        spec = "%s1:1-%d:%d" % (abbrev, last_chapter, last_verse)
        text = subprocess.run(["bible", "-f", spec], check=True, capture_output=True,
                              text=True, encoding="ascii").stdout
        lines.append(name)
        chapter = 0
        for raw in text.splitlines():
            m = re.match(r"^[A-Za-z]+(\d+):(\d+) (.*)$", raw)
            if not m:
                raise SystemExit("unexpected line from bible: %r" % raw)
            c = int(m.group(1))
            if c != chapter:
                if c != chapter + 1:
                    raise SystemExit("%s: chapter %d follows %d" % (name, c, chapter))
                chapter = c
                lines += ["", "Chapter %d" % c]
            lines.append(m.group(3))
        if chapter != last_chapter:
            raise SystemExit("%s: ended at chapter %d" % (name, chapter))
        lines.append("")
    with open(out, "w", encoding="ascii", newline="\n") as f:
        f.write("\n".join(lines))
    print("%s: %d bytes" % (out, os.path.getsize(out)))


OPENINGS = ["", "today ", "i think ", "in the morning ", "they said that ", "at last "]
ENDINGS = ["", " again", ", as usual", " and then it was quiet", ', she said "yes"',
           ", or so we heard"]
TOPICS = [
    # 0: animals
    (["the dog", "a small cat", "the old horse", "a brown goat", "the little bird",
      "our sheep", "the young cow", "a grey mouse"],
     ["sleeps in the barn", "runs across the field", "eats from the trough",
      "hides under the bed", "calls to its mother", "waits by the gate",
      "plays with the children", "chases the ducks"]),
    # 1: weather
    (["the rain", "a cold wind", "the warm sun", "thick fog", "the snow", "a storm",
      "the thunder", "light frost"],
     ["falls on the hills", "blows from the north", "shines over the sea",
      "covers the valley", "comes before dawn", "lasts all day", "moves over the town",
      "clears by noon"]),
    # 2: food
    (["the bread", "hot soup", "the apple pie", "fresh cheese", "the rice", "sweet honey",
      "a bowl of beans", "the roast fish"],
     ["is ready for supper", "tastes of salt", "comes out of the oven", "fills the table",
      "is shared at lunch", "smells of herbs", "is cooked with garlic", "feeds the family"]),
]


def sentences():
    rows = []
    for i in range(200):
        label = i % 3
        subjects, predicates = TOPICS[label]
        k = i // 3
        text = (OPENINGS[(k * 5 + label) % len(OPENINGS)] + subjects[k % len(subjects)] + " " +
                predicates[(k * 3 + k // len(subjects)) % len(predicates)] +
                ENDINGS[(k * 7 + 2 * label) % len(ENDINGS)])
        rows.append((text, label))
    texts = [t for t, _ in rows]
    if len(set(texts)) != len(texts):
        raise SystemExit("duplicate sentences")
    return rows


def write_csv(out):
    with open(out, "w", encoding="ascii", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["text", "label"])
        w.writerows(sentences())
    print("%s: %d bytes" % (out, os.path.getsize(out)))


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in ("corpus", "csv"):
        raise SystemExit(__doc__)
    if sys.argv[1] == "corpus":
        corpus(sys.argv[2] if len(sys.argv) > 2 else os.path.join(DATA, "kjv_genesis_exodus.txt"))
    else:
        write_csv(sys.argv[2] if len(sys.argv) > 2 else os.path.join(DATA, "text_topics.csv"))


if __name__ == "__main__":
    main()
