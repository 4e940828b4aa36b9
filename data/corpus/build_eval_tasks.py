"""Regenerate the evaluator's shipped lm-eval tasks (src/lmtrain/evaluator/tasks; run once by a
maintainer, the output is committed), from the shipped corpus and the same Python.

- ``pydoc_choice.jsonl``: multiple choice, one item per module of ``python-docs.jsonl``: given
  ``Module NAME``, which of four one-line summaries is that module's (the other three are other
  modules' summaries). The tiny runs train on these documents, so it measures what a run learned
  of its corpus; the choices are shuffled with a fixed seed.
- ``pydoc_heldout.jsonl``: held-out text for perplexity: the documentation of standard-library
  modules that are NOT in the corpus (:data:`HELD_OUT`), rendered exactly as build_corpus.py
  renders the corpus's, each cut to its first :data:`HELD_OUT_CHARS` characters.

    python data/corpus/build_eval_tasks.py
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE.parents[1] / "src" / "lmtrain" / "evaluator" / "tasks"
sys.path.insert(0, str(HERE))
from build_corpus import MODULES, _module_document  # noqa: E402

HELD_OUT = [
    "array", "binascii", "code", "codeop", "colorsys", "compileall", "contextvars", "copyreg", "dbm",
    "errno", "faulthandler", "fileinput", "getopt", "getpass", "keyword", "linecache", "mimetypes",
    "modulefinder", "pkgutil", "py_compile", "pyclbr", "rlcompleter", "runpy", "stat", "stringprep",
    "tabnanny", "tomllib", "tty", "webbrowser", "zipapp",
]
HELD_OUT_CHARS = 1000
CHOICES = 4
SEED = 20261129


SUMMARY_CHARS = 48  # a choice fits a model of 64 positions (byte tokens: one per character; lm-eval asserts it fits)


def _summary(text: str) -> str:
    """A module document's first paragraph after its title, on one line, cut at a word to at most
    :data:`SUMMARY_CHARS` characters."""
    parts = text.split("\n\n")
    words = " ".join(parts[1].split()) if len(parts) > 1 else ""
    return words if len(words) <= SUMMARY_CHARS else words[:SUMMARY_CHARS].rsplit(" ", 1)[0]


def choice_items() -> list[dict[str, object]]:
    docs = [json.loads(line) for line in (HERE / "python-docs.jsonl").read_text().splitlines()]
    modules = [(d["text"].split("\n", 1)[0].removeprefix("Module "), _summary(d["text"]))
               for d in docs if d["text"].startswith("Module ")]
    modules = [(name, s) for name, s in modules if s]
    summaries = sorted({s for _, s in modules})
    rng = random.Random(SEED)
    items = []
    for name, summary in modules:
        others = rng.sample([s for s in summaries if s != summary], CHOICES - 1)
        choices = [summary, *others]
        rng.shuffle(choices)
        items.append({"module": name, "choices": choices, "label": choices.index(summary)})
    return items


def held_out_docs() -> list[dict[str, str]]:
    assert not set(HELD_OUT) & set(MODULES), "a held-out module is in the corpus"
    out = []
    for name in HELD_OUT:
        text = _module_document(name, set())
        if text:
            out.append({"source": f"python{sys.version_info[0]}.{sys.version_info[1]}/{name}",
                        "text": text[:HELD_OUT_CHARS]})
    return out


def write(name: str, rows: list[dict[str, object]]) -> int:
    with open(OUT / name, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return len(rows)


if __name__ == "__main__":
    print("pydoc_choice.jsonl:", write("pydoc_choice.jsonl", choice_items()), "items")
    print("pydoc_heldout.jsonl:", write("pydoc_heldout.jsonl", held_out_docs()), "documents")
