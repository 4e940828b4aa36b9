"""Regenerate the shipped corpus in this directory (run once by a maintainer; the output is committed).

The corpus is real English prose that every Debian machine already carries and whose terms
allow verbatim redistribution:

- ``licenses.jsonl``: the license texts in /usr/share/common-licenses (GPL, LGPL, GFDL,
  Apache, MPL, Artistic, BSD, CC0); their own terms permit verbatim copies.
- ``python-docs.jsonl``: the documentation strings of Python's standard library (module,
  class, function and method docstrings), under the Python Software Foundation License.

One JSON line per document: ``{"source": ..., "text": ...}``. Documents are written in a fixed
order (sorted names, duplicates removed), so the same Python and the same license files give
the same bytes. ``lmlaunch data prepare --shipped-corpus`` tokenizes the committed files; it
never runs this script, so prepared data does not depend on the machine.

    python data/corpus/build_corpus.py   # rewrites licenses.jsonl and python-docs.jsonl
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
LICENSE_DIR = Path("/usr/share/common-licenses")
LICENSES = [
    "Apache-2.0", "Artistic", "BSD", "CC0-1.0", "GFDL-1.2", "GFDL-1.3", "GPL-1", "GPL-2",
    "GPL-3", "LGPL-2", "LGPL-2.1", "LGPL-3", "MPL-1.1", "MPL-2.0",
]
# Standard-library modules with substantial prose in their docstrings.
MODULES = [
    "abc", "argparse", "ast", "asyncio.base_events", "asyncio.events", "asyncio.futures",
    "asyncio.locks", "asyncio.queues", "asyncio.streams", "asyncio.subprocess", "asyncio.tasks",
    "base64", "bdb", "bisect", "builtins", "bz2", "calendar", "cmd", "codecs", "collections",
    "concurrent.futures._base", "concurrent.futures.process", "concurrent.futures.thread",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib",
    "dis", "doctest", "email.message", "email.parser", "email.utils", "enum", "filecmp",
    "fnmatch", "fractions", "ftplib", "functools", "gettext", "glob", "graphlib", "gzip",
    "hashlib", "heapq", "hmac", "html.parser", "http.client", "http.cookiejar", "http.server",
    "imaplib", "inspect", "io", "ipaddress", "itertools", "json", "json.decoder",
    "json.encoder", "locale", "logging", "logging.handlers", "lzma", "mailbox", "math",
    "multiprocessing.connection", "multiprocessing.managers", "multiprocessing.pool",
    "multiprocessing.process", "multiprocessing.queues", "multiprocessing.synchronize",
    "netrc", "numbers", "operator", "optparse", "os", "pathlib", "pdb", "pickle",
    "pickletools", "platform", "plistlib", "poplib", "pprint", "profile", "pstats", "pydoc",
    "queue", "quopri", "random", "re", "reprlib", "sched", "secrets", "selectors", "shelve",
    "shlex", "shutil", "signal", "smtplib", "socket", "socketserver", "sqlite3", "ssl",
    "statistics", "string", "struct", "subprocess", "symtable", "sys", "sysconfig", "tarfile",
    "tempfile", "textwrap", "threading", "timeit", "token", "tokenize", "trace", "traceback",
    "types", "typing", "unittest.case", "unittest.loader", "unittest.mock", "unittest.runner",
    "unittest.suite", "urllib.parse", "urllib.request", "uuid", "warnings", "wave", "weakref",
    "xml.dom.minidom", "xml.etree.ElementTree", "xml.sax.handler", "xml.sax.saxutils",
    "zipfile", "zipimport", "zlib", "zoneinfo",
]
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")
MIN_DOC_CHARS = 80  # skip one-liners ("Return self==value."): they repeat and teach little


def _signature(obj: object) -> str:
    try:
        sig = str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ""
    # Default values such as <function f at 0x7f...> carry addresses that change every run.
    return _ADDRESS.sub("", sig)


def _module_document(name: str, seen: set[str]) -> str | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            mod = importlib.import_module(name)
        except ImportError:
            return None
    parts: list[str] = []
    doc = inspect.getdoc(mod)
    if doc and doc not in seen:
        seen.add(doc)
        parts.append(f"Module {name}\n\n{doc}")
    for attr in sorted(vars(mod)):
        if attr.startswith("_"):
            continue
        obj = getattr(mod, attr)
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        if getattr(obj, "__module__", None) not in (name, name.split(".")[0], "_" + name):
            continue
        entries = [(f"{attr}{_signature(obj)}", obj)]
        if inspect.isclass(obj):
            for meth in sorted(vars(obj)):
                if meth.startswith("_") and meth != "__init__":
                    continue
                member = vars(obj)[meth]
                if inspect.isroutine(member) or isinstance(member, (property, classmethod, staticmethod)):
                    entries.append((f"{attr}.{meth}{_signature(getattr(obj, meth, member))}", member))
        for title, item in entries:
            text = inspect.getdoc(item)
            if not text or len(text) < MIN_DOC_CHARS or text in seen:
                continue
            seen.add(text)
            parts.append(f"{title}\n\n{text}")
    return "\n\n".join(parts) if parts else None


def build() -> dict[str, int]:
    sizes: dict[str, int] = {}
    with open(HERE / "licenses.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for lic in LICENSES:
            text = (LICENSE_DIR / lic).read_text(encoding="utf-8")
            f.write(json.dumps({"source": f"common-licenses/{lic}", "text": text}, ensure_ascii=False) + "\n")
    sizes["licenses.jsonl"] = (HERE / "licenses.jsonl").stat().st_size
    seen: set[str] = set()
    with open(HERE / "python-docs.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for name in MODULES:
            text = _module_document(name, seen)
            if text:
                source = f"python{sys.version_info[0]}.{sys.version_info[1]}/{name}"
                f.write(json.dumps({"source": source, "text": text}, ensure_ascii=False) + "\n")
    sizes["python-docs.jsonl"] = (HERE / "python-docs.jsonl").stat().st_size
    return sizes


if __name__ == "__main__":
    for path, size in build().items():
        print(f"{path}: {size} bytes")
