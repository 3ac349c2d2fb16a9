"""validate's rule catalogue: scripts/VALIDATE_RULES.md is what scripts/rule_catalogue.py writes now, and the table
in kvcalib/validation/rules.py holds exactly the finding codes kvcalib's source emits, read with `ast` (nothing run).
test_validate.py's cases check every finding validate returns against the table too."""

from __future__ import annotations

import ast
import importlib.util
import re
from functools import cache

from helpers import REPO, SCRIPTS

from kvcalib.validation.report import SEVERITIES
from kvcalib.validation.rules import RULE, RULES

PACKAGE = REPO / "kvcalib"
CATALOGUE = PACKAGE / "validation" / "rules.py"  # the table itself, left out of the scan
CODE = re.compile(r"^[A-Z0-9]+(-[A-Z0-9]+)+$")
# a string that looks like a piece of a code: "SCALE-" + kind, f"SCALE-{kind}", "SCALE-%s", ...
FRAGMENT = re.compile(r"^[A-Z0-9]+(-[A-Z0-9]+)*-$|^-[A-Z0-9]+(-[A-Z0-9]+)*$|[A-Z0-9]+-(\{|%)")
SEVERITY_NAMES = {"ERROR": "error", "WARNING": "warning", "INFO": "info"}
REGENERATE = "python scripts/rule_catalogue.py"


def _script():
    spec = importlib.util.spec_from_file_location("rule_catalogue", SCRIPTS / "rule_catalogue.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _codes(node: ast.AST) -> set[str]:
    """The finding codes an expression can be: a literal, or either branch of `a if c else b`."""
    if isinstance(node, ast.IfExp):
        return _codes(node.body) | _codes(node.orelse)
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and CODE.match(node.value):
        return {node.value}
    return set()


def _severities(node: ast.AST) -> set[str]:
    """The severities an expression can be: ERROR/WARNING/INFO, "error"/..., or either branch of an `if`."""
    if isinstance(node, ast.IfExp):
        return _severities(node.body) | _severities(node.orelse)
    if isinstance(node, ast.Name) and node.id in SEVERITY_NAMES:
        return {SEVERITY_NAMES[node.id]}
    if isinstance(node, ast.Constant) and node.value in SEVERITIES:
        return {node.value}
    return set()


@cache
def _scan() -> tuple[
    dict[str, list[str]], dict[str, list[str]], list[tuple[str, set[str], str]], list[str]
]:
    """Over every module of kvcalib but the catalogue: (emitted, mentioned, severities, fragments).

    emitted: code -> where it is the first argument of a call or the first item of a tuple, as in
    `Finding("SCALE-MISSING", ERROR, ...)`, `_rejected("NEURON-QCFG-WEIGHTS", ...)` and core/mxfp4.py's
    `("CKPT-MXFP4-PAIR", "error", ...)`; mentioned: code -> every literal that looks like one, wherever it is
    (preflight's sets included); severities: (code, the severities the next argument can be, where);
    fragments: where a string looks like part of a code, i.e. a code built from pieces the scan cannot read."""
    emitted: dict[str, list[str]] = {}
    mentioned: dict[str, list[str]] = {}
    severities: list[tuple[str, set[str], str]] = []
    fragments: list[str] = []
    for path in sorted(set(PACKAGE.rglob("*.py")) - {CATALOGUE}):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if CODE.match(node.value):
                    mentioned.setdefault(node.value, []).append(where)
                elif FRAGMENT.search(node.value):
                    fragments.append(f"{where}: {node.value!r}")
            items = (
                node.args
                if isinstance(node, ast.Call)
                else node.elts
                if isinstance(node, ast.Tuple)
                else []
            )
            if not items:
                continue
            for code in _codes(items[0]):
                emitted.setdefault(code, []).append(where)
                if len(items) > 1 and _severities(items[1]):
                    severities.append((code, _severities(items[1]), where))
    return emitted, mentioned, severities, fragments


def test_the_committed_catalogue_is_current():
    script = _script()
    assert script.COMMAND == REGENERATE
    assert script.OUT == SCRIPTS / "VALIDATE_RULES.md"
    assert script.OUT.read_text(encoding="utf-8") == script.render(), (
        f"scripts/VALIDATE_RULES.md is stale: run `{REGENERATE}` and commit it"
    )


def test_the_catalogue_lists_every_code_once_with_a_severity_and_a_source():
    codes = [rule.code for rules in RULES.values() for rule in rules]
    assert len(codes) == len(set(codes)) == len(RULE)
    for rule in RULE.values():
        assert CODE.match(rule.code), rule
        named = [
            word for word in SEVERITIES if word in rule.severity
        ]  # a text names every severity it takes
        assert rule.severity in SEVERITIES or len(named) >= 2, rule
        assert rule.catches and rule.follows, rule


def test_every_code_kvcalib_emits_is_in_the_catalogue():
    emitted, mentioned, _, fragments = _scan()
    assert len(emitted) > 40  # the scan sees the rule modules (about 60 codes)
    assert not fragments, (
        f"finding codes must be whole literals, which the catalogue's test can read: {fragments}"
    )
    missing = {code: where for code, where in {**mentioned, **emitted}.items() if code not in RULE}
    assert not missing, (
        f"codes in kvcalib but not in kvcalib/validation/rules.py: {missing}; add them there, "
        f"then run `{REGENERATE}`"
    )


def test_every_code_in_the_catalogue_is_emitted():
    emitted, *_ = _scan()
    dead = sorted(set(RULE) - set(emitted))
    assert not dead, (
        f"rules.py lists codes nothing in kvcalib emits: {dead}; remove them, then run `{REGENERATE}`"
    )


def test_each_emission_uses_a_severity_the_catalogue_gives():
    _, _, severities, _ = _scan()
    assert severities
    for code, found, where in severities:
        rule = RULE[code]
        allowed = (
            {rule.severity}
            if rule.severity in SEVERITIES
            else {w for w in SEVERITIES if w in rule.severity}
        )
        assert found <= allowed, (
            f"{where}: {code} emitted as {sorted(found)}, the catalogue says {rule.severity!r}"
        )


def test_the_catalogue_file_has_one_row_per_code():
    text = (SCRIPTS / "VALIDATE_RULES.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `([A-Z0-9-]+)` \|", text, flags=re.M)
    assert sorted(rows) == sorted(RULE)
    assert REGENERATE in text.splitlines()[2]
