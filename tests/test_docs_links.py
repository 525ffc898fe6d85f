"""Every relative link in README.md and docs/*.md leads somewhere: its file exists, and its
#anchor is a heading of that file (as GitHub makes anchors from headings)."""

import glob
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", *sorted(os.path.relpath(p, REPO) for p in glob.glob(f"{REPO}/docs/*.md"))]


def prose(text):
    """The text outside fenced code blocks (a `# comment` in one is no heading)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def anchors(path):
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to hyphens,
    a repeated one numbered."""
    seen, out = {}, set()
    with open(os.path.join(REPO, path)) as f:
        for title in re.findall(r"^#{1,6} +(.+?) *#* *$", prose(f.read()), flags=re.M):
            slug = re.sub(r"[^\w\- ]", "", title.replace("`", "").lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(path):
    with open(os.path.join(REPO, path)) as f:
        return re.findall(r"\]\(([^)\s]+)\)", prose(f.read()))


def test_every_relative_link_resolves_to_a_file_and_a_heading():
    broken = []
    for page in PAGES:
        for link in links(page):
            if re.match(r"[a-z]+:", link):  # https:, mailto:
                continue
            target, _, anchor = link.partition("#")
            path = os.path.normpath(os.path.join(os.path.dirname(page), target)) if target else page
            if not os.path.exists(os.path.join(REPO, path)):
                broken.append(f"{page}: {link} (no file {path})")
            elif anchor and anchor not in anchors(path):
                broken.append(f"{page}: {link} (no heading #{anchor} in {path})")
    assert not broken, "\n".join(broken)


def test_the_anchors_are_githubs():
    assert "a-real-model-on-a-laptop-smollm2-135m-instruct" in anchors("README.md")
    assert "real-models-qwen25--qwen3--llama-on-gpus" in anchors("README.md")
