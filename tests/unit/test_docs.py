"""The user's documentation stays a manual: the README under 200 lines; README, docs/*.md and the config fields' help
without dates, machine names or issue numbers (readings live on docs/benchmarks/*.md pages, with theirs); every
relative link resolves."""

import dataclasses
import re

import pytest

from conftest import ROOT
from rlfuse.config import Config, field_docs, section_class

USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LAB_NOTES = {
    "a date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "a machine": re.compile(r"\bVM\b|\bEPYC\b|\bXeon\b|\bSapphire Rapids\b"),
    "an issue number": re.compile(r"\b[Ii]ssues? #?\d+"),
    "a test timing": re.compile(r"\b\d+ (tests|passed) in \d+"),
}


def lab_notes(text: str) -> list[str]:
    return [f"{what}: {m.group(0)!r}" for what, rx in LAB_NOTES.items() for m in rx.finditer(text)]


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) < 200


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: p.name)
def test_user_docs_hold_no_lab_notes(path):
    assert lab_notes(path.read_text()) == []


def test_field_help_holds_no_lab_notes_and_is_short():
    for section in dataclasses.fields(Config):
        for name, doc in field_docs(section_class(section.name)).items():
            assert lab_notes(doc) == [], f"{section.name}.{name}"
            sentences = len(re.findall(r"[.;:!?](\s|$)", " ".join(doc.split())))
            assert len(doc) < 700, f"{section.name}.{name}: {len(doc)} characters of help ({sentences} clauses)"


def test_the_check_finds_what_it_looks_for():
    assert len(lab_notes("on 2026-12-02 the AMD EPYC VM ran issue 19's 833 passed in 630 s")) == 5


@pytest.mark.parametrize("path", USER_DOCS + [ROOT / "BENCHMARKS.md"], ids=lambda p: p.name)
def test_relative_links_resolve(path):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        assert (path.parent / target).exists(), f"{path.name} links to {target}, which does not exist"
