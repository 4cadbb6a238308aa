#!/usr/bin/env python3
"""The declared MSRV holds for the lock file: no package the workspace builds
(normal, build and dev dependencies, all features) declares a newer
`rust-version` than the workspace's own. Reads `cargo metadata`; prints the
packages that set the floor; exits 1 if the declaration is below it."""
import json
import subprocess
import sys


def version(v):
    parts = [int(x) for x in v.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


meta = json.loads(
    subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--locked", "--all-features"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
)
members = set(meta["workspace_members"])
resolved = {n["id"] for n in meta["resolve"]["nodes"]}
declared = {
    p["name"]: p.get("rust_version") for p in meta["packages"] if p["id"] in members
}
deps = [
    (version(p["rust_version"]), p["name"], p["version"])
    for p in meta["packages"]
    if p["id"] in resolved and p["id"] not in members and p.get("rust_version")
]
need = max(deps)[0] if deps else (0,)
floor = ", ".join(f"{n} {v}" for r, n, v in sorted(deps) if r == need)
ok = True
for name, rv in sorted(declared.items()):
    if rv is None or version(rv) < need:
        print(f"{name}: rust-version {rv} is below {'.'.join(map(str, need))}, which {floor} need")
        ok = False
print(f"MSRV: the lock file needs Rust {'.'.join(map(str, need))} ({floor}); declared: {sorted(set(declared.values()))}")
sys.exit(0 if ok else 1)
