"""Design Notes exist once, in one format, and every citation finds its Note.

A Note is defined either by a comment line holding only `Note [name]` (// or ///) at the top of the
comment that explains it, or by a `## Note [name]` section of docs/design.md; docs/design.md's table
lists every Note defined in code with its file. Everything else that says `Note [name]` cites it.
Prints every problem and exits 1 if there is one.

    notes_test.py SOURCE_ROOT
"""
import pathlib
import re
import sys

CODE_DIRECTORIES = ["src", "include", "tools", "tests", "examples", "bench", "fuzz"]
CITING = CODE_DIRECTORIES + ["docs", "scripts", ".ci"]
CODE_DEFINITION = re.compile(r"^\s*//+ Note \[([^\]]+)\]\s*$", re.M)
DOC_DEFINITION = re.compile(r"^## Note \[([^\]]+)\]\s*$", re.M)
INDEX_ROW = re.compile(r"^\| \[([^\]]+)\][^|]*\| (\S+) \|\s*$", re.M)
CITATION = re.compile(r"Note \[([^\]]+)\]")
OLD_FORMAT = re.compile(r"\[Note: ")


def joined(text, suffix):
    """The text with comment and Markdown line breaks joined, so a citation split over lines reads whole."""
    if suffix in (".h", ".cpp"):
        return re.sub(r"\s*\n\s*(//+|#)?\s*", " ", text)
    return re.sub(r"\s*\n\s*(#\s*)?", " ", text)


def main():
    root = pathlib.Path(sys.argv[1])
    problems = []
    defined = {}
    for directory in CODE_DIRECTORIES:
        for path in sorted((root / directory).rglob("*")):
            if path.suffix not in (".h", ".cpp") or not path.is_file():
                continue
            for name in CODE_DEFINITION.findall(path.read_text(errors="replace")):
                defined.setdefault(name, []).append(str(path.relative_to(root)))
    design = (root / "docs" / "design.md").read_text()
    for name in DOC_DEFINITION.findall(design):
        defined.setdefault(name, []).append("docs/design.md")
    if len(defined) < 10:
        problems.append(f"only {len(defined)} Notes found under {root}: not the source tree")
    for name, places in sorted(defined.items()):
        if len(places) > 1:
            problems.append(f"Note [{name}] is defined {len(places)} times: {', '.join(places)}; keep one")
    index = dict(INDEX_ROW.findall(design))
    for name, places in sorted(defined.items()):
        if places[0] != "docs/design.md" and index.get(name) != places[0]:
            found = f"lists it under {index[name]}" if name in index else "does not list it"
            problems.append(f"Note [{name}] is defined in {places[0]}, but docs/design.md's table {found}")
    for name, where in sorted(index.items()):
        if name not in defined:
            problems.append(f"docs/design.md's table lists Note [{name}] ({where}), which nothing defines")
    citing = [root / "README.md"] + [path for directory in CITING for path in sorted((root / directory).rglob("*"))
                                     if path.is_file() and path.suffix in (".h", ".cpp", ".md", ".py", ".sh", "")]
    for path in citing:
        if "corpus" in path.parts or "regressions" in path.parts or "data" in path.parts or path.name == "notes_test.py":
            continue
        text = path.read_text(errors="replace")
        relative = path.relative_to(root)
        if OLD_FORMAT.search(text):
            problems.append(f"{relative}: '[Note: name]' is the old format; write 'Note [name]'")
        for name in sorted(set(CITATION.findall(joined(text, path.suffix)))):
            if name not in defined:
                problems.append(f"{relative} cites Note [{name}], which nothing defines")
    for problem in problems:
        print(problem)
    print(f"notes_test: {len(defined)} Notes, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
