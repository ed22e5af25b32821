"""The README is the front door (issue K): at most 300 lines, every flag this package adds in its
flags table, and every relative link in README.md and docs/*.md resolves (files and #anchors,
GitHub's heading slugs)."""
import argparse
import pathlib
import re

import megatron_burst

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README] + sorted((ROOT / "docs").glob("*.md"))


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines: move detail to docs/*.md (issue K: at most 300)"


def test_readme_lists_every_flag_we_add():
    parser = argparse.ArgumentParser()
    megatron_burst.add_args(parser)
    flags = {s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    text = README.read_text()
    missing = sorted(f for f in flags if f"`{f}`" not in text)
    assert not missing, f"flags missing from the README's flags table: {missing}"


def _slug(heading: str) -> str:
    text = re.sub(r"`", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: pathlib.Path) -> set:
    out, seen, fence = set(), {}, False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
            continue
        m = None if fence else re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m:
            s = _slug(m.group(2))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for m in re.finditer(r"!?\[[^\]]*\]\(([^)\s]+)\)", text):
            target = m.group(1)
            if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
                continue
            path, _, frag = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif frag and (dest.suffix != ".md" or frag not in _anchors(dest)):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
