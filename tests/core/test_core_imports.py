"""core/ is pure policy: importing it must not pull in torch, numpy, asyncio or HTTP."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

FORBIDDEN = ["torch", "numpy", "asyncio", "fastapi", "starlette", "uvicorn", "httpx"]


def test_importing_core_pulls_in_no_tensors_event_loop_or_http() -> None:
    code = (
        "import json, sys\n"
        "import kvserve.core\n"
        "import kvserve.core.blocks, kvserve.core.plan, kvserve.core.queue, kvserve.core.scheduler\n"
        "import kvserve.core.kv_manager, kvserve.core.sequence, kvserve.sim.policies\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})))\n"
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert json.loads(result.stdout) == []


def test_the_check_itself_sees_a_forbidden_import() -> None:
    # Guards against a check that can never fail (e.g. a module name it cannot see).
    code = "import json, sys, asyncio\nprint(json.dumps('asyncio' in sys.modules))\n"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert json.loads(result.stdout) is True
