"""Contracts of the documentation: every relative link resolves, every test the claims table of docs/tests.md names
exists, and every config key is documented with its default."""

import re

from support.locations import REPO, is_defined, named_tests


def test_every_relative_link_in_the_documentation_resolves():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def test_every_test_the_claims_table_names_exists():
    table = (REPO / "docs" / "tests.md").read_text().split("## Claims and the tests that check them")[1]
    named = named_tests(table)
    assert len(named) >= 30
    for file, test in named:
        assert is_defined(file, test), f"{file}::{test}"


def test_every_config_key_is_documented_with_its_default():
    from accel_train.config import describe_keys, spelled

    table = (REPO / "docs" / "config.md").read_text()
    for key, _, _, default in describe_keys():
        assert f"| `{key}` | {spelled(default)} |" in table or (default == "" and f"| `{key}` | |" in table), key
