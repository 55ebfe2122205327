"""`import domain` works with nothing but the standard library.

A fresh interpreter with site-packages switched off (-S) and PYTHON* variables ignored (-E)
imports every module under domain/ (found on disk, so new modules are covered) and reports any
loaded module that is neither the standard library nor part of domain.
"""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import importlib, json, sys
repo = sys.argv[1]
sys.path[:] = [repo] + [p for p in sys.path if p and 'site-packages' not in p]
allowed = set(sys.stdlib_module_names) | {'__main__', 'domain'}
offenders = {}
for name in json.loads(sys.argv[2]):
    before = set(sys.modules)
    importlib.import_module(name)
    for loaded in set(sys.modules) - before:
        if loaded.split('.')[0] not in allowed:
            offenders.setdefault(name, []).append(loaded)
print(json.dumps({'offenders': offenders, 'path': sys.path,
                  'outside': sorted(m for m in sys.modules if m.split('.')[0] not in allowed)}))
"""


def domain_modules() -> list[str]:
    modules = []
    for path in sorted((REPO / "domain").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return modules


def test_discovers_the_domain_modules():
    modules = domain_modules()
    assert modules[0] == "domain"
    assert {"domain.model_spec", "domain.budget", "domain.resize"} <= set(modules)


def test_domain_imports_only_the_standard_library():
    modules = domain_modules()
    run = subprocess.run([sys.executable, "-S", "-E", "-c", PROBE, str(REPO), json.dumps(modules)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"importing the domain without site-packages failed:\n{run.stderr}"
    report = json.loads(run.stdout)
    assert not any("site-packages" in p for p in report["path"])
    assert report["offenders"] == {}, f"non-stdlib imports: {report['offenders']}"
    assert report["outside"] == []
