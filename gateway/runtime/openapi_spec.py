"""Write ``openapi/openapi.json`` from the app: ``python -m gateway.runtime.openapi_spec``.

The checked-in file is what API-gateway configs and client generators read;
a test fails when it no longer matches the app.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

SPEC_PATH = Path(__file__).resolve().parents[2] / "openapi" / "openapi.json"


def current_spec() -> dict[str, Any]:
    from gateway.runtime.app import create_app
    from gateway.settings import Settings

    # Building the app opens nothing (the lifespan does), so this is cheap.
    return create_app(Settings()).openapi()


def render(spec: dict[str, Any]) -> str:
    return json.dumps(spec, indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    SPEC_PATH.parent.mkdir(exist_ok=True)
    SPEC_PATH.write_text(render(current_spec()))
    print(f"wrote {SPEC_PATH}", file=sys.stderr)
