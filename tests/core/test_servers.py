"""The server page: scripts/SERVERS.md is what scripts/rule_catalogue.py writes from kvcalib/core/servers.py now,
every row names numerics kvcalib has and an eval order it runs, and the README links the page."""

from __future__ import annotations

import importlib.util

from helpers import REPO, SCRIPTS

from kvcalib.core import fp8
from kvcalib.core.servers import SERVERS


def test_the_page_is_current_and_linked():
    spec = importlib.util.spec_from_file_location("rule_catalogue", SCRIPTS / "rule_catalogue.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.SERVERS_OUT.read_text(encoding="utf-8") == module.render_servers(), (
        "scripts/SERVERS.md is stale: run `python scripts/rule_catalogue.py`"
    )
    assert "(scripts/SERVERS.md)" in (REPO / "README.md").read_text(encoding="utf-8")


def test_every_server_is_one_kvcalib_emulates():
    assert {s.order for s in SERVERS} <= set(fp8.ORDERS)
    for server in SERVERS:
        if server.numerics:
            target = fp8.get_target(server.numerics)
            assert f"±{target.fp8_max:g}" in server.write or "as trn2" in server.write, server.name
        else:
            assert server.order == fp8.MXFP8_ORDER and server.scales.startswith("none")
    assert {s.numerics for s in SERVERS} >= set(fp8.TARGETS) | set(fp8.EMULATED)
