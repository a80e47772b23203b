"""README's guide to the headers names every public header (include/fsdp/, models/ included), so a
header added without a line there fails here. Prints the missing ones and exits 1 if there is one.

    header_guide_test.py SOURCE_ROOT
"""
import pathlib
import sys


def main():
    root = pathlib.Path(sys.argv[1])
    readme = (root / "README.md").read_text()
    start = readme.find("Guide to the headers")
    if start < 0:
        sys.exit("header_guide_test: README.md has no 'Guide to the headers' section")
    end = readme.find("\n## ", start)
    guide = readme[start:end if end > 0 else len(readme)]
    headers = sorted(str(path.relative_to(root / "include" / "fsdp")) for path in (root / "include" / "fsdp").rglob("*.h"))
    if len(headers) < 20:
        sys.exit(f"header_guide_test: found only {len(headers)} public headers under {root}: not the source tree")
    missing = [header for header in headers if f"`{header}`" not in guide]
    for header in missing:
        print(f"README.md's guide to the headers does not name `{header}`: add a line saying what it is for")
    print(f"header_guide_test: {len(headers)} public headers, {len(missing)} missing from the guide")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
