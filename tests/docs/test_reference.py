"""The reference pages are what ``python -m docs.gen`` makes of the code: a setting, a
loader field, a metric, a route, a command or an error class changed without its page
fails here (run ``make docs-gen``)."""

from __future__ import annotations

from docs import blocks, gen


def test_the_reference_is_what_the_code_makes() -> None:
    problems = gen.check()
    assert not problems, "\n".join(problems) + "\nrun `make docs-gen` and commit the pages"


def test_every_generated_block_is_on_a_page() -> None:
    """Each renderer has its block somewhere, so no part of the reference is left out."""
    found = {m.group("name") for p in blocks.pages() for m in gen.MARKER.finditer(p.read_text())}
    assert found == set(gen.RENDERERS)


def test_a_hand_edit_is_caught() -> None:
    page = (blocks.DOCS / "reference" / "settings.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| `PINFEED_PORT`"))
    assert gen.render(page) == page
    assert gen.render(page.replace(row + "\n", "")) == page  # a row lost comes back
    edited = page.replace(row, row.replace("8321", "8322"))
    assert gen.render(edited) != edited


def test_every_error_class_says_when() -> None:
    """The errors table's "When" is each class's docstring: one without fails the
    generator, naming it."""
    from pinfeed.errors import ERRORS

    assert all(cls.__doc__ for cls in ERRORS)
