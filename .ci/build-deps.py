"""Print the requirements `maturin develop -E EXTRAS` installs: pyproject.toml's
[project] dependencies and those of each extra in argv[1] (comma-separated).

`make build` installs them with pip while the extension compiles beside it. Prints nothing
where Python has no tomllib (3.10): `maturin develop` then installs them itself, as before.
"""

import sys

try:
    import tomllib
except ImportError:
    sys.exit(0)

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
extras = [e for e in (sys.argv[1] if len(sys.argv) > 1 else "").split(",") if e]
requirements = list(project.get("dependencies", []))
for extra in extras:
    requirements += project.get("optional-dependencies", {}).get(extra, [])
# An extra that names the package itself is maturin's to install, not PyPI's.
print("\n".join(r for r in requirements if not r.lower().startswith(project["name"])))
