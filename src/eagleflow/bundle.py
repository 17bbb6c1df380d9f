"""The offline bundle: every wheel a GPU host without internet lacks, in parts of a fixed size.

A host that reaches no package index (the lent GPU machine, an air-gapped cluster) gets the
project's stack as one tar of wheels cut into parts (at most `part_mib` each, so each fits what a
transfer carries), with a manifest holding each part's and the whole's sha256. `build` runs where
pip reaches the registry; `install` runs on the host with nothing but Python 3 and pip: this module
imports only the standard library, so `python3 src/eagleflow/bundle.py install ...` works before
anything is installed.

What goes in is decided by files under `requirements/`, not by this code:
  device-lock.txt   the host's full resolution (uv pip compile of device.in, Python 3.12, manylinux)
  device-image.txt  packages the host already has (left out; the host's own builds of torch, CUDA)
  device-drop.txt   optional heavy packages the EAGLE-3 path never imports (left out)
  data.txt          the data-only packages (the target's GGUF, ShareGPT, MT-Bench)
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

MANIFEST = "manifest.json"
PART_PREFIX = "part-"
# Files cut from the vllm wheel: none is on the EAGLE-3 path of a Hopper GPU (FA2 is the pre-Hopper
# attention, Hopper uses FA3; the MoE kernels load under contextlib.suppress; the Rust frontend
# runs only with VLLM_USE_RUST_FRONTEND). 289.6 MiB -> 112 MiB for vllm 0.26.0.
TRIM = {
    "vllm": (
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
        "vllm/_moe_C_stable_libtorch.abi3.so",
        "vllm/vllm-rs",
    )
}
# pip's --platform matches manylinux tags exactly: offer every glibc level up to the host's.
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 4, -1)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
]
_EPOCH = 1_700_000_000  # fixed mtime of every tar member: the same wheels give the same bytes


class BundleError(Exception):
    """A bundle that cannot be built or installed; the message says what to run."""


def norm(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> list[str]:
    """`name==version` lines of a requirements file (comments and blanks dropped)."""
    pins = []
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            pins.append(line)
    return pins


def read_names(path: Path) -> set[str]:
    """Normalised project names of a list file (one per line, pins allowed)."""
    return {norm(re.split(r"[=<>!~ ;\[]", p, maxsplit=1)[0]) for p in read_pins(path)}


def wanted_pins(req_dir: Path) -> tuple[list[str], list[str]]:
    """(pins of the lock that the host lacks, pins of the data packages), from `req_dir`."""
    skip = read_names(req_dir / "device-image.txt") | read_names(req_dir / "device-drop.txt")
    lock = [p for p in read_pins(req_dir / "device-lock.txt") if norm(p.split("==")[0]) not in skip]
    return lock, read_pins(req_dir / "data.txt")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _wheel_project(filename: str) -> str:
    return norm(filename.split("-", 1)[0])


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise BundleError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")


def download(pins: list[str], wheel_dir: Path, python_version: str, binary: bool = True) -> None:
    """Wheels of `pins` for the host's Python and platform into `wheel_dir` (present ones kept).

    A project with no wheel on the index (an sdist of pure Python) is built here with `pip wheel`:
    such a build is platform-independent."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    have = {_wheel_project(p.name) for p in wheel_dir.glob("*.whl")}
    missing = [p for p in pins if norm(p.split("==")[0]) not in have]
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    for pin in missing:
        if binary:
            try:
                _pip(
                    "download", "-q", "--no-deps", "--only-binary=:all:", "--implementation",
                    "cp", "--python-version", python_version, *plat, "-d", str(wheel_dir), pin,
                )  # fmt: skip
                continue
            except BundleError:
                pass
        _pip("wheel", "-q", "--no-deps", "-w", str(wheel_dir), pin)


def trim_wheel(path: Path, drop: tuple[str, ...]) -> int:
    """Rewrite the wheel at `path` without the files under `drop` (RECORD updated); bytes saved."""
    before = path.stat().st_size
    tmp = path.with_suffix(".trim")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        names = [n for n in src.namelist() if not any(n.startswith(d) for d in drop)]
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        for name in names:
            info = src.getinfo(name)
            data = src.read(name)
            if name == record:
                lines = data.decode().splitlines()
                keep = [ln for ln in lines if not any(ln.startswith(d) for d in drop)]
                data = ("\n".join(keep) + "\n").encode()
            dst.writestr(info, data, compress_type=info.compress_type)
    os.replace(tmp, path)
    return before - path.stat().st_size


def _tar_add(tar: tarfile.TarFile, path: Path, arcname: str) -> None:
    info = tarfile.TarInfo(arcname)
    info.size = path.stat().st_size
    info.mtime, info.mode, info.uid, info.gid = _EPOCH, 0o644, 0, 0
    with open(path, "rb") as f:
        tar.addfile(info, f)


def pack(wheels: list[Path], out_dir: Path, part_mib: int, meta: dict) -> dict:
    """Tar `wheels` (in the given order) and cut the tar into parts of `part_mib` MiB; write the
    manifest last, so a bundle folder with a manifest is a complete one."""
    if part_mib < 1:
        raise BundleError(f"part size {part_mib} MiB: expected at least 1")
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in [*out_dir.glob(PART_PREFIX + "*"), out_dir / MANIFEST]:
        old.unlink(missing_ok=True)
    whole = hashlib.sha256()
    size = part_mib << 20
    parts: list[dict] = []
    buf = io.BytesIO()

    class _Writer(io.RawIOBase):  # streams tar bytes into fixed-size part files
        def writable(self) -> bool:
            return True

        def write(self, b) -> int:
            b = bytes(b)
            whole.update(b)
            buf.write(b)
            while buf.tell() >= size:
                data = buf.getvalue()
                _flush(data[:size])
                buf.seek(0)
                buf.truncate()
                buf.write(data[size:])
            return len(b)

    def _flush(data: bytes) -> None:
        name = f"{PART_PREFIX}{len(parts):03d}"
        (out_dir / name).write_bytes(data)
        parts.append({"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})

    records = []
    with tarfile.open(fileobj=_Writer(), mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for w in wheels:
            _tar_add(tar, w, w.name)
            records.append({"name": w.name, "bytes": w.stat().st_size, "sha256": sha256_file(w)})
    if buf.tell():
        _flush(buf.getvalue())
    manifest = {
        **meta,
        "part_mib": part_mib,
        "parts": parts,
        "whole": {"bytes": sum(p["bytes"] for p in parts), "sha256": whole.hexdigest()},
        "wheels": records,
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def build(
    repo: Path,
    out_dir: Path,
    cache: Path,
    part_mib: int = 56,
    python_version: str = "3.12",
    with_self: bool = True,
) -> dict:
    """Download (into `cache`), trim and pack the host's wheels; returns the manifest."""
    req = repo / "requirements"
    lock, data = wanted_pins(req)
    download(lock, cache / "lock", python_version)
    download(data, cache / "data", python_version)
    lock_names = {norm(p.split("==")[0]): p.split("==")[1] for p in lock}
    data_names = {norm(p.split("==")[0]) for p in data}
    wheels = []
    for sub, names in (("lock", lock_names), ("data", data_names)):
        for w in sorted((cache / sub).glob("*.whl")):
            if _wheel_project(w.name) in names:
                wheels.append(w)
    found = {_wheel_project(w.name) for w in wheels}
    absent = sorted((set(lock_names) | data_names) - found)
    if absent:
        raise BundleError(f"no wheel for {', '.join(absent)} in {cache}; delete it and rebuild")
    trimmed = {}
    for w in wheels:
        project = _wheel_project(w.name)
        if project in TRIM:
            with zipfile.ZipFile(w) as z:  # the cache keeps the trimmed wheel; a fresh copy
                untrimmed = any(n.startswith(TRIM[project]) for n in z.namelist())
            if untrimmed:  # (re-downloaded, replaced) is trimmed again
                trimmed[project] = trim_wheel(w, TRIM[project])
    # Stable and big first, this package last: a new commit changes only the last part.
    wheels.sort(key=lambda w: (_wheel_project(w.name) in data_names, w.name))
    meta = {
        "python": python_version,
        "lock_sha256": sha256_file(req / "device-lock.txt"),
        "trimmed": {
            p: list(TRIM[p]) for p in TRIM if p in {_wheel_project(w.name) for w in wheels}
        },
    }
    if with_self:
        self_dir = Path(tempfile.mkdtemp(prefix="eagleflow-wheel-"))
        try:
            _pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(self_dir), str(repo))
            shutil.rmtree(repo / "build", ignore_errors=True)  # setuptools' leftovers
            own = next(self_dir.glob("eagleflow-*.whl"))
            kept = cache / "self"
            kept.mkdir(parents=True, exist_ok=True)
            shutil.copy2(own, kept / own.name)
            wheels.append(kept / own.name)
        finally:
            shutil.rmtree(self_dir, ignore_errors=True)
        meta["commit"] = _git_commit(repo)
    return pack(wheels, out_dir, part_mib, meta)


def _git_commit(repo: Path) -> str | None:
    proc = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    return proc.stdout.strip() or None


def load_manifest(parts_dir: Path) -> dict:
    path = Path(parts_dir) / MANIFEST
    if not path.is_file():
        raise BundleError(
            f"no {MANIFEST} in {parts_dir}: the bundle's parts travel with their manifest. "
            "Copy the folder `make device-bundle` wrote (all parts and manifest.json)."
        )
    return json.loads(path.read_text())


def check_parts(parts_dir: Path, manifest: dict | None = None) -> dict:
    """Raise BundleError naming every missing or changed part; the manifest when all match."""
    parts_dir = Path(parts_dir)
    manifest = manifest or load_manifest(parts_dir)
    missing, changed = [], []
    for part in manifest["parts"]:
        path = parts_dir / part["name"]
        if not path.is_file():
            missing.append(part["name"])
        elif path.stat().st_size != part["bytes"] or sha256_file(path) != part["sha256"]:
            changed.append(part["name"])
    if missing or changed:
        lines = []
        if missing:
            lines.append(f"missing part(s) {', '.join(missing)}")
        if changed:
            lines.append(f"changed part(s) {', '.join(changed)} (size or sha256 differs)")
        raise BundleError(
            f"bundle in {parts_dir} is incomplete: {'; '.join(lines)} of "
            f"{len(manifest['parts'])}. Send those parts again from the folder `make "
            "device-bundle` wrote (or rebuild it there), then install again; nothing was installed."
        )
    return manifest


def reassemble(parts_dir: Path, manifest: dict, dest: Path) -> None:
    """Concatenate the parts into `dest`, checking the whole's sha256 on the way."""
    h = hashlib.sha256()
    with open(dest, "wb") as out:
        for part in manifest["parts"]:
            with open(Path(parts_dir) / part["name"], "rb") as f:
                while block := f.read(1 << 22):
                    h.update(block)
                    out.write(block)
    if h.hexdigest() != manifest["whole"]["sha256"]:
        dest.unlink(missing_ok=True)
        raise BundleError(
            f"the reassembled bundle's sha256 {h.hexdigest()[:12]} is not the manifest's "
            f"{manifest['whole']['sha256'][:12]}: parts of two builds? Send all parts of one build."
        )


def install(parts_dir: Path, site: Path, python: str = sys.executable) -> dict:
    """Check, reassemble and `pip install --no-deps --no-index --target` the bundle into `site`.

    All or nothing: the wheels go into a fresh folder beside `site`, which replaces `site` only
    once pip succeeded; a failure leaves the previous `site` (or none) and no partial folder."""
    parts_dir, site = Path(parts_dir), Path(site)
    manifest = check_parts(parts_dir)
    site.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".bundle-", dir=site.parent))
    try:
        whole = work / "bundle.tar"
        reassemble(parts_dir, manifest, whole)
        wheels = work / "wheels"
        with tarfile.open(whole) as tar:
            tar.extractall(wheels, filter="data")
        whole.unlink()
        names = sorted(str(p) for p in wheels.glob("*.whl"))
        if len(names) != len(manifest["wheels"]):
            raise BundleError(
                f"{len(names)} wheels unpacked, manifest lists {len(manifest['wheels'])}"
            )
        new_site = work / "site"
        cmd = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        cmd += ["--no-cache-dir", "--target", str(new_site), *names]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise BundleError(
                f"pip could not install the bundle (nothing was installed into {site}):\n"
                f"{proc.stderr[-3000:]}"
            )
        (new_site / MANIFEST.replace(".json", ".bundle.json")).write_text(json.dumps(manifest))
        if site.exists():
            shutil.rmtree(site)
        os.replace(new_site, site)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bundle", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download, trim and pack the host's wheels")
    b.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[2])
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--cache", type=Path, required=True)
    b.add_argument("--part-mib", type=int, default=56)
    b.add_argument("--python-version", default="3.12")
    c = sub.add_parser("check", help="check the parts against the manifest")
    c.add_argument("parts", type=Path)
    i = sub.add_parser("install", help="check, reassemble and install into a site folder")
    i.add_argument("parts", type=Path)
    i.add_argument("--site", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        if args.cmd == "build":
            m = build(args.repo, args.out, args.cache, args.part_mib, args.python_version)
        elif args.cmd == "check":
            m = check_parts(args.parts)
        else:
            m = install(args.parts, args.site)
    except BundleError as e:
        print(f"bundle: {e}", file=sys.stderr)
        return 1
    mib = m["whole"]["bytes"] / 2**20
    print(
        f"bundle {args.cmd}: {len(m['wheels'])} wheels, {len(m['parts'])} parts, {mib:.1f} MiB, "
        f"sha256 {m['whole']['sha256'][:12]}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
