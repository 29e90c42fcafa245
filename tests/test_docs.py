"""The README stays what a newcomer reads in five minutes, and its module table names every module."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_readme_is_short():
    assert len(README.splitlines()) <= 150, "README.md is over 150 lines: move history to docs/benchmarks/HISTORY.md"


def test_module_table_names_every_module():
    table = "\n".join(line for line in README.splitlines() if line.startswith("| `"))
    modules = [
        path
        for folder in ("medusa", "medusa/cli", "medusa/runtime", "medusa/train")
        for path in (ROOT / folder).glob("*.py")
        if path.name != "__init__.py"
    ]
    missing = sorted(str(path.relative_to(ROOT)) for path in modules if path.name not in table)
    assert not missing, f"README's module table leaves out {missing}"


def test_links_in_the_readme_resolve():
    import re

    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    broken = [target for target in targets if not target.startswith("http") and not (ROOT / target).exists()]
    assert not broken, f"README links to missing files: {broken}"
