"""The docs' tables say what the code says: read from the contract module and the settings."""

from __future__ import annotations

import re
from pathlib import Path

from pdwatch import contract as c
from pdwatch import settings as client
from pdwatch.sidecar.settings import Settings, markdown_table

DOCS = Path(__file__).resolve().parent.parent / "docs"


def between(text: str, marker: str) -> str:
    found = re.search(rf"<!-- {marker}:begin -->\n(.*?)\n<!-- {marker}:end -->", text, re.S)
    assert found, f"no {marker} table"
    return found.group(1)


def test_the_contract_page_lists_every_required_metric_as_the_module_has_it():
    rows = ["| metric | type | labels |", "|---|---|---|"]
    rows += [f"| `{m.series}` | {m.type} | {', '.join(m.labels)} |".replace("|  |", "| |") for m in c.REQUIRED_METRICS]
    assert between((DOCS / "contract.md").read_text(), "metrics") == "\n".join(rows)


def test_the_contract_page_names_every_family_alert_and_reason():
    text = (DOCS / "contract.md").read_text()
    for name in (*c.FAMILIES, *c.ALERT_NAMES, *c.STUCK_REASONS):
        assert f"`{name}`" in text, name


def test_the_sidecar_page_has_the_settings_table_the_declaration_makes():
    assert between((DOCS / "sidecar.md").read_text(), "settings") == markdown_table()


def test_the_sidecar_page_has_the_client_settings_table_the_declaration_makes():
    assert between((DOCS / "sidecar.md").read_text(), "client-settings") == client.markdown_table()


def test_every_setting_the_contract_fixes_is_declared():
    declared = {f"{c.ENV_PREFIX}{name.upper()}" for name in Settings.model_fields}
    assert set(c.SIDECAR_ENV) <= declared, set(c.SIDECAR_ENV) - declared
