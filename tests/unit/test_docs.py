"""The documentation: README as a short entry page, the site's pages and links, the config
reference generated from the models, and dated figures on the benchmarks page."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Literal

import pytest
import yaml
from pydantic import BaseModel, Field, create_model

from services.common.config import StrictModel
from services.deployment import deployment_model

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def _hook() -> ModuleType:
    """scripts/config_reference.py, the mkdocs hook, loaded as mkdocs loads it: by path."""
    spec = importlib.util.spec_from_file_location("config_reference",
                                                  ROOT / "scripts" / "config_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nav_files(entries: list) -> list[str]:
    files: list[str] = []
    for entry in entries:
        for value in (entry.values() if isinstance(entry, dict) else [entry]):
            files += _nav_files(value) if isinstance(value, list) else [value]
    return files


def _mkdocs_config() -> dict:
    # mkdocs.yml holds no python tags, so the safe loader reads it.
    return dict(yaml.safe_load((ROOT / "mkdocs.yml").read_text()))


def test_readme_is_a_short_entry_page_whose_links_resolve() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200
    assert "make demo" in text and "make test" in text
    assert "![" in text, "the README shows a picture"
    links = re.findall(r"\]\(([^)#\s]+)", text)
    local = [link for link in links if "://" not in link]
    assert len(local) >= 10, "the README points to the docs"
    for link in local:
        assert (ROOT / link).exists(), f"README links to {link}, which does not exist"


def test_nav_and_docs_pages_match() -> None:
    nav = _nav_files(_mkdocs_config()["nav"])
    assert len(nav) == len(set(nav)), "a page is in the nav twice"
    for page in nav:
        assert (DOCS / page).is_file(), f"mkdocs.yml's nav names {page}, which is not in docs/"
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages == set(nav), f"pages outside the nav: {sorted(pages - set(nav))}"
    for page in ["quickstart.md", "concepts.md", "local-stack.md", "training.md", "tasks.md",
                 "slurm.md", "compose.md", "admin.md", "faults.md", "dashboard.md",
                 "benchmarks.md", "config.md"]:
        assert page in nav


def test_included_readmes_exist() -> None:
    for page in DOCS.glob("*.md"):
        for path in re.findall(r'^--8<-- "([^":]+)', page.read_text(), re.M):
            assert (ROOT / path).is_file(), f"{page.name} includes {path}, which is missing"


def _leaf_paths(model: type[BaseModel], prefix: str) -> list[tuple[str, str]]:
    """(section, key) of every leaf field, walking sub-sections and unions of them."""
    hook = _hook()
    leaves: list[tuple[str, str]] = []
    for name, field in model.model_fields.items():
        sub_models = hook._models_of(field.annotation)
        if sub_models:
            for sub in sub_models:
                leaves += _leaf_paths(sub, f"{prefix}.{name}" if prefix else name)
        else:
            leaves.append((prefix, name))
    return leaves


def _rows_by_section(text: str) -> dict[str, set[str]]:
    rows: dict[str, set[str]] = {}
    section = ""
    for line in text.splitlines():
        heading = re.match(r"^#+ `\[([^\]]+)\]`", line)
        if heading:
            section = heading.group(1)
            rows.setdefault(section, set())
        key = re.match(r"^\| `([^`]+)` \|", line)
        if key:
            rows[section].add(key.group(1))
    return rows


def test_config_reference_lists_every_key_of_every_section() -> None:
    text = _hook().deployment_reference()
    rows = _rows_by_section(text)
    leaves = _leaf_paths(deployment_model(), "")
    assert len(leaves) > 200
    for section, key in leaves:
        assert key in rows.get(section, set()), f"[{section}] {key} is not in the reference"
    assert "`sampling_temperature` | `float`" in text
    assert '### `[sandbox.provider]` (`type = "daytona"`)' in text


def test_config_reference_follows_the_models() -> None:
    """A key someone adds to a section is in the reference without anyone editing a page."""
    hook = _hook()

    class Knobs(StrictModel):
        """Knobs of a service that does not exist yet."""

        num_widgets: int = Field(4, ge=1, description="widgets per <shard>, a | b")
        mode: Literal["fast", "safe"] = Field("safe", description="`fast` or `safe`")
        peers: list[str] = Field(default_factory=list, description="peers to call")
        token: str | None = Field(None, description="bearer token")
        path: str = Field(description="where it lives")

    deployment = create_model("D", __base__=StrictModel, knobs=(Knobs, Field(...)))
    text = hook.render_reference(deployment)
    assert "## `[knobs]`" in text
    assert "Knobs of a service that does not exist yet." in text
    assert r"| `num_widgets` | `int` | `4` | widgets per &lt;shard&gt;, a \| b |" in text
    assert '| `mode` | `"fast" | "safe"` | `"safe"` | `fast` or `safe` |' in text
    assert "| `peers` | `list[str]` | `[]` | peers to call |" in text
    assert "| `token` | `str | null` | `unset` | bearer token |" in text
    assert "| `path` | `str` | `required` | where it lives |" in text


def test_the_hook_fills_only_the_marked_page() -> None:
    hook = _hook()
    assert hook.on_page_markdown("# Other\n\nno marker") == "# Other\n\nno marker"
    filled = hook.on_page_markdown(f"# Keys\n\n{hook.MARKER}\n")
    assert hook.MARKER not in filled and "## `[trainer]`" in filled


def test_every_figure_section_of_the_benchmarks_page_has_a_command_and_a_date() -> None:
    text = (DOCS / "benchmarks.md").read_text()
    sections = re.split(r"^#{2,3} ", text, flags=re.M)[1:]
    assert len(sections) >= 8
    for section in sections:
        title, body = section.split("\n", 1)
        if title in ("The benchmarks", "The trainer"):
            continue  # the list of benchmarks; a heading over its sub-sections
        assert DATE.search(body), f"benchmarks.md: '{title}' has figures without a date"
        assert "bench/" in body, f"benchmarks.md: '{title}' has figures without a command"


@pytest.mark.slow
def test_the_site_builds_strictly(workdir: Path) -> None:
    """What `make docs` runs: a broken link, a missing anchor or page fails it."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs-material not installed (the dev extra installs it)")
    site = workdir / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(site)], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1",
                               **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}})
    assert done.returncode == 0, done.stderr[-3000:]
    config_page = (site / "config" / "index.html").read_text()
    assert "max_concurrent_samples" in config_page and "<table>" in config_page
    assert (site / "dashboard.png").is_file()
    shutil.rmtree(site)
