"""Setting the GPU host up (sources, venv), checking it item by item, installing the profile."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eagleflow.errors import RemoteError
from eagleflow.remote.settings import ENV_PREFIX, PROFILE_DIR, PROFILE_NAME, REPO_ROOT, Settings
from eagleflow.remote.transport import Remote

# ---------------------------------------------------------------------------------------------
# set-up, checks and the profile


@dataclass
class CheckItem:
    name: str
    ok: bool
    detail: str
    fix: str = ""

    def line(self) -> str:
        head = f"{'OK' if self.ok else 'MISSING':8}{self.name}: {self.detail}"
        return head + (f"\n        fix: {self.fix}" if self.fix and not self.ok else "")


def check(settings: Settings, min_gpus: int = 1) -> list[CheckItem]:
    """What the GPU host offers the profile, item by item, with the fix for each gap."""
    remote = Remote(settings)
    items = []
    t0 = time.monotonic()
    try:
        ping = remote.agent("ping", timeout=settings.connect_timeout_s + 30)
        took = time.monotonic() - t0
        ans = remote.agent("check", activate=settings.activate_cmd, env=settings.env, timeout=None)
    except RemoteError as e:
        return [CheckItem("ssh", False, str(e), "fix the connection settings above")]
    items.append(
        CheckItem(
            "ssh",
            True,
            f"{settings.label} is {ping['host']}, agent Python {ping['python']} ({took:.1f} s)",
        )
    )
    items.append(
        CheckItem(
            "remote dir",
            ans.get("writable", False),
            f"{ans['root']} ({ans.get('free_gb')} GB free)",
            f"make {settings.remote_dir} writable or set {ENV_PREFIX}REMOTE_DIR",
        )
    )
    for where, version in (("here", local_rsync_version()), ("on the host", ans.get("rsync"))):
        items.append(
            CheckItem(
                f"rsync {where}",
                _version_at_least(version, (3, 2, 3)),
                f"version {version}" if version else "not installed",
                f"install rsync >= 3.2.3 {where} (Debian: apt-get install rsync; macOS: brew "
                "install rsync); the profile uses --mkpath",
            )
        )
    env = ans.get("env", {})
    setup_fix = "make remote-setup (creates the venv with the gpu-host extra)"
    if "error" in env:
        items.append(
            CheckItem(
                "environment",
                False,
                f"the activation command `{settings.activate_cmd}` failed: {env['error']}",
                setup_fix + f", or set {ENV_PREFIX}ACTIVATE",
            )
        )
        return items
    py = env.get("python", "?")
    py_ok = tuple(int(x) for x in py.split(".")[:2]) >= (3, 11)
    items.append(
        CheckItem(
            "python", py_ok, f"{py} ({env.get('executable')})", "the venv needs Python >= 3.11"
        )
    )
    torch = env.get("torch", {})
    if "error" in torch:
        items.append(CheckItem("torch", False, f"not importable ({torch['error']})", setup_fix))
    else:
        n = torch.get("gpus", 0)
        items.append(
            CheckItem(
                "torch GPUs",
                n >= min_gpus,
                f"torch {torch.get('version')} (CUDA {torch.get('cuda')}) sees {n} GPU(s)"
                + (f", needs >= {min_gpus}" if n < min_gpus else ""),
                "install a CUDA build of torch in the venv and check nvidia-smi on the host",
            )
        )
    gpus = ans.get("gpus_setting", [])
    items.append(
        CheckItem(
            "gpu assignment",
            len(gpus) >= min_gpus,
            f"gpus setting {settings.gpus!r} -> indices {gpus} "
            f"(nvidia-smi: {ans.get('nvidia_smi')})",
            f"set {ENV_PREFIX}GPUS to the host's GPU indices (e.g. 0,1,2,3) or install the driver",
        )
    )
    for mod, why in (
        ("sglang", "the production engine"),
        ("snakemake", "runs each job"),
        ("eagleflow", "the workflow's code"),
        ("speculators", "training"),
    ):
        info = env.get(mod, {})
        ok = "error" not in info
        detail = f"{info.get('version')}" if ok else f"not importable ({info.get('error')})"
        fix = setup_fix
        if mod == "eagleflow" and not ok:
            fix = "the sources are pushed by the first job or by make remote-setup"
        items.append(CheckItem(mod, ok, f"{detail} ({why})", fix))
    return items


def local_rsync_version() -> str | None:
    try:
        out = subprocess.run(["rsync", "--version"], capture_output=True, text=True).stdout
    except OSError:
        return None
    m = re.search(r"version (\d+\.\d+\.\d+)", out)
    return m.group(1) if m else "?"


def _version_at_least(version: str | None, wanted: tuple[int, ...]) -> bool:
    try:
        return tuple(int(x) for x in (version or "").split(".")[:3]) >= wanted
    except ValueError:
        return False


def setup(
    settings: Settings, dry_run: bool = False, out=sys.stdout, bundle: str | None = None
) -> int:
    """Push the sources, create the remote venv with the gpu-host extra, then check it.

    With `bundle` (a folder `make device-bundle` wrote, inside the checkout) the host needs no
    package index: the parts travel with the sources, are checked against their manifest there
    and installed into `.eagleflow/site`, which a venv with the host's own packages (its CUDA
    torch) puts on its path after the pushed sources."""
    remote = Remote(settings)
    venv = settings.venv
    rel_bundle = None
    if bundle:
        path = Path(bundle).resolve()
        if not (path / "manifest.json").is_file():
            raise RemoteError(f"--bundle {bundle}: no manifest.json there; run make device-bundle")
        try:
            rel_bundle = str(path.relative_to(REPO_ROOT))
        except ValueError:
            raise RemoteError(
                f"--bundle {bundle} is outside the checkout {REPO_ROOT}; build it inside "
                "(make device-bundle writes .device/bundle)"
            ) from None
    install = (
        f"{venv}/bin/python src/eagleflow/bundle.py install {rel_bundle} --site .eagleflow/site"
        " (+ a .pth: src, then that site)"
        if rel_bundle
        else f"{venv}/bin/python -m pip install -e '.[gpu-host]'"
    )
    plan = [
        f"rsync the sources {settings.sources} to {settings.label}:{settings.remote_dir}",
        f"{settings.python} -m venv {'--system-site-packages ' if rel_bundle else ''}{venv}"
        f"   (in {settings.remote_dir}, if missing)",
        *([f"rsync the bundle {rel_bundle} (parts and manifest)"] if rel_bundle else []),
        install,
        "eagleflow remote check",
    ]
    if dry_run:
        print("remote setup would run:", file=out)
        for step in plan:
            print(f"  {step}", file=out)
        return 0
    if settings.activate and settings.activate != Settings().activate_cmd:
        print(f"note: activation is `{settings.activate}`; the venv is created at {venv}", file=out)
    print(f"== pushing sources to {settings.label}:{settings.remote_dir}", file=out)
    paths = [s for s in settings.sources if (REPO_ROOT / s).exists()] + (
        [rel_bundle] if rel_bundle else []
    )
    pushed = remote.push(REPO_ROOT, paths)
    if pushed["rc"] != 0:
        raise RemoteError(f"pushing the sources failed: {pushed['stderr']}")
    what = f"the offline bundle {rel_bundle}" if rel_bundle else "eagleflow[gpu-host]"
    print(f"== installing {what} into {venv} (log: .eagleflow/setup.log)", file=out)
    ans = remote.agent("setup", venv=venv, extra="gpu-host", bundle=rel_bundle, timeout=None)
    if not ans.get("ok"):
        print(f"FAILED: {ans.get('failed') or ans.get('error')} (exit {ans.get('rc')})", file=out)
        print(ans.get("tail", ""), file=out)
        return 1
    items = check(settings)
    for item in items:
        print(item.line(), file=out)
    return 0 if all(i.ok for i in items) else 1


def user_profile_dir() -> Path:
    """Where `snakemake --profile remote-gpu` finds the profile (Snakemake's user config dir)."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return Path(base) / "snakemake" / PROFILE_NAME


def install_profile(force: bool = False) -> Path:
    """Link profiles/remote-gpu into the user's Snakemake config dir (Snakemake does not look in
    ./profiles for --profile)."""
    link = user_profile_dir()
    if not (PROFILE_DIR / "config.yaml").is_file():
        raise RemoteError(f"{PROFILE_DIR} holds no profile (config.yaml); is this a checkout?")
    if link.is_symlink() and Path(os.readlink(link)) == PROFILE_DIR:
        return link
    if link.exists() or link.is_symlink():
        if not force:
            raise RemoteError(
                f"{link} exists and is not a link to {PROFILE_DIR}; move it away or pass --force"
            )
        if link.is_symlink() or link.is_file():
            link.unlink()
        else:
            raise RemoteError(f"{link} is a folder; move it away first")
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(PROFILE_DIR, target_is_directory=True)
    return link
