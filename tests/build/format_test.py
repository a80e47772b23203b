"""Every C++ file of ours is formatted as .clang-format says, by the clang-format that
requirements.txt pins (the venv's: Debian 12's and 13's clang-format versions format differently).
Prints the files that differ and exits 1 if there is one; fix with

    .venv/bin/clang-format -i FILE...

    format_test.py SOURCE_ROOT CLANG_FORMAT
"""
import pathlib
import re
import subprocess
import sys

DIRECTORIES = ["src", "include", "tests", "tools", "examples", "bench", "fuzz"]
SKIPPED = ["tests/data", "fuzz/corpus"]


def pinned_version(root):
    for line in (root / "requirements.txt").read_text().splitlines():
        if line.startswith("clang-format=="):
            return line.split("==", 1)[1].strip()
    sys.exit("format_test: requirements.txt pins no clang-format (expected a line clang-format==X.Y.Z)")


def main():
    root = pathlib.Path(sys.argv[1])
    clang_format = sys.argv[2]
    wanted = pinned_version(root)
    try:
        version = subprocess.run([clang_format, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        sys.exit(f"format_test: cannot run '{clang_format}' ({error}); scripts/setup.sh installs clang-format=={wanted} "
                 "into the venv")
    found = re.search(r"version (\d+\.\d+\.\d+)", version)
    if not found or found.group(1) != wanted:
        sys.exit(f"format_test: '{clang_format}' is {version.strip()!r}, expected {wanted} (requirements.txt): other "
                 "versions format differently. Run scripts/setup.sh")
    files = sorted(
        str(path) for directory in DIRECTORIES for path in (root / directory).rglob("*")
        if path.suffix in (".h", ".cpp") and path.is_file()
        and not any(str(path.relative_to(root)).startswith(skipped) for skipped in SKIPPED))
    if len(files) < 100:
        sys.exit(f"format_test: found only {len(files)} C++ files under {root}: not the source tree")
    result = subprocess.run([clang_format, "--dry-run", "--Werror", *files], capture_output=True, text=True)
    unformatted = sorted({line.split(":", 1)[0] for line in result.stderr.splitlines() if ": error:" in line})
    if result.returncode != 0 or unformatted:
        for path in unformatted:
            print(f"not formatted: {pathlib.Path(path).relative_to(root)}")
        print(result.stderr[-4000:] if not unformatted else "", end="")
        print(f"format_test: {len(unformatted)} file(s) differ from clang-format {wanted}'s output; fix with "
              f"{clang_format} -i FILE...")
        return 1
    print(f"format_test: {len(files)} files formatted as clang-format {wanted} formats them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
